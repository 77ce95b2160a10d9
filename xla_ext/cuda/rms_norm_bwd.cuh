// The RMSNorm backward kernels: dx, and dweight as one partial row per block that
// RmsNormReducePartials sums. The register path and the sums are LayerNorm's, templated on the
// mean term (common/row_norm.cuh); rms_norm.cu has the overview, the launchers and the
// handlers.

#pragma once

#include "common/cuda_util.cuh"
#include "common/row_norm.cuh"

namespace blujax {
namespace {

// RMSNorm's mean term (RowNormBwdRows, common/row_norm.cuh): none, and no bias. With
// xhat = x * rstd and g = dy * weight:
//   dx = rstd * (g - xhat * mean(g * xhat)) = g * rstd + xhat * c1,  c1 = -rstd * mean(g * xhat)
// and mean(g * xhat) = rstd * mean(g * x): one sum a row.
struct RmsNormTerm {
  static constexpr bool kBias = false;
  __device__ __forceinline__ static float Mean(const float*, int64_t, bool) { return 0.f; }

  float sum_gx = 0.f, c1 = 0.f;
  __device__ __forceinline__ explicit RmsNormTerm(float) {}
  __device__ __forceinline__ void Add(float g, float x) { sum_gx = fmaf(g, x, sum_gx); }
  template <int kGroup, int kThreads>
  __device__ __forceinline__ void Reduce(float* red, float rs, float inv_cols) {
    float unused = 0.f;
    GroupSum2<kGroup, kThreads>(sum_gx, unused, red);
    c1 = -rs * (rs * sum_gx * inv_cols);
  }
  __device__ __forceinline__ float Xhat(float x, float rs) const { return x * rs; }
  __device__ __forceinline__ float Dx(float g, float xhat, float rs) const {
    return fmaf(g, rs, xhat * c1);
  }
};

// Backward, register path (RowNormBwdRows): a group of kGroup threads a row, dy and x in
// registers, dweight summed per group in shared memory and left as the block's partial row.
// The weight is read again for every row, through the read-only cache: holding bfloat16's in
// registers, as LayerNorm's backward does, made these kernels spill.
template <typename T, int kGroup, int kVecs, int kThreads, bool kAdd>
__global__ void __launch_bounds__(kThreads, BwdMinBlocks<kThreads>())
RmsNormBwdKernel(const T* __restrict__ dy, const T* __restrict__ dsum, const T* __restrict__ x,
                 const T* __restrict__ weight, const float* __restrict__ rstd,
                 T* __restrict__ dx, float* __restrict__ ws, int64_t rows, int cols) {
  RowNormBwdRows<RmsNormTerm, T, kGroup, kVecs, kThreads, /*kXBias=*/false, /*kHoldW=*/false,
                 kAdd>(dy, kAdd ? dsum : nullptr, x, weight, nullptr, rstd, dx, ws, rows, cols);
}

// Backward, any shape: a block per row, two passes; column c of the block's partial row is
// owned by thread c % kBlock, which zeroes it and accumulates it in place.
template <typename T, bool kAdd>
__global__ void __launch_bounds__(kBlock)
RmsNormBwdAnyKernel(const T* __restrict__ dy, const T* __restrict__ dsum,
                    const T* __restrict__ x, const T* __restrict__ weight,
                    const float* __restrict__ rstd, T* __restrict__ dx, float* __restrict__ ws,
                    int64_t rows, int cols) {
  __shared__ float red[2 * kBlock / 32];
  const float inv_cols = 1.f / cols;
  float* part = ws + int64_t(blockIdx.x) * cols;
  for (int c = threadIdx.x; c < cols; c += kBlock) part[c] = 0.f;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t off = row * cols;
    const float rs = rstd[row];
    float sum_gx = 0.f, unused = 0.f;
    for (int c = threadIdx.x; c < cols; c += kBlock)
      sum_gx = fmaf(ToFloat(dy[off + c]) * ToFloat(weight[c]), ToFloat(x[off + c]), sum_gx);
    GroupSum2<kBlock>(sum_gx, unused, red);
    const float c1 = -rs * (rs * sum_gx * inv_cols);
    for (int c = threadIdx.x; c < cols; c += kBlock) {
      const float d = ToFloat(dy[off + c]), xhat = ToFloat(x[off + c]) * rs;
      float out = fmaf(d * ToFloat(weight[c]), rs, xhat * c1);
      if constexpr (kAdd) out += ToFloat(dsum[off + c]);
      dx[off + c] = FromFloat<T>(out);
      part[c] += d * xhat;
    }
  }
}

// dweight: the sum of the blocks' partial rows (ReducePartialRows, common/row_norm.cuh).
template <typename T>
__global__ void __launch_bounds__(kReduceX * kReduceY)
RmsNormReducePartials(const float* __restrict__ ws, int partials, int cols,
                      T* __restrict__ dweight) {
  ReducePartialRows<T, 1>(ws, partials, cols, dweight, nullptr, nullptr);
}

// The backward's kernels for dtype T and variant kAdd, as LaunchBwdRows takes them.
template <typename T, bool kAdd>
struct RmsNormBwdKernels {
  static constexpr int kPlanes = 1;
  template <int kGroup>
  static constexpr auto Register() {
    return RmsNormBwdKernel<T, kGroup, BwdVecs<T>(), BwdBlockFor<kGroup>(), kAdd>;
  }
  static constexpr auto kAny = RmsNormBwdAnyKernel<T, kAdd>;
};

}  // namespace
}  // namespace blujax
