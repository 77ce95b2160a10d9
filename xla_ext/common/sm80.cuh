// PTX wrappers for the tensor-core instructions of sm_80 and later (Ampere on, so Hopper too):
// ldmatrix and mma.sync on bfloat16, and the register layouts between them. Hopper's own
// instructions (wgmma, TMA, mbarriers) are in common/sm90.cuh.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common/cuda_util.cuh"

namespace blujax {

using bf16 = __nv_bfloat16;

// Four 8x8 bfloat16 matrices from shared memory; lane i gives the address of row i % 8 of
// matrix i / 8, and register r receives matrix r in the mma operand layout (.trans: transposed).
__device__ __forceinline__ void LdMatrix(uint32_t (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddr(p))
               : "memory");
}

__device__ __forceinline__ void LdMatrixTrans(uint32_t (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddr(p))
               : "memory");
}

// c += a b for a 16x16 A (row major) and a 16x8 B (column major). Per lane, with
// g = lane / 4 and t = lane % 4: c = {(g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)};
// a = {(g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..)}; b = {(2t..2t+1, g), (2t+8.., g)}.
__device__ __forceinline__ void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // lo in the low half: the lower column
  return *reinterpret_cast<uint32_t*>(&v);
}

// The A operand of a k-step over columns 16kk..16kk+15 from accumulators c[n] of columns
// 8n..8n+7: an mma's output layout is its successor's input layout, so no data moves. (The
// same holds for a Hopper warpgroup MMA's accumulators, per warp.)
template <int kN>
__device__ __forceinline__ void AccToOperand(uint32_t (&a)[4], const float (&c)[kN][4], int kk) {
  a[0] = PackBf16(c[2 * kk][0], c[2 * kk][1]);
  a[1] = PackBf16(c[2 * kk][2], c[2 * kk][3]);
  a[2] = PackBf16(c[2 * kk + 1][0], c[2 * kk + 1][1]);
  a[3] = PackBf16(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

}  // namespace blujax
