// add_rms_norm's FP8 form on the GPU (float32 and bfloat16 x): the sum and rstd as the plain
// forward writes them, and instead of y its FP8 copy, the copy's transpose and its amax
// (common/rms_norm.h, common/fp8.h). rms_norm.cu has the launcher and the handler.
//
// Register path (AddRmsNormFwdFp8Kernel): the plain forward's (rms_norm_fwd.cuh: a group of
// threads a row, the row in registers, the same group and the same order of sums, so the same
// rstd and y to the bit), over a block's tile of kFp8NormRows rows at a time. Each thread
// writes the FP8 bytes of its packs into q as they lie and into the block's tile of
// kFp8NormRows x C bytes in shared memory; once the tile's rows are done, the block writes it
// transposed into qt, a 16-byte run of a qt row a thread (32 rows: one 32-byte sector a qt
// row). Rows the register path does not take (not packed, too wide for its registers or its
// tile) take AddRmsNormFwdFp8AnyKernel: the plain block-per-row kernel's sums (the same
// rstd), then common/fp8.cuh's 64 x 64 tiles, reading the sum back.

#pragma once

#include "common/cuda_util.cuh"
#include "common/fp8.cuh"
#include "common/row_norm.cuh"
#include "cuda/rms_norm_fwd.cuh"

namespace blujax {
namespace {

constexpr int kFp8NormRows = 32;  // rows of the register path's tile
constexpr int kFp8NormPad = 16;   // bytes after each tile row (spreads the columns' banks)

template <typename T, int kGroup, int kVecs>
__global__ void __launch_bounds__(BlockFor<kGroup>())
AddRmsNormFwdFp8Kernel(const T* __restrict__ x, const T* __restrict__ residual,
                       const T* __restrict__ weight, const float* __restrict__ scale,
                       Fp8Format f, uint8_t* __restrict__ q, uint8_t* __restrict__ qt,
                       unsigned* __restrict__ amax, T* __restrict__ sum,
                       float* __restrict__ rstd, int64_t rows, int cols, float eps,
                       bool packed_t) {
  constexpr int kPack = Pack<T>::kSize;
  constexpr int kThreads = BlockFor<kGroup>(), kGroups = kThreads / kGroup;
  static_assert(kFp8NormRows % kGroups == 0, "a tile is whole passes of the groups");
  __shared__ float red[2 * kThreads / 32];
  extern __shared__ __align__(16) uint8_t tile[];  // [kFp8NormRows][cols + kFp8NormPad]
  const int stride = cols + kFp8NormPad;
  const int lane = threadIdx.x % kGroup, group = threadIdx.x / kGroup;
  const int packs = cols / kPack;
  const Divisor s = DivisorOf(*scale);
  unsigned bits = 0;
  // The loop bounds are the same for the whole block, so its barriers are reached by all.
  for (int64_t r0 = int64_t(blockIdx.x) * kFp8NormRows; r0 < rows;
       r0 += int64_t(gridDim.x) * kFp8NormRows) {
    for (int t0 = 0; t0 < kFp8NormRows; t0 += kGroups) {
      const int tr = t0 + group;
      const int64_t row = r0 + tr;
      const bool valid = row < rows;
      Pack<T> a[kVecs];
      const float rs =
          RowRstd<T, kGroup, kVecs, kThreads, true>(x, residual, sum, row, cols, lane, valid, a,
                                                    red, eps);
#pragma unroll
      for (int i = 0; i < kVecs; ++i) {
        const int p = lane + i * kGroup;
        if (valid && p < packs) {
          const Pack<T> w = LoadPack(weight + p * kPack);
          alignas(8) uint8_t b[kPack];
#pragma unroll
          for (int k = 0; k < kPack; ++k) {
            const float y = ToFloat(FromFloat<T>(PackElem(a[i], k) * rs * PackElem(w, k)));
            b[k] = ToFp8(y, s, f);
            bits = max(bits, __float_as_uint(fabsf(y)));
          }
          uint8_t* out = q + row * cols + int64_t(p) * kPack;
          uint8_t* in_tile = tile + tr * stride + p * kPack;
          if constexpr (kPack == 8) {
            *reinterpret_cast<uint2*>(out) = *reinterpret_cast<const uint2*>(b);
            *reinterpret_cast<uint2*>(in_tile) = *reinterpret_cast<const uint2*>(b);
          } else {
            *reinterpret_cast<uint32_t*>(out) = *reinterpret_cast<const uint32_t*>(b);
            *reinterpret_cast<uint32_t*>(in_tile) = *reinterpret_cast<const uint32_t*>(b);
          }
        }
      }
      if (valid && lane == 0) rstd[row] = rs;
    }
    __syncthreads();  // the tile is whole
    // qt[c, r0 + 16 h ...]: 16 rows of column c a thread.
    for (int item = threadIdx.x; item < cols * (kFp8NormRows / 16); item += kThreads) {
      const int c = item / (kFp8NormRows / 16), h = (item % (kFp8NormRows / 16)) * 16;
      const int64_t r = r0 + h;
      if (r >= rows) continue;
      alignas(16) uint8_t b[16];
#pragma unroll
      for (int j = 0; j < 16; ++j) b[j] = tile[(h + j) * stride + c];
      uint8_t* out = qt + int64_t(c) * rows + r;
      if (packed_t && r + 16 <= rows) {
        *reinterpret_cast<uint4*>(out) = *reinterpret_cast<const uint4*>(b);
      } else {
        for (int j = 0; j < 16 && r + j < rows; ++j) out[j] = b[j];
      }
    }
    __syncthreads();  // the tile is free again
  }
  PutAmax<kThreads>(bits, amax);
}

// Any shape: the plain block-per-row kernel's sums for each row of a 64-row tile (the same
// rstd), then the tile's columns 64 at a time through common/fp8.cuh, reading the sum back
// (written by this block: through the coherent path, not LoadRun's read-only one).
template <typename T>
__global__ void __launch_bounds__(kFp8Threads)
AddRmsNormFwdFp8AnyKernel(const T* __restrict__ x, const T* __restrict__ residual,
                          const T* __restrict__ weight, const float* __restrict__ scale,
                          Fp8Format f, uint8_t* __restrict__ q, uint8_t* __restrict__ qt,
                          unsigned* __restrict__ amax, T* sum, float* __restrict__ rstd,
                          int64_t rows, int cols, float eps, Fp8Layout lay) {
  static_assert(kFp8Threads == kBlock, "the plain kernel's block-per-row sums");
  __shared__ uint8_t tile[kFp8Tile][kFp8Tile + 4];
  __shared__ float rs[kFp8Tile];
  __shared__ float red[2 * kBlock / 32];
  const float inv_cols = 1.f / cols;
  const Divisor s = DivisorOf(*scale);
  unsigned bits = 0;
  for (int64_t r0 = int64_t(blockIdx.x) * kFp8Tile; r0 < rows;
       r0 += int64_t(gridDim.x) * kFp8Tile) {
    for (int tr = 0; tr < kFp8Tile && r0 + tr < rows; ++tr) {
      const int64_t off = (r0 + tr) * cols;
      float squares = 0.f, unused = 0.f;
      for (int c = threadIdx.x; c < cols; c += kBlock) {
        const T a = FromFloat<T>(ToFloat(x[off + c]) + ToFloat(residual[off + c]));
        sum[off + c] = a;
        const float v = ToFloat(a);
        squares = fmaf(v, v, squares);
      }
      GroupSum2<kBlock>(squares, unused, red);
      if (threadIdx.x == 0) {
        const float v = rsqrtf(squares * inv_cols + eps);
        rs[tr] = v;
        rstd[r0 + tr] = v;
      }
    }
    __syncthreads();  // rs, and the rows' sums
    for (int64_t c0 = 0; c0 < cols; c0 += kFp8Tile) {
      ForEachRun(r0, c0, rows, cols, [&](int tr, int tc, int64_t r, int64_t c, bool whole) {
        float v[kFp8Per], w[kFp8Per];
#pragma unroll
        for (int k = 0; k < kFp8Per; ++k)
          v[k] = c + k < cols ? ToFloat(sum[r * cols + c + k]) : 0.f;
        LoadRun(weight, c, cols, lay.packed && whole, w);
        const float rsr = rs[tr];
#pragma unroll
        for (int k = 0; k < kFp8Per; ++k) v[k] = v[k] * rsr * w[k];
        PutRun<T>(v, s, f, q + c, r, c, cols, cols, lay.packed_q && whole, tile, tr, tc, &bits);
      });
      __syncthreads();
      PutTransposed(tile, qt, r0, rows, c0, c0, cols, lay.packed_t);
      __syncthreads();  // the tile (and, after the last, rs) is free again
    }
  }
  PutAmax(bits, amax);
}

}  // namespace
}  // namespace blujax
