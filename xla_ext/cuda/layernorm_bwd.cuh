// The LayerNorm backward kernels: dx, and dweight/dbias (dx_bias for the add-bias variant) as
// one partial row per block that LayerNormReducePartials sums. layernorm.cu has the overview,
// the launchers and the handlers.

#pragma once

#include "common/cuda_util.cuh"
#include "common/row_norm.cuh"
#include "cuda/layernorm_fwd.cuh"

namespace blujax {
namespace {

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
  // them), not read again in both loops of every row (measured faster); float32 and the
  // add-bias variant have no registers to spare for it.
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

  // Rows of several groups a block read dy and x through the read-only path, measured faster
  // there than loads without L1 allocation. A row a block (C > 4096) keeps the loads without
  // L1 allocation, which were the faster when C = 3072 and 4096 took a block a row; C > 4096
  // itself is not measured.
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

}  // namespace
}  // namespace blujax
