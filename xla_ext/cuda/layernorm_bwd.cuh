// The LayerNorm backward kernels: dx, and dweight/dbias (dx_bias for the add-bias variant) as
// one partial row per block that LayerNormReducePartials sums. The register path and the sums
// are RMSNorm's too, templated on the mean term (common/row_norm.cuh); layernorm.cu has the
// overview, the launchers and the handlers.

#pragma once

#include "common/cuda_util.cuh"
#include "common/row_norm.cuh"
#include "cuda/layernorm_fwd.cuh"

namespace blujax {
namespace {

// LayerNorm's mean term, the part of the register-path backward (RowNormBwdRows,
// common/row_norm.cuh) that RMSNorm's lacks. With xhat = (x - mean) * rstd and g = dy * weight:
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) = g * rstd + (xhat * c1 + c0)
// from two sums a row, of g and of g * (x - mean) (rstd is applied once a row, not an
// element); and a bias, whose gradient dbias is the column sum of dy.
struct LayerNormTerm {
  static constexpr bool kBias = true;
  __device__ __forceinline__ static float Mean(const float* __restrict__ mean, int64_t row,
                                               bool valid) {
    return valid ? mean[row] : 0.f;
  }

  float m, sum_gxm = 0.f, sum_g = 0.f, c0 = 0.f, c1 = 0.f;
  __device__ __forceinline__ explicit LayerNormTerm(float mean) : m(mean) {}
  __device__ __forceinline__ void Add(float g, float x) {
    sum_g += g;
    sum_gxm += g * (x - m);
  }
  template <int kGroup, int kThreads>
  __device__ __forceinline__ void Reduce(float* red, float rs, float inv_cols) {
    GroupSum2<kGroup, kThreads>(sum_g, sum_gxm, red);
    c0 = -rs * sum_g * inv_cols;
    c1 = -rs * rs * sum_gxm * inv_cols;
  }
  __device__ __forceinline__ float Xhat(float x, float rs) const { return (x - m) * rs; }
  __device__ __forceinline__ float Dx(float g, float xhat, float rs) const {
    return fmaf(g, rs, fmaf(xhat, c1, c0));
  }
};

// Backward, register path (RowNormBwdRows): a group of kGroup threads a row, dy and x in
// registers, dweight/dbias (with kXBias dx_bias too) summed per group in shared memory and left
// as the block's partial row. One kernel for the plain and the add variant (dsum null or not).
// bfloat16 keeps the weight of its columns in registers (8 of them; measured faster); float32
// and the add-bias variant have no registers to spare for it.
template <typename T, int kGroup, int kVecs, int kThreads, bool kXBias>
__global__ void __launch_bounds__(kThreads, BwdMinBlocks<kThreads>())
LayerNormBwdKernel(const T* __restrict__ dy, const T* __restrict__ dsum, const T* __restrict__ x,
                   const T* __restrict__ weight, const float* __restrict__ mean,
                   const float* __restrict__ rstd, T* __restrict__ dx, float* __restrict__ ws,
                   int64_t rows, int cols) {
  RowNormBwdRows<LayerNormTerm, T, kGroup, kVecs, kThreads, kXBias, sizeof(T) == 2 && !kXBias,
                 /*kAdd=*/kXBias>(dy, dsum, x, weight, mean, rstd, dx, ws, rows, cols);
}

// Backward, a pack a thread (bfloat16 rows of up to 32 kWarps packs, C <= 1024): a group of
// kWarps warps takes a row at a time, each thread one 8-element pack of dy and x, and keeps its
// pack's dweight/dbias sums in registers across every row it visits (16 of them), so the row
// loop has no shared-memory accumulation at all, and no thread idles for want of a second pack
// (C = 768 is 96 packs: 3 warps, where the register path's 64-thread groups leave half of the
// second packs empty). At the end the block's groups sum their registers through shared memory
// into the block's partial row. Against the register path it measured faster at C <= 1024;
// groups of 12 and 16 warps (C = 3072, 4096) were slower, a row's barriers then spanning too
// many warps.
// Each thread copies its packs of the group's next row into shared memory (cp.async) before it
// works this one, so a row's loads are in flight while the previous row is reduced and written;
// the registers have no room to hold them (measured faster than loading each row as it starts,
// but for C = 256, where it is level; two or three rows ahead measured slower than one).
template <typename T, int kWarps, int kGroups, bool kSum>
__global__ void __launch_bounds__(kWarps * 32 * kGroups, 2)
LayerNormBwdPackKernel(const T* __restrict__ dy, const T* __restrict__ dsum,
                       const T* __restrict__ x, const T* __restrict__ weight,
                       const float* __restrict__ mean, const float* __restrict__ rstd,
                       T* __restrict__ dx, float* __restrict__ ws, int64_t rows, int cols) {
  constexpr int kPack = Pack<T>::kSize, kGroup = kWarps * 32, kThreads = kGroup * kGroups;
  __shared__ float red[2 * kThreads / 32];
  // While rows run, two stages of packs, [stage][dy, x (, dsum)][thread]; at the end the
  // groups' sums, [group][dweight, dbias][cols].
  extern __shared__ float4 acc4[];
  constexpr uint32_t kPlane = kThreads * sizeof(uint4), kStage = (kSum ? 3 : 2) * kPlane;
  const uint32_t stage0 =
      static_cast<uint32_t>(__cvta_generic_to_shared(acc4)) + threadIdx.x * sizeof(uint4);
  const int lane = threadIdx.x % kGroup, group = threadIdx.x / kGroup;
  const bool active = lane < cols / kPack;  // the row's last warp may have lanes past its end
  const int col0 = lane * kPack;
  const float inv_cols = 1.f / cols;
  const int64_t stride = int64_t(gridDim.x) * kGroups;
  int64_t row = int64_t(blockIdx.x) * kGroups + group;
  // This thread's packs of row r into the stage at `at`, as one group of copies (empty past
  // the last row, so that every step commits one and the wait below counts right).
  auto stage_row = [&](int64_t r, uint32_t at) {
    if (active && r < rows) {
      const int64_t off = r * cols + col0;
      CopyAsync16At(at, dy + off);
      CopyAsync16At(at + kPlane, x + off);
      if constexpr (kSum) CopyAsync16At(at + 2 * kPlane, dsum + off);
    }
    CopyAsyncCommit();
  };
  Pack<T> w{};
  if (active) w = LoadPack(weight + col0);
  float dw[kPack] = {}, db[kPack] = {};
  stage_row(row, stage0);
  // mean and rstd a row ahead too, in registers.
  float m_next = 0.f, rs_next = 0.f;
  if (row < rows) {
    m_next = mean[row];
    rs_next = rstd[row];
  }
  auto other = [&](uint32_t at) { return at == stage0 ? at + kStage : stage0; };
  for (uint32_t at = stage0; row < rows; row += stride, at = other(at)) {
    const int64_t off = row * cols + col0;
    // The other stage was read in the previous step (its values were used there).
    stage_row(row + stride, other(at));
    const float m = m_next, rs = rs_next;
    if (row + stride < rows) {
      m_next = mean[row + stride];
      rs_next = rstd[row + stride];
    }
    CopyAsyncWait<1>();  // this row's copies have landed; the next row's may not have
    Pack<T> d, a;
    float sum_g = 0.f, sum_gxm = 0.f;
    if (active) {
      d = LoadSharedPack<T>(at);
      a = LoadSharedPack<T>(at + kPlane);
#pragma unroll
      for (int k = 0; k < kPack; ++k) {
        const float g = PackElem(d, k) * PackElem(w, k);
        sum_g += g;
        sum_gxm += g * (PackElem(a, k) - m);
      }
    }
    GroupSum2<kGroup, kThreads>(sum_g, sum_gxm, red);
    // As in the register path: dx = g * rs + (xhat * c1 + c0).
    const float c0 = -rs * sum_g * inv_cols, c1 = -rs * rs * sum_gxm * inv_cols;
    if (active) {
      Pack<T> ds;
      if constexpr (kSum) ds = LoadSharedPack<T>(at + 2 * kPlane);
      float o[kPack];
#pragma unroll
      for (int k = 0; k < kPack; ++k) {
        const float dd = PackElem(d, k), xhat = (PackElem(a, k) - m) * rs;
        o[k] = fmaf(dd * PackElem(w, k), rs, fmaf(xhat, c1, c0));
        if constexpr (kSum) o[k] += PackElem(ds, k);
        dw[k] = fmaf(dd, xhat, dw[k]);
        db[k] += dd;
      }
      StorePackNoL1(dx + off, PackFromFloats<T>(o));
    }
  }
  CopyAsyncWaitAll();  // the last step's copies were empty; leave none open
  __syncthreads();     // every thread done with the stages before they hold the sums
  float* acc = reinterpret_cast<float*>(acc4);
  if (active) {
    float* own = acc + int64_t(group) * 2 * cols + col0;
#pragma unroll
    for (int k = 0; k < kPack; k += 4) {
      *reinterpret_cast<float4*>(own + k) = make_float4(dw[k], dw[k + 1], dw[k + 2], dw[k + 3]);
      *reinterpret_cast<float4*>(own + cols + k) =
          make_float4(db[k], db[k + 1], db[k + 2], db[k + 3]);
    }
  }
  __syncthreads();
  float* part = ws + int64_t(blockIdx.x) * 2 * cols;
  for (int j = threadIdx.x; j < 2 * cols; j += kThreads) {
    float total = 0.f;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) total += acc[int64_t(g) * 2 * cols + j];
    part[j] = total;
  }
}

// Backward, any shape: a block per row, two passes; column c of the block's partial row is
// owned by thread c % kBlock, which accumulates it in place (the barrier in GroupSum2 orders
// that after the zeroing, done by other threads).
template <typename T, bool kXBias>
__global__ void __launch_bounds__(kBlock)
LayerNormBwdAnyKernel(const T* __restrict__ dy, const T* __restrict__ dsum,
                      const T* __restrict__ x, const T* __restrict__ weight,
                      const float* __restrict__ mean, const float* __restrict__ rstd,
                      T* __restrict__ dx, float* __restrict__ ws, int64_t rows, int cols) {
  constexpr int kPlanes = kXBias ? 3 : 2;
  __shared__ float red[2 * kBlock / 32];
  const float inv_cols = 1.f / cols;
  float* part = ws + int64_t(blockIdx.x) * kPlanes * cols;
  for (int c = threadIdx.x; c < kPlanes * cols; c += kBlock) part[c] = 0.f;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t off = row * cols;
    const float m = mean[row], rs = rstd[row];
    float sum_g = 0.f, sum_gx = 0.f;
    for (int c = threadIdx.x; c < cols; c += kBlock) {
      const float g = ToFloat(dy[off + c]) * ToFloat(weight[c]);
      sum_g += g;
      sum_gx += g * (ToFloat(x[off + c]) - m) * rs;
    }
    GroupSum2<kBlock>(sum_g, sum_gx, red);
    const float mg = sum_g * inv_cols, mgx = sum_gx * inv_cols;
    for (int c = threadIdx.x; c < cols; c += kBlock) {
      const float d = ToFloat(dy[off + c]), xhat = (ToFloat(x[off + c]) - m) * rs;
      float out = rs * (d * ToFloat(weight[c]) - mg - xhat * mgx);
      if (kXBias || dsum) out += ToFloat(dsum[off + c]);
      dx[off + c] = FromFloat<T>(out);
      part[c] += d * xhat;
      part[cols + c] += d;
      if constexpr (kXBias) part[2 * cols + c] += out;
    }
  }
}

// dweight, dbias (and dx_bias when kPlanes is 3): the sums of the blocks' partial rows
// (ReducePartialRows, common/row_norm.cuh).
template <typename T, int kPlanes>
__global__ void __launch_bounds__(kReduceX * kReduceY)
LayerNormReducePartials(const float* __restrict__ ws, int partials, int cols,
                        T* __restrict__ dweight, T* __restrict__ dbias, T* __restrict__ dx_bias) {
  ReducePartialRows<T, kPlanes>(ws, partials, cols, dweight, dbias, dx_bias);
}

// The backward's kernels for dtype T and variant kXBias, as LaunchBwdRows takes them.
template <typename T, bool kXBias>
struct LayerNormBwdKernels {
  static constexpr int kPlanes = kXBias ? 3 : 2;
  template <int kGroup>
  static constexpr auto Register() {
    return LayerNormBwdKernel<T, kGroup, BwdVecs<T>(), BwdBlockFor<kGroup>(), kXBias>;
  }
  static constexpr auto kAny = LayerNormBwdAnyKernel<T, kXBias>;
};

}  // namespace
}  // namespace blujax
