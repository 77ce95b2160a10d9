// LayerNorm on the GPU (float32 and bfloat16, float32 statistics); the CPU twin is
// xla_ext/cpu/layernorm.cc and the handler contract common/layernorm.h.
//
// Memory-bound, so the design is about bytes: each row is read once into registers in 16-byte
// packs by a group of kGroup threads (a warp for C <= 1024 float32, wider groups for wider rows),
// the two reductions (mean, then variance around it) run on the registers, and the output is
// written once. The plain forward stages the next rows in shared memory while it works on this
// one, so loads never wait on a row's reductions. The backward reads dy and x once, writes dx,
// and adds each thread's share of dweight/dbias into its group's slice of shared memory across
// all the rows the group visits (bfloat16 rows of C <= 1024: into registers, a pack a thread,
// with the next row staged in shared memory as the forward does); blocks (one wave of them)
// leave one partial row each in the workspace and a second, small kernel sums those. Rows whose
// width or alignment does not allow 16-byte packs, or wider than the register budget, take a
// plain block-per-row path that re-reads the row from memory (correct for any shape, not tuned).
//
// The add-bias variant (kXBias) folds in the preceding matmul's bias: sum = x + x_bias + residual,
// and its backward accumulates dx_bias (the column sums of dx = dsum + the LayerNorm's own dx) as
// a third partial row beside dweight and dbias. It is a template flag, so the kernels of the other
// variants compile exactly as they would without it.

#include <algorithm>

#include "common/cuda_util.cuh"
#include "common/layernorm.h"
#include "common/registry.h"

namespace blujax {
namespace {

constexpr int kBlock = 256;         // threads per block, unless one row's group is wider
constexpr int kFwdFloats = 32;      // row elements a thread keeps in registers, forward
constexpr int kMaxSharedBytes = 46 << 10;  // dynamic shared memory without opting in to more

template <int kGroup> __host__ __device__ constexpr int BlockFor() {
  return kGroup > kBlock ? kGroup : kBlock;
}

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
// loads only once the previous row is done (bfloat16 16384 x 4096: 78% -> 84% of copy on an
// H100). Each thread reads back only the packs it copied, so the pipeline needs no barrier.
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

// ----------------------------------------------------------------------------------------------
// Threads of a backward block: groups share a block of at least 512 threads, so a
// multiprocessor holds one or two blocks and leaves as many partial rows of dweight/dbias, not
// four or more. Every block writes its partial row as the grid ends, and the second kernel
// reads them all: on an H100, narrow groups (a warp or two a row) went from 62% to 71% of copy
// at bfloat16 32768 x 768 (with 32 elements a thread), and groups of 128 threads (C = 1600 and
// 2048; a block each before) 3-5% faster, their add-bias variant 3-7%.
template <int kGroup> __host__ __device__ constexpr int BwdBlockFor() {
  return kGroup < 512 ? 512 : kGroup;
}
// Elements of dy (and of x) a backward thread keeps in registers: 16, in twice as many threads
// as 32 would need, each held to 64 registers so that 1024 threads fit a multiprocessor (with
// 32 and ~125 registers, 512 did, latency-bound: on an H100, 16 took float32 from 65-82% to
// 73-84% of copy). bfloat16 fits the bound only with its packs kept whole (PackElem): split
// into a register an element, they spilled, the add-bias variant's so badly that it kept 32
// elements without the bound.
constexpr int kBwdFloats = 16;
template <typename T> __host__ __device__ constexpr int BwdVecs() {
  return kBwdFloats / Pack<T>::kSize;
}
// Blocks a multiprocessor must hold, promised through __launch_bounds__.
template <int kThreads> __host__ __device__ constexpr int BwdMinBlocks() {
  return kThreads < 1024 ? 1024 / kThreads : 1;
}

// Backward, register path: a group of kGroup threads takes a row at a time, holding its dy and
// x packs in registers. A thread's columns are the same for every row, so it adds its share of
// dweight/dbias into its group's own slice of shared memory without atomics; at the end the
// block sums its groups' slices into its partial row ws[blockIdx.x]. With kXBias a third slice
// takes dx_bias.
template <typename T, int kGroup, int kVecs, int kThreads, bool kXBias>
__global__ void __launch_bounds__(kThreads, BwdMinBlocks<kThreads>())
LayerNormBwdKernel(const T* __restrict__ dy, const T* __restrict__ dsum, const T* __restrict__ x,
                   const T* __restrict__ weight, const float* __restrict__ mean,
                   const float* __restrict__ rstd, T* __restrict__ dx, float* __restrict__ ws,
                   int64_t rows, int cols) {
  constexpr int kPack = Pack<T>::kSize;
  constexpr int kGroups = kThreads / kGroup;
  constexpr int kPlanes = kXBias ? 3 : 2;
  __shared__ float red[2 * kThreads / 32];
  // Per group: dweight then dbias (then dx_bias), each stored as [chunk][pack][4] with chunk =
  // a float4 of a pack (bfloat16 packs hold two), so the float4s a warp updates together are
  // consecutive and free of bank conflicts.
  extern __shared__ float4 acc4[];
  constexpr int kChunks = kPack / 4;
  const int lane = threadIdx.x % kGroup, group = threadIdx.x / kGroup;
  const int packs = cols / kPack;
  const float inv_cols = 1.f / cols;
  float4* dw_acc = acc4 + int64_t(group) * kPlanes * (cols / 4);
  float4* db_acc = dw_acc + cols / 4;
  float4* dxb_acc = db_acc + cols / 4;  // kXBias only
  // Each thread zeroes exactly the float4s it accumulates, so no barrier is needed yet.
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int p = lane + i * kGroup;
    if (p < packs) {
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        dw_acc[c * packs + p] = db_acc[c * packs + p] = float4{};
        if constexpr (kXBias) dxb_acc[c * packs + p] = float4{};
      }
    }
  }

  // bfloat16 keeps the weight of its columns, the same for every row, in registers (8 of
  // them), not read again in both loops of every row (16384 x 768: 34.0 -> 31.8 us under
  // Nsight Compute); float32 and the add-bias variant have no registers to spare for it.
  constexpr bool kHoldW = sizeof(T) == 2 && !kXBias;
  Pack<T> held_w[kHoldW ? kVecs : 1];
  if constexpr (kHoldW) {
#pragma unroll
    for (int i = 0; i < kVecs; ++i)
      if (lane + i * kGroup < packs) held_w[i] = LoadPack(weight + (lane + i * kGroup) * kPack);
  }
  auto weight_pack = [&](int i, int p) {
    if constexpr (kHoldW) return held_w[i];
    else return LoadPack(weight + p * kPack);
  };

  // Rows of several groups a block read dy and x through the read-only path: on an H100 1-2%
  // faster there than loads without L1 allocation (across two runs). A row a block (C > 4096)
  // keeps the loads without L1 allocation, which were the faster when C = 3072 and 4096 took a
  // block a row (the read-only path 1.7% slower then); C > 4096 itself is not measured.
  auto load_row = [](const T* p) {
    if constexpr (kGroups > 1) return LoadPack(p);
    else return LoadPackNoL1(p);
  };

  for (int64_t base = int64_t(blockIdx.x) * kGroups; base < rows;
       base += int64_t(gridDim.x) * kGroups) {
    const int64_t row = base + group;
    const bool valid = row < rows;
    const float m = valid ? mean[row] : 0.f, rs = valid ? rstd[row] : 0.f;
    Pack<T> d[kVecs], a[kVecs];
    // Sums of g = dy * weight and of g * (x - mean): rstd is applied once a row, not an
    // element.
    float sum_g = 0.f, sum_gxm = 0.f;
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int p = lane + i * kGroup;
      if (valid && p < packs) {
        const int64_t off = row * cols + int64_t(p) * kPack;
        d[i] = load_row(dy + off);
        a[i] = load_row(x + off);
      }
    }
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int p = lane + i * kGroup;
      if (valid && p < packs) {
        const Pack<T> w = weight_pack(i, p);
#pragma unroll
        for (int k = 0; k < kPack; ++k) {
          const float g = PackElem(d[i], k) * PackElem(w, k);
          sum_g += g;
          sum_gxm += g * (PackElem(a[i], k) - m);
        }
      }
    }
    GroupSum2<kGroup, kThreads>(sum_g, sum_gxm, red);
    // dx = rs * (g - mean(g) - xhat * mean(g * xhat)) = g * rs + (xhat * c1 + c0).
    const float c0 = -rs * sum_g * inv_cols, c1 = -rs * rs * sum_gxm * inv_cols;
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int p = lane + i * kGroup;
      if (valid && p < packs) {
        const int64_t off = row * cols + int64_t(p) * kPack;
        const Pack<T> w = weight_pack(i, p);
        Pack<T> ds;
        if (kXBias || dsum) ds = LoadPackNoL1(dsum + off);
        float o[kPack], dwv[kPack], dbv[kPack];
#pragma unroll
        for (int k = 0; k < kPack; ++k) {
          const float dd = PackElem(d[i], k), xhat = (PackElem(a[i], k) - m) * rs;
          o[k] = fmaf(dd * PackElem(w, k), rs, fmaf(xhat, c1, c0));
          if (kXBias || dsum) o[k] += PackElem(ds, k);
          dwv[k] = dd * xhat;
          dbv[k] = dd;
        }
        StorePackNoL1(dx + off, PackFromFloats<T>(o));
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
          float4& w4 = dw_acc[c * packs + p];
          float4& b4 = db_acc[c * packs + p];
          w4 = float4{w4.x + dwv[4 * c], w4.y + dwv[4 * c + 1], w4.z + dwv[4 * c + 2],
                      w4.w + dwv[4 * c + 3]};
          b4 = float4{b4.x + dbv[4 * c], b4.y + dbv[4 * c + 1], b4.z + dbv[4 * c + 2],
                      b4.w + dbv[4 * c + 3]};
          if constexpr (kXBias) {  // dx_bias before rounding, as dweight and dbias
            float4& x4 = dxb_acc[c * packs + p];
            x4 = float4{x4.x + o[4 * c], x4.y + o[4 * c + 1], x4.z + o[4 * c + 2],
                        x4.w + o[4 * c + 3]};
          }
        }
      }
    }
  }

  __syncthreads();
  const float* acc = reinterpret_cast<const float*>(acc4);
  float* part = ws + int64_t(blockIdx.x) * kPlanes * cols;
  for (int j = threadIdx.x; j < kPlanes * cols; j += kThreads) {
    // Column col of dweight (j < cols), dbias or dx_bias sits at [chunk][pack][lane of float4].
    const int which = j < cols ? 0 : (kXBias && j >= 2 * cols) ? 2 : 1, col = j - which * cols;
    const int p = col / kPack, r = col % kPack;
    const int at = which * cols + ((r / 4) * packs + p) * 4 + r % 4;
    float total = 0.f;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) total += acc[int64_t(g) * kPlanes * cols + at];
    part[j] = total;
  }
}

// Backward, a pack a thread (bfloat16 rows of up to 32 kWarps packs, C <= 1024): a group of
// kWarps warps takes a row at a time, each thread one 8-element pack of dy and x, and keeps its
// pack's dweight/dbias sums in registers across every row it visits (16 of them), so the row
// loop has no shared-memory accumulation at all, and no thread idles for want of a second pack
// (C = 768 is 96 packs: 3 warps, where the register path's 64-thread groups leave half of the
// second packs empty). At the end the block's groups sum their registers through shared memory
// into the block's partial row. On an H100, against the register path: 3-7% faster at C = 256,
// 512, 768 and 1024; groups of 12 and 16 warps (C = 3072, 4096) were about 11% and 5% slower
// (against the register path's figures of earlier runs), a row's barriers then spanning too
// many warps.
// Each thread copies its packs of the group's next row into shared memory (cp.async) before it
// works this one, so a row's loads are in flight while the previous row is reduced and written;
// the registers have no room to hold them. On an H100, against loading each row as it starts:
// 5.4% faster at 16384 x 768, 4.3% at 16384 x 1024, 1.6% at 512, level at 256; two rows ahead
// was 2-4% slower than one, three 3-12%.
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

// dweight[c] = sum over blocks of ws[b, 0, c]; dbias likewise from ws[b, 1, c] (and dx_bias from
// ws[b, 2, c] when kPlanes is 3). There are only kPlanes * C / 32 blocks, so each thread keeps
// several independent loads in flight rather than waiting on one partial row at a time.
constexpr int kReduceX = 32, kReduceY = 32, kReduceUnroll = 8;
template <typename T, int kPlanes>
__global__ void __launch_bounds__(kReduceX * kReduceY)
LayerNormReducePartials(const float* __restrict__ ws, int partials, int cols,
                        T* __restrict__ dweight, T* __restrict__ dbias, T* __restrict__ dx_bias) {
  __shared__ float tile[kReduceY][kReduceX + 1];
  const int j = blockIdx.x * kReduceX + threadIdx.x;  // over kPlanes * cols
  const int64_t stride = kPlanes * int64_t(cols);
  float acc[kReduceUnroll] = {};
  if (j < kPlanes * cols) {
    int p = threadIdx.y;
    for (; p + (kReduceUnroll - 1) * kReduceY < partials; p += kReduceUnroll * kReduceY) {
#pragma unroll
      for (int u = 0; u < kReduceUnroll; ++u) acc[u] += ws[(p + u * kReduceY) * stride + j];
    }
    for (; p < partials; p += kReduceY) acc[0] += ws[p * stride + j];
  }
  float s = 0.f;
#pragma unroll
  for (int u = 0; u < kReduceUnroll; ++u) s += acc[u];
  tile[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && j < kPlanes * cols) {
    for (int r = 1; r < kReduceY; ++r) s += tile[r][threadIdx.x];
    if (j < cols) dweight[j] = FromFloat<T>(s);
    else if (kPlanes == 2 || j < 2 * cols) dbias[j - cols] = FromFloat<T>(s);
    else dx_bias[j - 2 * cols] = FromFloat<T>(s);
  }
}

// ----------------------------------------------------------------------------------------------
// Launchers.

// The narrowest group whose threads hold a row of `packs` packs within the register budget;
// 0 when even 1024 threads cannot.
inline int GroupFor(int packs, int vecs) {
  for (int g = 32; g <= 1024; g *= 2)
    if (int64_t(g) * vecs >= packs) return g;
  return 0;
}

// Blocks of a kernel that fit on one multiprocessor (at least 1).
template <typename Kernel>
int BlocksPerSm(Kernel kernel, int threads, size_t smem) {
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem) != cudaSuccess) {
    cudaGetLastError();  // a sizing query only: clear it and fall back to one block
    n = 1;
  }
  return n < 1 ? 1 : n;
}

template <typename F>
void WithGroup(int group, F&& f) {
  switch (group) {
    case 32: f(std::integral_constant<int, 32>{}); break;
    case 64: f(std::integral_constant<int, 64>{}); break;
    case 128: f(std::integral_constant<int, 128>{}); break;
    case 256: f(std::integral_constant<int, 256>{}); break;
    case 512: f(std::integral_constant<int, 512>{}); break;
    default: f(std::integral_constant<int, 1024>{}); break;
  }
}

// kXBias: x_bias is not null (nor residual, nor sum).
template <typename T, bool kXBias>
ffi::Error LaunchFwd(cudaStream_t stream, int device, const void* x, const void* x_bias,
                     const void* residual, const void* weight, const void* bias, void* y,
                     void* sum, float* mean, float* rstd, RowsCols rc, float eps) {
  constexpr int kPack = Pack<T>::kSize, kVecs = kFwdFloats / kPack;
  const int cols = static_cast<int>(rc.cols);
  const bool packed = cols % kPack == 0 && Aligned16(x) && Aligned16(y) && Aligned16(weight) &&
                      Aligned16(bias) && (!residual || (Aligned16(residual) && Aligned16(sum))) &&
                      (!kXBias || Aligned16(x_bias));
  const int group = packed ? GroupFor(cols / kPack, kVecs) : 0;
  auto args = [&](auto kernel, int64_t blocks, int threads) {
    // As many blocks as fit on the device at once; each loops over its share of the rows. (A
    // block per kGroups rows, each passing once, as the GELU forward does, measured the same
    // within 4% either way on an H100.)
    const int64_t resident = int64_t(SmCount(device)) * BlocksPerSm(kernel, threads, 0);
    kernel<<<static_cast<unsigned>(std::min(blocks, resident)), threads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(x_bias), static_cast<const T*>(residual),
        static_cast<const T*>(weight), static_cast<const T*>(bias), static_cast<T*>(y),
        static_cast<T*>(sum), mean, rstd, rc.rows, cols, eps);
  };
  // The plain op takes the pipelined kernel where its stages fit in shared memory: rows
  // staged two steps ahead in bfloat16, one in float32 (the same bytes; more measured slower).
  bool launched = false;
  if (group && !residual && !kXBias) {
    WithGroup(group, [&](auto g) {
      constexpr int kGroup = decltype(g)::value, kThreads = BlockFor<kGroup>();
      constexpr int kGroups = kThreads / kGroup, kStages = sizeof(T) == 4 ? 2 : 3;
      constexpr auto kKernel = LayerNormFwdPipeKernel<T, kGroup, kVecs, kStages>;
      const int vecs = (cols / kPack + kGroup - 1) / kGroup;
      const size_t smem = size_t(kThreads) * kStages * vecs * sizeof(uint4);
      if (smem > kMaxSharedBytes && smem > SharedMemoryLimit<kKernel>(device)) return;
      const int64_t resident = int64_t(SmCount(device)) * BlocksPerSm(kKernel, kThreads, smem);
      const int64_t blocks = std::min<int64_t>((rc.rows + kGroups - 1) / kGroups, resident);
      kKernel<<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(
          static_cast<const T*>(x), static_cast<const T*>(weight), static_cast<const T*>(bias),
          static_cast<T*>(y), mean, rstd, rc.rows, cols, eps);
      launched = true;
    });
  }
  if (launched) return ffi::Error::Success();
  if (group) {
    WithGroup(group, [&](auto g) {
      constexpr int kGroup = decltype(g)::value, kThreads = BlockFor<kGroup>();
      constexpr int kGroups = kThreads / kGroup;
      args(LayerNormFwdKernel<T, kGroup, kVecs, kXBias>, (rc.rows + kGroups - 1) / kGroups,
           kThreads);
    });
  } else {
    args(LayerNormFwdAnyKernel<T, kXBias>, rc.rows, kBlock);
  }
  return ffi::Error::Success();
}

// kXBias: dsum and dx_bias are not null, and ws holds [partials, 3, C].
template <typename T, bool kXBias>
ffi::Error LaunchBwd(const char* op, cudaStream_t stream, int device, const void* dy,
                     const void* dsum, const void* x, const void* weight, const float* mean,
                     const float* rstd, void* dx, void* dweight, void* dbias, void* dx_bias,
                     float* ws, int64_t partials, RowsCols rc) {
  constexpr int kPack = Pack<T>::kSize, kPlanes = kXBias ? 3 : 2;
  const int cols = static_cast<int>(rc.cols);
  const bool packed = cols % kPack == 0 && Aligned16(dy) && Aligned16(x) && Aligned16(dx) &&
                      Aligned16(weight) && (!dsum || Aligned16(dsum));
  int64_t blocks = 0;
  auto run = [&](auto kernel, int64_t rows_per_block, int threads, size_t smem) {
    // As many blocks as fit on the device at once (each leaves one partial row to reduce),
    // no more than the workspace holds or the rows need.
    const int64_t resident = int64_t(SmCount(device)) * BlocksPerSm(kernel, threads, smem);
    blocks = std::max<int64_t>(1, std::min({partials, resident,
                                            (rc.rows + rows_per_block - 1) / rows_per_block}));
    kernel<<<static_cast<unsigned>(blocks), threads, smem, stream>>>(
        static_cast<const T*>(dy), static_cast<const T*>(dsum), static_cast<const T*>(x),
        static_cast<const T*>(weight), mean, rstd, static_cast<T*>(dx), ws, rc.rows, cols);
  };
  bool launched = false;
  const int group = packed ? GroupFor(cols / kPack, BwdVecs<T>()) : 0;
  // bfloat16 rows of up to 4 warps' packs take the pack-a-thread kernel. The add-bias variant
  // keeps the register path: its third sum (dx_bias) would need 8 more registers in a kernel
  // already at the 64-register bound (not tried).
  if constexpr (sizeof(T) == 2 && !kXBias) {
    const int warps = packed ? (cols / kPack + 31) / 32 : 0;
    auto pack_path = [&](auto wc) {
      // 15 or 16 warps a block, two blocks a multiprocessor: up to 1024 threads at 64
      // registers, as the register path runs.
      constexpr int kWarps = decltype(wc)::value, kGroups = 16 / kWarps;
      constexpr int kThreads = kWarps * 32 * kGroups;
      const size_t sums = size_t(kGroups) * 2 * cols * sizeof(float);  // at most 32 KB
      auto launch = [&](auto sum) {
        constexpr auto kKernel = LayerNormBwdPackKernel<T, kWarps, kGroups, decltype(sum)::value>;
        const size_t stages = size_t(2) * (sum ? 3 : 2) * kThreads * sizeof(uint4);  // <= 48 KB
        const size_t smem = std::max(sums, stages);
        if (smem <= kMaxSharedBytes || smem <= SharedMemoryLimit<kKernel>(device)) {
          run(kKernel, kGroups, kThreads, smem);
          launched = true;
        }
      };
      if (dsum) launch(std::true_type{});
      else launch(std::false_type{});
    };
    switch (warps) {
      case 1: pack_path(std::integral_constant<int, 1>{}); break;
      case 2: pack_path(std::integral_constant<int, 2>{}); break;
      case 3: pack_path(std::integral_constant<int, 3>{}); break;
      case 4: pack_path(std::integral_constant<int, 4>{}); break;
      default: break;
    }
  }
  if (group && !launched) {
    WithGroup(group, [&](auto g) {
      constexpr int kGroup = decltype(g)::value, kThreads = BwdBlockFor<kGroup>();
      constexpr int kGroups = kThreads / kGroup;
      // per-group dw, db (, dxb)
      const size_t smem = size_t(kGroups) * kPlanes * cols * sizeof(float);
      constexpr int kVecs = BwdVecs<T>();
      constexpr auto kKernel = LayerNormBwdKernel<T, kGroup, kVecs, kThreads, kXBias>;
      if (smem <= kMaxSharedBytes || smem <= SharedMemoryLimit<kKernel>(device)) {
        run(kKernel, kGroups, kThreads, smem);
        launched = true;
      }
    });
  }
  if (!launched) run(LayerNormBwdAnyKernel<T, kXBias>, 1, kBlock, 0);
  BLUJAX_RETURN_IF_ERROR(LastCudaError(op));
  const dim3 threads(kReduceX, kReduceY);
  const unsigned grid = static_cast<unsigned>((kPlanes * cols + kReduceX - 1) / kReduceX);
  LayerNormReducePartials<T, kPlanes><<<grid, threads, 0, stream>>>(
      ws, static_cast<int>(blocks), cols, static_cast<T*>(dweight), static_cast<T*>(dbias),
      static_cast<T*>(dx_bias));
  return ffi::Error::Success();
}

// residual/sum are null for the plain op; x_bias is null but for the add-bias op.
ffi::Error LayerNormFwdImpl(const char* op, cudaStream_t stream, int device, ffi::AnyBuffer x,
                            const ffi::AnyBuffer* x_bias, const ffi::AnyBuffer* residual,
                            ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                            ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer>* sum,
                            ffi::Result<ffi::AnyBuffer> mean, ffi::Result<ffi::AnyBuffer> rstd,
                            float eps) {
  RowsCols rc;
  BLUJAX_RETURN_IF_ERROR(CheckLayerNormInput(op, x, /*allow_f64=*/false, &rc));
  BLUJAX_RETURN_IF_ERROR(CheckEps(op, eps));
  BLUJAX_RETURN_IF_ERROR(CheckLayerNormParam(op, "weight", weight, x, rc.cols));
  BLUJAX_RETURN_IF_ERROR(CheckLayerNormParam(op, "bias", bias, x, rc.cols));
  if (x_bias) BLUJAX_RETURN_IF_ERROR(CheckLayerNormParam(op, "x_bias", *x_bias, x, rc.cols));
  BLUJAX_RETURN_IF_ERROR(CheckLike(op, "y", *y, "x", x));
  if (residual) {
    BLUJAX_RETURN_IF_ERROR(CheckLike(op, "residual", *residual, "x", x));
    BLUJAX_RETURN_IF_ERROR(CheckLike(op, "sum", **sum, "x", x));
  }
  BLUJAX_RETURN_IF_ERROR(CheckLayerNormStats(op, *mean, *rstd, x, rc.rows));
  if (rc.rows == 0) return ffi::Error::Success();
  const bool f32 = x.element_type() == ffi::DataType::F32;
  auto launch = x_bias ? (f32 ? LaunchFwd<float, true> : LaunchFwd<__nv_bfloat16, true>)
                       : (f32 ? LaunchFwd<float, false> : LaunchFwd<__nv_bfloat16, false>);
  BLUJAX_RETURN_IF_ERROR(launch(stream, device, x.untyped_data(),
                                x_bias ? x_bias->untyped_data() : nullptr,
                                residual ? residual->untyped_data() : nullptr,
                                weight.untyped_data(), bias.untyped_data(), y->untyped_data(),
                                sum ? (*sum)->untyped_data() : nullptr,
                                static_cast<float*>(mean->untyped_data()),
                                static_cast<float*>(rstd->untyped_data()), rc, eps));
  return LastCudaError(op);
}

// dsum is null for the plain op; dx_bias is null but for the add-bias op.
ffi::Error LayerNormBwdImpl(const char* op, cudaStream_t stream, int device, ffi::AnyBuffer dy,
                            const ffi::AnyBuffer* dsum, ffi::AnyBuffer x, ffi::AnyBuffer weight,
                            ffi::AnyBuffer mean, ffi::AnyBuffer rstd,
                            ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dweight,
                            ffi::Result<ffi::AnyBuffer> dbias,
                            ffi::Result<ffi::AnyBuffer>* dx_bias,
                            ffi::Result<ffi::AnyBuffer> workspace) {
  RowsCols rc;
  int64_t partials = 0;
  BLUJAX_RETURN_IF_ERROR(CheckLayerNormInput(op, x, /*allow_f64=*/false, &rc));
  BLUJAX_RETURN_IF_ERROR(CheckLike(op, "dy", dy, "x", x));
  if (dsum) BLUJAX_RETURN_IF_ERROR(CheckLike(op, "dsum", *dsum, "x", x));
  BLUJAX_RETURN_IF_ERROR(CheckLayerNormParam(op, "weight", weight, x, rc.cols));
  BLUJAX_RETURN_IF_ERROR(CheckLayerNormStats(op, mean, rstd, x, rc.rows));
  BLUJAX_RETURN_IF_ERROR(CheckLike(op, "dx", *dx, "x", x));
  BLUJAX_RETURN_IF_ERROR(CheckLayerNormParam(op, "dweight", *dweight, x, rc.cols));
  BLUJAX_RETURN_IF_ERROR(CheckLayerNormParam(op, "dbias", *dbias, x, rc.cols));
  if (dx_bias) {
    if (!dsum) return InvalidArgument(op, ": dx_bias needs dsum");  // not reachable from a target
    BLUJAX_RETURN_IF_ERROR(CheckLayerNormParam(op, "dx_bias", **dx_bias, x, rc.cols));
  }
  BLUJAX_RETURN_IF_ERROR(
      CheckLayerNormWorkspace(op, *workspace, rc.cols, &partials, dx_bias ? 3 : 2));
  const bool f32 = x.element_type() == ffi::DataType::F32;
  auto launch = dx_bias ? (f32 ? LaunchBwd<float, true> : LaunchBwd<__nv_bfloat16, true>)
                        : (f32 ? LaunchBwd<float, false> : LaunchBwd<__nv_bfloat16, false>);
  BLUJAX_RETURN_IF_ERROR(launch(op, stream, device, dy.untyped_data(),
                                dsum ? dsum->untyped_data() : nullptr, x.untyped_data(),
                                weight.untyped_data(),
                                static_cast<const float*>(mean.untyped_data()),
                                static_cast<const float*>(rstd.untyped_data()), dx->untyped_data(),
                                dweight->untyped_data(), dbias->untyped_data(),
                                dx_bias ? (*dx_bias)->untyped_data() : nullptr,
                                static_cast<float*>(workspace->untyped_data()), partials, rc));
  return LastCudaError(op);
}


ffi::Error LayerNormFwd(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                        ffi::AnyBuffer weight, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y,
                        ffi::Result<ffi::AnyBuffer> mean, ffi::Result<ffi::AnyBuffer> rstd,
                        float eps) {
  return LayerNormFwdImpl("blujax_layer_norm_fwd", stream, device, x, nullptr, nullptr, weight,
                          bias, y, nullptr, mean, rstd, eps);
}

ffi::Error AddLayerNormFwd(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                           ffi::AnyBuffer residual, ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                           ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> sum,
                           ffi::Result<ffi::AnyBuffer> mean, ffi::Result<ffi::AnyBuffer> rstd,
                           float eps) {
  return LayerNormFwdImpl("blujax_add_layer_norm_fwd", stream, device, x, nullptr, &residual,
                          weight, bias, y, &sum, mean, rstd, eps);
}

ffi::Error AddBiasLayerNormFwd(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                               ffi::AnyBuffer x_bias, ffi::AnyBuffer residual,
                               ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                               ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> sum,
                               ffi::Result<ffi::AnyBuffer> mean, ffi::Result<ffi::AnyBuffer> rstd,
                               float eps) {
  return LayerNormFwdImpl("blujax_add_bias_layer_norm_fwd", stream, device, x, &x_bias,
                          &residual, weight, bias, y, &sum, mean, rstd, eps);
}

ffi::Error LayerNormBwd(cudaStream_t stream, int32_t device, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                        ffi::AnyBuffer weight, ffi::AnyBuffer mean, ffi::AnyBuffer rstd,
                        ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dweight,
                        ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> workspace) {
  return LayerNormBwdImpl("blujax_layer_norm_bwd", stream, device, dy, nullptr, x, weight, mean,
                          rstd, dx, dweight, dbias, nullptr, workspace);
}

ffi::Error AddLayerNormBwd(cudaStream_t stream, int32_t device, ffi::AnyBuffer dy,
                           ffi::AnyBuffer dsum, ffi::AnyBuffer sum, ffi::AnyBuffer weight,
                           ffi::AnyBuffer mean, ffi::AnyBuffer rstd,
                           ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dweight,
                           ffi::Result<ffi::AnyBuffer> dbias,
                           ffi::Result<ffi::AnyBuffer> workspace) {
  return LayerNormBwdImpl("blujax_add_layer_norm_bwd", stream, device, dy, &dsum, sum, weight,
                          mean, rstd, dx, dweight, dbias, nullptr, workspace);
}

ffi::Error AddBiasLayerNormBwd(cudaStream_t stream, int32_t device, ffi::AnyBuffer dy,
                               ffi::AnyBuffer dsum, ffi::AnyBuffer sum, ffi::AnyBuffer weight,
                               ffi::AnyBuffer mean, ffi::AnyBuffer rstd,
                               ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dweight,
                               ffi::Result<ffi::AnyBuffer> dbias,
                               ffi::Result<ffi::AnyBuffer> dx_bias,
                               ffi::Result<ffi::AnyBuffer> workspace) {
  return LayerNormBwdImpl("blujax_add_bias_layer_norm_bwd", stream, device, dy, &dsum, sum,
                          weight, mean, rstd, dx, dweight, dbias, &dx_bias, workspace);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kLayerNormFwd, LayerNormFwd,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Ctx<Device>()
                           .Arg<ffi::AnyBuffer>()   // x [..., C]
                           .Arg<ffi::AnyBuffer>()   // weight [C]
                           .Arg<ffi::AnyBuffer>()   // bias [C]
                           .Ret<ffi::AnyBuffer>()   // y [..., C]
                           .Ret<ffi::AnyBuffer>()   // mean [...] f32
                           .Ret<ffi::AnyBuffer>()   // rstd [...] f32
                           .Attr<float>("eps"),
                       kGraphSafe);

XLA_FFI_DEFINE_HANDLER(kAddLayerNormFwd, AddLayerNormFwd,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Ctx<Device>()
                           .Arg<ffi::AnyBuffer>()   // x [..., C]
                           .Arg<ffi::AnyBuffer>()   // residual [..., C]
                           .Arg<ffi::AnyBuffer>()   // weight [C]
                           .Arg<ffi::AnyBuffer>()   // bias [C]
                           .Ret<ffi::AnyBuffer>()   // y [..., C]
                           .Ret<ffi::AnyBuffer>()   // sum = x + residual [..., C]
                           .Ret<ffi::AnyBuffer>()   // mean [...] f32
                           .Ret<ffi::AnyBuffer>()   // rstd [...] f32
                           .Attr<float>("eps"),
                       kGraphSafe);

XLA_FFI_DEFINE_HANDLER(kLayerNormBwd, LayerNormBwd,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Ctx<Device>()
                           .Arg<ffi::AnyBuffer>()   // dy [..., C]
                           .Arg<ffi::AnyBuffer>()   // x [..., C]
                           .Arg<ffi::AnyBuffer>()   // weight [C]
                           .Arg<ffi::AnyBuffer>()   // mean [...]
                           .Arg<ffi::AnyBuffer>()   // rstd [...]
                           .Ret<ffi::AnyBuffer>()   // dx [..., C]
                           .Ret<ffi::AnyBuffer>()   // dweight [C]
                           .Ret<ffi::AnyBuffer>()   // dbias [C]
                           .Ret<ffi::AnyBuffer>(),  // workspace [P, 2, C] f32
                       kGraphSafe);

XLA_FFI_DEFINE_HANDLER(kAddLayerNormBwd, AddLayerNormBwd,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Ctx<Device>()
                           .Arg<ffi::AnyBuffer>()   // dy [..., C]
                           .Arg<ffi::AnyBuffer>()   // dsum [..., C]
                           .Arg<ffi::AnyBuffer>()   // sum [..., C]
                           .Arg<ffi::AnyBuffer>()   // weight [C]
                           .Arg<ffi::AnyBuffer>()   // mean [...]
                           .Arg<ffi::AnyBuffer>()   // rstd [...]
                           .Ret<ffi::AnyBuffer>()   // dx = dresidual [..., C]
                           .Ret<ffi::AnyBuffer>()   // dweight [C]
                           .Ret<ffi::AnyBuffer>()   // dbias [C]
                           .Ret<ffi::AnyBuffer>(),  // workspace [P, 2, C] f32
                       kGraphSafe);

XLA_FFI_DEFINE_HANDLER(kAddBiasLayerNormFwd, AddBiasLayerNormFwd,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Ctx<Device>()
                           .Arg<ffi::AnyBuffer>()   // x [..., C]
                           .Arg<ffi::AnyBuffer>()   // x_bias [C], the preceding matmul's bias
                           .Arg<ffi::AnyBuffer>()   // residual [..., C]
                           .Arg<ffi::AnyBuffer>()   // weight [C]
                           .Arg<ffi::AnyBuffer>()   // bias [C]
                           .Ret<ffi::AnyBuffer>()   // y [..., C]
                           .Ret<ffi::AnyBuffer>()   // sum = x + x_bias + residual [..., C]
                           .Ret<ffi::AnyBuffer>()   // mean [...] f32
                           .Ret<ffi::AnyBuffer>()   // rstd [...] f32
                           .Attr<float>("eps"),
                       kGraphSafe);

XLA_FFI_DEFINE_HANDLER(kAddBiasLayerNormBwd, AddBiasLayerNormBwd,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Ctx<Device>()
                           .Arg<ffi::AnyBuffer>()   // dy [..., C]
                           .Arg<ffi::AnyBuffer>()   // dsum [..., C]
                           .Arg<ffi::AnyBuffer>()   // sum [..., C]
                           .Arg<ffi::AnyBuffer>()   // weight [C]
                           .Arg<ffi::AnyBuffer>()   // mean [...]
                           .Arg<ffi::AnyBuffer>()   // rstd [...]
                           .Ret<ffi::AnyBuffer>()   // dx = dresidual [..., C]
                           .Ret<ffi::AnyBuffer>()   // dweight [C]
                           .Ret<ffi::AnyBuffer>()   // dbias [C]
                           .Ret<ffi::AnyBuffer>()   // dx_bias [C] = column sums of dx
                           .Ret<ffi::AnyBuffer>(),  // workspace [P, 3, C] f32
                       kGraphSafe);

BLUJAX_REGISTER(blujax_layer_norm_fwd, kLayerNormFwd);
BLUJAX_REGISTER(blujax_add_layer_norm_fwd, kAddLayerNormFwd);
BLUJAX_REGISTER(blujax_layer_norm_bwd, kLayerNormBwd);
BLUJAX_REGISTER(blujax_add_layer_norm_bwd, kAddLayerNormBwd);
BLUJAX_REGISTER(blujax_add_bias_layer_norm_fwd, kAddBiasLayerNormFwd);
BLUJAX_REGISTER(blujax_add_bias_layer_norm_bwd, kAddBiasLayerNormBwd);

}  // namespace blujax
