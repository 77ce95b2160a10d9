// The LayerNorm forward kernels (float32 and bfloat16, float32 statistics): a register path
// (a group of threads per row), a pipelined one for the plain op, and a block-per-row path for
// any shape. layernorm.cu has the overview, the launchers and the handlers; the backward
// kernels are in layernorm_bwd.cuh.

#pragma once

#include "common/cuda_util.cuh"
#include "common/row_norm.cuh"

namespace blujax {
namespace {

// The end of a forward row once a thread holds its packs' values in v (n of them, summing to
// sum): the row's mean and squared deviations in one exchange (each thread's own around its own
// mean, merged), then y = (v - mean) * rstd * weight + bias, and the row's statistics.
template <typename T, int kGroup, int kVecs>
__device__ __forceinline__ void NormalizeRow(const float (&v)[kVecs][Pack<T>::kSize], float n,
                                             float sum, bool valid, int lane, int64_t row,
                                             int cols, const T* __restrict__ weight,
                                             const T* __restrict__ bias, T* __restrict__ y,
                                             float* __restrict__ mean, float* __restrict__ rstd,
                                             float* red, float eps) {
  constexpr int kPack = Pack<T>::kSize;
  const int packs = cols / kPack;
  float m = n > 0.f ? sum / n : 0.f, m2 = 0.f;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    if (valid && lane + i * kGroup < packs) {
#pragma unroll
      for (int k = 0; k < kPack; ++k) m2 += (v[i][k] - m) * (v[i][k] - m);
    }
  }
  GroupMoments<kGroup>(n, m, m2, red);
  const float rs = rsqrtf(m2 * (1.f / cols) + eps);
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int p = lane + i * kGroup;
    if (valid && p < packs) {
      const Pack<T> w = LoadPack(weight + p * kPack), b = LoadPack(bias + p * kPack);
      Pack<T> out;
#pragma unroll
      for (int k = 0; k < kPack; ++k)
        out.v[k] = FromFloat<T>((v[i][k] - m) * rs * ToFloat(w.v[k]) + ToFloat(b.v[k]));
      StorePackNoL1(y + row * cols + int64_t(p) * kPack, out);
    }
  }
  if (valid && lane == 0) {
    mean[row] = m;
    rstd[row] = rs;
  }
}

// ----------------------------------------------------------------------------------------------
// Forward, register path: one row per group of kGroup threads, kVecs packs per thread.
template <typename T, int kGroup, int kVecs, bool kXBias>
__global__ void __launch_bounds__(BlockFor<kGroup>())
LayerNormFwdKernel(const T* __restrict__ x, const T* __restrict__ x_bias,
                   const T* __restrict__ residual, const T* __restrict__ weight,
                   const T* __restrict__ bias, T* __restrict__ y, T* __restrict__ sum,
                   float* __restrict__ mean, float* __restrict__ rstd, int64_t rows, int cols,
                   float eps) {
  constexpr int kPack = Pack<T>::kSize;
  constexpr int kGroups = BlockFor<kGroup>() / kGroup;
  __shared__ float red[3 * BlockFor<kGroup>() / 32];
  const int lane = threadIdx.x % kGroup, group = threadIdx.x / kGroup;
  const int packs = cols / kPack;

  // The loop bound is the same for the whole block, so the group reductions may synchronise it.
  for (int64_t base = int64_t(blockIdx.x) * kGroups; base < rows;
       base += int64_t(gridDim.x) * kGroups) {
    const int64_t row = base + group;
    const bool valid = row < rows;
    float v[kVecs][kPack];
    float s = 0.f, n = 0.f;
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int p = lane + i * kGroup;
      if (valid && p < packs) {
        const int64_t off = row * cols + int64_t(p) * kPack;
        Pack<T> a = LoadPackNoL1(x + off);
        if (kXBias || residual) {
          Pack<T> r = LoadPackNoL1(residual + off);
          if constexpr (kXBias) {
            const Pack<T> xb = LoadPack(x_bias + p * kPack);
#pragma unroll
            for (int k = 0; k < kPack; ++k)
              a.v[k] = FromFloat<T>(ToFloat(a.v[k]) + ToFloat(xb.v[k]) + ToFloat(r.v[k]));
          } else {
#pragma unroll
            for (int k = 0; k < kPack; ++k)
              a.v[k] = FromFloat<T>(ToFloat(a.v[k]) + ToFloat(r.v[k]));
          }
          // Rounded to T: the statistics are those of the sum returned.
          StorePackNoL1(sum + off, a);
        }
#pragma unroll
        for (int k = 0; k < kPack; ++k) {
          v[i][k] = ToFloat(a.v[k]);
          s += v[i][k];
        }
        n += kPack;
      }
    }
    NormalizeRow<T, kGroup, kVecs>(v, n, s, valid, lane, row, cols, weight, bias, y, mean, rstd,
                                   red, eps);
  }
}

// Forward, pipelined (the plain op): as LayerNormFwdKernel, but each thread copies its packs of
// the row kStages - 1 steps ahead into shared memory (cp.async), so the next rows' loads are in
// flight while this row is reduced, normalised and written; the register kernel issues a row's
// loads only once the previous row is done (measured faster, benchmarks/LOG.md). Each thread
// reads back only the packs it copied, so the pipeline needs no barrier.
// Shared memory: [group][stage][vec][lane] packs, vecs = the packs a thread holds. (For the add
// variants the second input's stages halve the blocks a multiprocessor holds, and the register
// kernel measured faster.)
template <typename T, int kGroup, int kVecs, int kStages>
__global__ void __launch_bounds__(BlockFor<kGroup>())
LayerNormFwdPipeKernel(const T* __restrict__ x, const T* __restrict__ weight,
                       const T* __restrict__ bias, T* __restrict__ y, float* __restrict__ mean,
                       float* __restrict__ rstd, int64_t rows, int cols, float eps) {
  constexpr int kPack = Pack<T>::kSize;
  constexpr int kGroups = BlockFor<kGroup>() / kGroup;
  __shared__ float red[3 * BlockFor<kGroup>() / 32];
  extern __shared__ uint4 staged[];
  const int lane = threadIdx.x % kGroup, group = threadIdx.x / kGroup;
  const int packs = cols / kPack, vecs = (packs + kGroup - 1) / kGroup;
  uint4* const mine = staged + int64_t(group) * kStages * vecs * kGroup + lane;
  const int64_t stride = int64_t(gridDim.x) * kGroups;
  auto issue = [&](int64_t row, int stage) {
    if (row < rows) {
#pragma unroll
      for (int i = 0; i < kVecs; ++i) {
        const int p = lane + i * kGroup;
        if (p < packs)
          CopyAsync16(mine + (stage * vecs + i) * kGroup, x + row * cols + int64_t(p) * kPack);
      }
    }
    CopyAsyncCommit();  // possibly empty: one group a step keeps the count that Wait relies on
  };

  int64_t base = int64_t(blockIdx.x) * kGroups;
#pragma unroll
  for (int stage = 0; stage < kStages - 1; ++stage) issue(base + group + stage * stride, stage);
  // The loop bound is the same for the whole block, so the group reductions may synchronise it.
  for (int stage = 0; base < rows; base += stride, stage = (stage + 1) % kStages) {
    // Into the stage this thread finished reading in the previous step.
    issue(base + group + (kStages - 1) * stride, (stage + kStages - 1) % kStages);
    CopyAsyncWait<kStages - 1>();  // this thread's packs of this step's row have landed
    const int64_t row = base + group;
    const bool valid = row < rows;
    float v[kVecs][kPack];
    float sum = 0.f, n = 0.f;
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int p = lane + i * kGroup;
      if (valid && p < packs) {
        Pack<T> a;
        *reinterpret_cast<uint4*>(&a) = mine[(stage * vecs + i) * kGroup];
#pragma unroll
        for (int k = 0; k < kPack; ++k) {
          v[i][k] = ToFloat(a.v[k]);
          sum += v[i][k];
        }
        n += kPack;
      }
    }
    NormalizeRow<T, kGroup, kVecs>(v, n, sum, valid, lane, row, cols, weight, bias, y, mean, rstd,
                                   red, eps);
  }
  CopyAsyncWaitAll();  // the copies issued past the last row are empty; leave no group open
}

// Forward, any shape: a block per row, three passes over the row in memory.
template <typename T, bool kXBias>
__global__ void __launch_bounds__(kBlock)
LayerNormFwdAnyKernel(const T* x, const T* __restrict__ x_bias, const T* __restrict__ residual,
                      const T* __restrict__ weight, const T* __restrict__ bias, T* __restrict__ y,
                      T* sum, float* __restrict__ mean, float* __restrict__ rstd,
                      int64_t rows, int cols, float eps) {
  __shared__ float red[2 * kBlock / 32];
  const float inv_cols = 1.f / cols;
  // Pass 2 and 3 read the row from `sum` for the add variant: each thread reads back only the
  // elements it wrote itself, so no barrier is needed for them.
  const T* src = kXBias || residual ? sum : x;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t off = row * cols;
    float s = 0.f, unused = 0.f;
    for (int c = threadIdx.x; c < cols; c += kBlock) {
      T a = x[off + c];
      if (kXBias || residual) {
        float v = ToFloat(a);
        if constexpr (kXBias) v += ToFloat(x_bias[c]);
        a = FromFloat<T>(v + ToFloat(residual[off + c]));
        sum[off + c] = a;
      }
      s += ToFloat(a);
    }
    GroupSum2<kBlock>(s, unused, red);
    const float m = s * inv_cols;
    float q = 0.f;
    for (int c = threadIdx.x; c < cols; c += kBlock) {
      const float d = ToFloat(src[off + c]) - m;
      q += d * d;
    }
    GroupSum2<kBlock>(q, unused, red);
    const float rs = rsqrtf(q * inv_cols + eps);
    for (int c = threadIdx.x; c < cols; c += kBlock)
      y[off + c] = FromFloat<T>((ToFloat(src[off + c]) - m) * rs * ToFloat(weight[c]) +
                                ToFloat(bias[c]));
    if (threadIdx.x == 0) {
      mean[row] = m;
      rstd[row] = rs;
    }
  }
}

}  // namespace
}  // namespace blujax
