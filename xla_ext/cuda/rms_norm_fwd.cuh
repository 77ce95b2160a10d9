// The RMSNorm forward kernels (float32 and bfloat16, float32 statistics): a register path (a
// group of threads per row) and a block-per-row path for any shape. rms_norm.cu has the
// overview, the launchers and the handlers; the backward kernels are in rms_norm_bwd.cuh.

#pragma once

#include "common/cuda_util.cuh"
#include "common/row_norm.cuh"

namespace blujax {
namespace {

// The packs of a row a thread of its group holds (lane + i kGroup, i < kVecs) into a, the
// residual added with kAdd (the sum rounded to T and stored: the statistics are those of the
// sum returned); returns the sum of their squares. Nothing where !valid. (Also the FP8 form's,
// rms_norm_fp8.cuh: the same sums, the same rstd.)
template <typename T, int kGroup, int kVecs, bool kAdd>
__device__ __forceinline__ float LoadRowPacks(const T* __restrict__ x,
                                              const T* __restrict__ residual,
                                              T* __restrict__ sum, int64_t row, int cols,
                                              int lane, bool valid, Pack<T> (&a)[kVecs]) {
  constexpr int kPack = Pack<T>::kSize;
  const int packs = cols / kPack;
  float squares = 0.f;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int p = lane + i * kGroup;
    if (valid && p < packs) {
      const int64_t off = row * cols + int64_t(p) * kPack;
      a[i] = LoadPackNoL1(x + off);
      if constexpr (kAdd) {
        const Pack<T> r = LoadPackNoL1(residual + off);
        float s[kPack];
#pragma unroll
        for (int k = 0; k < kPack; ++k) s[k] = PackElem(a[i], k) + PackElem(r, k);
        a[i] = PackFromFloats<T>(s);
        StorePackNoL1(sum + off, a[i]);
      }
#pragma unroll
      for (int k = 0; k < kPack; ++k) {
        const float v = PackElem(a[i], k);
        squares = fmaf(v, v, squares);
      }
    }
  }
  return squares;
}

// LoadRowPacks, then the row's rstd from its group's sum of squares (red: the block's scratch
// for GroupSum2).
template <typename T, int kGroup, int kVecs, int kThreads, bool kAdd>
__device__ __forceinline__ float RowRstd(const T* __restrict__ x, const T* __restrict__ residual,
                                         T* __restrict__ sum, int64_t row, int cols, int lane,
                                         bool valid, Pack<T> (&a)[kVecs], float* red, float eps) {
  float squares = LoadRowPacks<T, kGroup, kVecs, kAdd>(x, residual, sum, row, cols, lane, valid,
                                                        a);
  float unused = 0.f;
  GroupSum2<kGroup, kThreads>(squares, unused, red);
  return rsqrtf(squares * (1.f / cols) + eps);
}

// ----------------------------------------------------------------------------------------------
// Forward, register path: one row per group of kGroup threads, kVecs packs per thread, kept as
// packs (a bfloat16 pack in 4 registers) between the reduction and the write.
template <typename T, int kGroup, int kVecs, bool kAdd>
__global__ void __launch_bounds__(BlockFor<kGroup>())
RmsNormFwdKernel(const T* __restrict__ x, const T* __restrict__ residual,
                 const T* __restrict__ weight, T* __restrict__ y, T* __restrict__ sum,
                 float* __restrict__ rstd, int64_t rows, int cols, float eps) {
  constexpr int kPack = Pack<T>::kSize;
  constexpr int kThreads = BlockFor<kGroup>(), kGroups = kThreads / kGroup;
  __shared__ float red[2 * kThreads / 32];
  const int lane = threadIdx.x % kGroup, group = threadIdx.x / kGroup;
  const int packs = cols / kPack;

  // The loop bound is the same for the whole block, so the group reductions may synchronise it.
  for (int64_t base = int64_t(blockIdx.x) * kGroups; base < rows;
       base += int64_t(gridDim.x) * kGroups) {
    const int64_t row = base + group;
    const bool valid = row < rows;
    Pack<T> a[kVecs];
    const float rs =
        RowRstd<T, kGroup, kVecs, kThreads, kAdd>(x, residual, sum, row, cols, lane, valid, a,
                                                  red, eps);
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int p = lane + i * kGroup;
      if (valid && p < packs) {
        const Pack<T> w = LoadPack(weight + p * kPack);
        float o[kPack];
#pragma unroll
        for (int k = 0; k < kPack; ++k) o[k] = PackElem(a[i], k) * rs * PackElem(w, k);
        StorePackNoL1(y + row * cols + int64_t(p) * kPack, PackFromFloats<T>(o));
      }
    }
    if (valid && lane == 0) rstd[row] = rs;
  }
}

// Forward, any shape: a block per row, two passes over the row in memory.
template <typename T, bool kAdd>
__global__ void __launch_bounds__(kBlock)
RmsNormFwdAnyKernel(const T* x, const T* __restrict__ residual, const T* __restrict__ weight,
                    T* __restrict__ y, T* sum, float* __restrict__ rstd, int64_t rows, int cols,
                    float eps) {
  __shared__ float red[2 * kBlock / 32];
  const float inv_cols = 1.f / cols;
  // The second pass reads the row from `sum` for the add variant: each thread reads back only
  // the elements it wrote itself, so no barrier is needed for them.
  const T* src = kAdd ? sum : x;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t off = row * cols;
    float squares = 0.f, unused = 0.f;
    for (int c = threadIdx.x; c < cols; c += kBlock) {
      T a = x[off + c];
      if constexpr (kAdd) {
        a = FromFloat<T>(ToFloat(a) + ToFloat(residual[off + c]));
        sum[off + c] = a;
      }
      const float v = ToFloat(a);
      squares = fmaf(v, v, squares);
    }
    GroupSum2<kBlock>(squares, unused, red);
    const float rs = rsqrtf(squares * inv_cols + eps);
    for (int c = threadIdx.x; c < cols; c += kBlock)
      y[off + c] = FromFloat<T>(ToFloat(src[off + c]) * rs * ToFloat(weight[c]));
    if (threadIdx.x == 0) rstd[row] = rs;
  }
}

}  // namespace
}  // namespace blujax
