// What every attention kernel on the GPU shares (xla_ext/cuda/attention.cu says how they fit
// together): the problem geometry, block coordinates, PTX wrappers for cp.async, ldmatrix and
// mma.sync, and the shared-memory tile layout and loads.

#pragma once

#include <cmath>
#include <cstdint>

#include "common/cuda_util.cuh"

namespace blujax {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 128;  // 4 warps, in every attention kernel
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr unsigned kFull = 0xffffffffu;
constexpr int kDefaultSmem = 48 << 10;  // dynamic shared memory a kernel gets without opting in

// What every kernel knows about the problem. [B, T, H, D] tensors: one (batch, head) slice is
// T rows of D elements, H * D apart.
struct Geometry {
  int heads = 0;
  int tq = 0, tk = 0;
  bool causal = false;
  float scale = 0.f;       // applied to dQ and dK at the end
  float scale_log2 = 0.f;  // scale * log2(e): scores in log2 units for exp2f
  // Elements from one token's row of dq, dk, dv to the next: H * D, or 3 * H * D when the
  // three are written into one [B, T, 3, H, D] gradient of a fused QKV projection.
  int64_t grad_stride = 0;
};

// Offset of row 0 of (batch, head) bh in a [B, T, H, D] tensor.
template <int D>
__device__ __forceinline__ int64_t HeadOffset(int64_t bh, int t_len, int heads) {
  const int64_t b = bh / heads, h = bh % heads;
  return (b * t_len * heads + h) * D;
}

// Offset of row 0 of (batch, head) bh in a gradient output (dq, dk or dv): rows are
// g.grad_stride apart.
template <int D>
__device__ __forceinline__ int64_t GradOffset(int64_t bh, int t_len, const Geometry& g) {
  const int64_t b = bh / g.heads, h = bh % g.heads;
  return b * t_len * g.grad_stride + h * D;
}

// This CTA's (tile, batch*head). Tiles vary fastest; `reverse` issues the last tile first.
__device__ __forceinline__ void BlockCoords(int n_tiles, bool reverse, int* tile, int64_t* bh) {
  const int64_t id = blockIdx.x;
  *bh = id / n_tiles;
  const int t = static_cast<int>(id % n_tiles);
  *tile = reverse ? n_tiles - 1 - t : t;
}

// Key tiles a query block [q0, q0 + rows) needs: causal stops at the block's last query.
__device__ __forceinline__ int KeyTiles(const Geometry& g, int q0, int rows, int tile) {
  const int last_key = g.causal ? min(q0 + rows, g.tq) - 1 : g.tk - 1;
  return last_key / tile + 1;
}

// ---------------------------------------------------------------------------------------------
// PTX wrappers.

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared without blocking; when !valid nothing is read and zeros are
// written (cp.async's src-size 0).
__device__ __forceinline__ void CpAsync16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SmemAddr(dst)),
               "l"(__cvta_generic_to_global(src)), "r"(valid ? 16 : 0)
               : "memory");
}

__device__ __forceinline__ void CpAsync4(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(SmemAddr(dst)),
               "l"(__cvta_generic_to_global(src)), "r"(valid ? 4 : 0)
               : "memory");
}

__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

__device__ __forceinline__ void CpAsyncWaitAll() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

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
// 8n..8n+7: an mma's output layout is its successor's input layout, so no data moves.
template <int kN>
__device__ __forceinline__ void AccToOperand(uint32_t (&a)[4], const float (&c)[kN][4], int kk) {
  a[0] = PackBf16(c[2 * kk][0], c[2 * kk][1]);
  a[1] = PackBf16(c[2 * kk][2], c[2 * kk][3]);
  a[2] = PackBf16(c[2 * kk + 1][0], c[2 * kk + 1][1]);
  a[3] = PackBf16(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

// ---------------------------------------------------------------------------------------------
// Shared-memory tiles.

// Element offset of 16-byte chunk `chunk` of row `row` in a swizzled bfloat16 tile.
template <int kChunks>
__device__ __forceinline__ int Swz(int row, int chunk) {
  static_assert(kChunks % 8 == 0, "the swizzle permutes groups of 8 chunks");
  return (row * kChunks + (chunk ^ (row & 7))) * 8;
}

// Rows [row0, row0 + kRows) of one (batch, head) slice -> shared memory, asynchronously;
// rows >= n_rows become zeros. kSwizzle: the bfloat16 layout above, else plain [kRows][D].
template <int kRows, int D, bool kSwizzle, typename T>
__device__ __forceinline__ void LoadTile(T* smem, const T* head, int64_t stride, int row0,
                                         int n_rows) {
  constexpr int kPack = 16 / sizeof(T), kChunks = D / kPack;
  static_assert((kRows * kChunks) % kThreads == 0, "whole chunks per thread");
#pragma unroll
  for (int i = 0; i < kRows * kChunks / kThreads; ++i) {
    const int c = threadIdx.x + i * kThreads, r = c / kChunks, ch = c % kChunks;
    const bool valid = row0 + r < n_rows;
    const T* src = head + (valid ? int64_t(row0 + r) * stride : 0) + ch * kPack;
    T* dst = smem + (kSwizzle ? Swz<kChunks>(r, ch) : (r * kChunks + ch) * kPack);
    CpAsync16(dst, src, valid);
  }
}

// kRows per-row statistics (lse or delta of one (batch, head)) starting at row0; zeros past n.
template <int kRows>
__device__ __forceinline__ void LoadStats(float* smem, const float* row_stats, int row0, int n) {
  static_assert(kRows <= kThreads, "one value per thread");
  if (threadIdx.x < kRows) {
    const bool valid = row0 + int(threadIdx.x) < n;
    CpAsync4(smem + threadIdx.x, row_stats + (valid ? row0 + threadIdx.x : 0), valid);
  }
}

}  // namespace
}  // namespace blujax
