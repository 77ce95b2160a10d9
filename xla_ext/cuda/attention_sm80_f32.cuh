// The float32 attention kernels (sm_80 and later, Hopper included), SIMT (exact float32, no
// TF32): forward, dK/dV and dQ (xla_ext/cuda/attention.cu has the overview, the launchers and
// the handlers).

#pragma once

#include "cuda/attention_common.cuh"

namespace blujax {
namespace {

// ---------------------------------------------------------------------------------------------
// float32: SIMT kernels. kLanes = D/16 consecutive threads share a row; thread c of them owns
// the 16 columns 4c + (D/4)u + e (u, e < 4), read as float4. The rows a CTA keeps (queries,
// or keys in dK/dV) live in registers; the other side streams through shared memory in
// double-buffered tiles of 16 rows, read by all threads of a row at once (broadcast).
// kGqa: grouped-query attention, as in the bfloat16 kernels (attention_sm80_bf16.cuh): the
// forward and dQ read the key/value head of their query head, and a dK/dV CTA holds keys of
// one key/value head and streams the query tiles of its group's query heads one after another.

template <int D>
struct F32Tile {
  static constexpr int kLanes = D / 16;
  static constexpr int kRows = kThreads / kLanes;  // rows per CTA: 32 (D = 64) or 16 (D = 128)
  static constexpr int kTile = 16;                 // rows per streamed tile (more spills on sm_80)
  static constexpr int kSmem = 4 * kTile * D * int(sizeof(float)) + 4 * kTile * int(sizeof(float));
};

template <int D>
__device__ __forceinline__ void LoadRow(float (&x)[16], const float* row, int c, bool valid) {
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const float4 f = valid ? *reinterpret_cast<const float4*>(row + 4 * c + (D / 4) * u)
                           : make_float4(0.f, 0.f, 0.f, 0.f);
    x[4 * u] = f.x;
    x[4 * u + 1] = f.y;
    x[4 * u + 2] = f.z;
    x[4 * u + 3] = f.w;
  }
}

template <int D>
__device__ __forceinline__ void StoreRow(float* row, const float (&x)[16], int c, float mul) {
#pragma unroll
  for (int u = 0; u < 4; ++u)
    *reinterpret_cast<float4*>(row + 4 * c + (D / 4) * u) =
        make_float4(x[4 * u] * mul, x[4 * u + 1] * mul, x[4 * u + 2] * mul, x[4 * u + 3] * mul);
}

// acc += w * (this thread's columns of a shared-memory row).
template <int D>
__device__ __forceinline__ void AxpyRow(float (&acc)[16], float w, const float* row, int c) {
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const float4 f = *reinterpret_cast<const float4*>(row + 4 * c + (D / 4) * u);
    acc[4 * u] = fmaf(w, f.x, acc[4 * u]);
    acc[4 * u + 1] = fmaf(w, f.y, acc[4 * u + 1]);
    acc[4 * u + 2] = fmaf(w, f.z, acc[4 * u + 2]);
    acc[4 * u + 3] = fmaf(w, f.w, acc[4 * u + 3]);
  }
}

// The dot product of a row held by the kLanes threads of a group with a shared-memory row.
template <int D>
__device__ __forceinline__ float DotRow(const float (&x)[16], const float* row, int c) {
  float s = 0.f;
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const float4 f = *reinterpret_cast<const float4*>(row + 4 * c + (D / 4) * u);
    s = fmaf(x[4 * u], f.x, s);
    s = fmaf(x[4 * u + 1], f.y, s);
    s = fmaf(x[4 * u + 2], f.z, s);
    s = fmaf(x[4 * u + 3], f.w, s);
  }
#pragma unroll
  for (int o = F32Tile<D>::kLanes / 2; o > 0; o /= 2) s += __shfl_xor_sync(kFull, s, o);
  return s;
}

template <int D, bool kGqa>
__global__ void __launch_bounds__(kThreads)
AttentionFwdF32Kernel(const float* __restrict__ q, const float* __restrict__ k,
                      const float* __restrict__ v, float* __restrict__ out,
                      float* __restrict__ lse, Geometry g, int n_qt) {
  using C = F32Tile<D>;
  constexpr int RB = C::kRows, BN = C::kTile;
  extern __shared__ uint4 smem_fwd_f32[];
  float* sK = reinterpret_cast<float*>(smem_fwd_f32);  // [2][BN][D]
  float* sV = sK + 2 * BN * D;                         // [2][BN][D]

  int qt;
  int64_t bh;
  BlockCoords(n_qt, g.causal, &qt, &bh);
  const int q0 = qt * RB, row = q0 + threadIdx.x / C::kLanes, c = threadIdx.x % C::kLanes;
  const bool valid = row < g.tq;
  const int64_t stride = int64_t(g.heads) * D, kv_stride = int64_t(KvHeads<kGqa>(g)) * D;
  const int64_t q_off = HeadOffset<D>(bh, g.tq, g.heads) + int64_t(row) * stride;
  const float* kh = k + KvHeadOffset<D, kGqa>(bh, g);
  const float* vh = v + KvHeadOffset<D, kGqa>(bh, g);
  const int n_kt = KeyTiles(g, q0, RB, BN);

  LoadTile<BN, D, false>(sK, kh, kv_stride, 0, g.tk);
  LoadTile<BN, D, false>(sV, vh, kv_stride, 0, g.tk);
  CopyAsyncCommit();
  float qr[16], o[16] = {};
  LoadRow<D>(qr, q + q_off, c, valid);
  float m = -INFINITY, l = 0.f;

  for (int j = 0; j < n_kt; ++j) {
    CopyAsyncWaitAll();
    __syncthreads();
    if (j + 1 < n_kt) {
      const int nb = (j + 1) & 1;
      LoadTile<BN, D, false>(sK + nb * BN * D, kh, kv_stride, (j + 1) * BN, g.tk);
      LoadTile<BN, D, false>(sV + nb * BN * D, vh, kv_stride, (j + 1) * BN, g.tk);
    }
    CopyAsyncCommit();
    const float* cK = sK + (j & 1) * BN * D;
    const float* cV = sV + (j & 1) * BN * D;
    const int k0 = j * BN;
    float s[BN];
    float mx = -INFINITY;
#pragma unroll
    for (int jj = 0; jj < BN; ++jj) {
      const int key = k0 + jj;
      s[jj] = DotRow<D>(qr, cK + jj * D, c) * g.scale_log2;
      if (key >= g.tk || (g.causal && key > row)) s[jj] = -INFINITY;
      mx = fmaxf(mx, s[jj]);
    }
    const float m_new = fmaxf(m, mx);
    const float base = m_new == -INFINITY ? 0.f : m_new;
    const float alpha = exp2f(m - base);
    m = m_new;
    l *= alpha;
#pragma unroll
    for (int i = 0; i < 16; ++i) o[i] *= alpha;
#pragma unroll
    for (int jj = 0; jj < BN; ++jj) {
      const float p = exp2f(s[jj] - base);
      l += p;
      AxpyRow<D>(o, p, cV + jj * D, c);
    }
  }
  if (valid) {
    StoreRow<D>(out + q_off, o, c, l > 0.f ? 1.f / l : 0.f);
    if (c == 0) lse[bh * g.tq + row] = (m + log2f(l)) * kLn2;
  }
}

template <int D, bool kGqa>
__global__ void __launch_bounds__(kThreads)
AttentionBwdKvF32Kernel(const float* __restrict__ q, const float* __restrict__ k,
                        const float* __restrict__ v, const float* __restrict__ dout,
                        const float* __restrict__ lse, const float* __restrict__ delta,
                        float* __restrict__ dk, float* __restrict__ dv, Geometry g, int n_kt) {
  using C = F32Tile<D>;
  constexpr int RB = C::kRows, BQ = C::kTile;
  extern __shared__ uint4 smem_kv_f32[];
  float* sQ = reinterpret_cast<float*>(smem_kv_f32);  // [2][BQ][D]
  float* sdO = sQ + 2 * BQ * D;                       // [2][BQ][D]
  float* sL = sdO + 2 * BQ * D;                       // [2][BQ]
  float* sDl = sL + 2 * BQ;                           // [2][BQ]

  int kt;
  int64_t bh;
  BlockCoords(n_kt, false, &kt, &bh);
  const int k0 = kt * RB, key = k0 + threadIdx.x / C::kLanes, c = threadIdx.x % C::kLanes;
  const bool valid = key < g.tk;
  const int64_t stride = int64_t(g.heads) * D, kv_stride = int64_t(KvHeads<kGqa>(g)) * D;
  const int64_t kv_off = HeadOffset<D>(bh, g.tk, KvHeads<kGqa>(g)) + int64_t(key) * kv_stride;
  // The (batch, query head) whose tiles load next: bh's own, or (kGqa, bh being a key/value
  // head) its group's first, then the next one once the loop is through its tiles.
  int64_t bq = kGqa ? bh * g.group : bh;
  const float* qh = q + HeadOffset<D>(bq, g.tq, g.heads);
  const float* doh = dout + HeadOffset<D>(bq, g.tq, g.heads);
  const float* lh = lse + bq * g.tq;
  const float* dlh = delta + bq * g.tq;
  const int n_qt = (g.tq + BQ - 1) / BQ;
  const int first = g.causal ? k0 / BQ : 0;
  const QuerySteps steps(bh, first, n_qt, g);
  const int last = kGqa ? steps.Last() : n_qt;

  LoadTile<BQ, D, false>(sQ, qh, stride, first * BQ, g.tq);
  LoadTile<BQ, D, false>(sdO, doh, stride, first * BQ, g.tq);
  LoadStats<BQ>(sL, lh, first * BQ, g.tq);
  LoadStats<BQ>(sDl, dlh, first * BQ, g.tq);
  CopyAsyncCommit();
  float kr[16], vr[16], dk_acc[16] = {}, dv_acc[16] = {};
  LoadRow<D>(kr, k + kv_off, c, valid);
  LoadRow<D>(vr, v + kv_off, c, valid);

  for (int i = first; i < last; ++i) {
    CopyAsyncWaitAll();
    __syncthreads();
    if (i + 1 < last) {
      const int nb = (i + 1 - first) & 1, r0 = (kGqa ? steps.Tile(i + 1) : i + 1) * BQ;
      if constexpr (kGqa) {
        if (steps.Head(i + 1) != bq) {  // on to the group's next query head
          bq = steps.Head(i + 1);
          qh = q + HeadOffset<D>(bq, g.tq, g.heads);
          doh = dout + HeadOffset<D>(bq, g.tq, g.heads);
          lh = lse + bq * g.tq;
          dlh = delta + bq * g.tq;
        }
      }
      LoadTile<BQ, D, false>(sQ + nb * BQ * D, qh, stride, r0, g.tq);
      LoadTile<BQ, D, false>(sdO + nb * BQ * D, doh, stride, r0, g.tq);
      LoadStats<BQ>(sL + nb * BQ, lh, r0, g.tq);
      LoadStats<BQ>(sDl + nb * BQ, dlh, r0, g.tq);
    }
    CopyAsyncCommit();
    const int buf = (i - first) & 1, q0 = (kGqa ? steps.Tile(i) : i) * BQ;
    const float* cQ = sQ + buf * BQ * D;
    const float* cdO = sdO + buf * BQ * D;
    const float* cL = sL + buf * BQ;
    const float* cDl = sDl + buf * BQ;
#pragma unroll 4
    for (int ii = 0; ii < BQ; ++ii) {
      const int query = q0 + ii;
      const float s = DotRow<D>(kr, cQ + ii * D, c);
      const float dp = DotRow<D>(vr, cdO + ii * D, c);
      float p = exp2f(fmaf(s, g.scale_log2, -cL[ii] * kLog2e));
      if (query >= g.tq || (g.causal && key > query)) p = 0.f;
      const float ds = p * (dp - cDl[ii]);
      AxpyRow<D>(dv_acc, p, cdO + ii * D, c);
      AxpyRow<D>(dk_acc, ds, cQ + ii * D, c);
    }
  }
  if (valid) {
    const int64_t grad_off = KvGradOffset<D, kGqa>(bh, g) + int64_t(key) * KvGradStride<D, kGqa>(g);
    StoreRow<D>(dk + grad_off, dk_acc, c, g.scale);
    StoreRow<D>(dv + grad_off, dv_acc, c, 1.f);
  }
}

// Four CTAs a multiprocessor, as its ~100 registers allow anyway: without the hint ptxas
// squeezes it into 96 and spills.
template <int D, bool kGqa>
__global__ void __launch_bounds__(kThreads, 4)
AttentionBwdQF32Kernel(const float* __restrict__ q, const float* __restrict__ k,
                       const float* __restrict__ v, const float* __restrict__ dout,
                       const float* __restrict__ lse, const float* __restrict__ delta,
                       float* __restrict__ dq, Geometry g, int n_qt) {
  using C = F32Tile<D>;
  constexpr int RB = C::kRows, BN = C::kTile;
  extern __shared__ uint4 smem_q_f32[];
  float* sK = reinterpret_cast<float*>(smem_q_f32);  // [2][BN][D]
  float* sV = sK + 2 * BN * D;                       // [2][BN][D]

  int qt;
  int64_t bh;
  BlockCoords(n_qt, g.causal, &qt, &bh);
  const int q0 = qt * RB, row = q0 + threadIdx.x / C::kLanes, c = threadIdx.x % C::kLanes;
  const bool valid = row < g.tq;
  const int64_t stride = int64_t(g.heads) * D, kv_stride = int64_t(KvHeads<kGqa>(g)) * D;
  const int64_t q_off = HeadOffset<D>(bh, g.tq, g.heads) + int64_t(row) * stride;
  float* const dq_row = dq + GradOffset<D>(bh, g.tq, g) + int64_t(row) * g.grad_stride;
  const float* kh = k + KvHeadOffset<D, kGqa>(bh, g);
  const float* vh = v + KvHeadOffset<D, kGqa>(bh, g);
  const int n_kt = KeyTiles(g, q0, RB, BN);

  LoadTile<BN, D, false>(sK, kh, kv_stride, 0, g.tk);
  LoadTile<BN, D, false>(sV, vh, kv_stride, 0, g.tk);
  CopyAsyncCommit();
  float qr[16], dor[16], dq_acc[16] = {};
  LoadRow<D>(qr, q + q_off, c, valid);
  LoadRow<D>(dor, dout + q_off, c, valid);
  const float lse2 = valid ? lse[bh * g.tq + row] * kLog2e : 0.f;
  const float dl = valid ? delta[bh * g.tq + row] : 0.f;

  for (int j = 0; j < n_kt; ++j) {
    CopyAsyncWaitAll();
    __syncthreads();
    if (j + 1 < n_kt) {
      const int nb = (j + 1) & 1;
      LoadTile<BN, D, false>(sK + nb * BN * D, kh, kv_stride, (j + 1) * BN, g.tk);
      LoadTile<BN, D, false>(sV + nb * BN * D, vh, kv_stride, (j + 1) * BN, g.tk);
    }
    CopyAsyncCommit();
    const float* cK = sK + (j & 1) * BN * D;
    const float* cV = sV + (j & 1) * BN * D;
    const int k0 = j * BN;
#pragma unroll 4
    for (int jj = 0; jj < BN; ++jj) {
      const int key = k0 + jj;
      const float s = DotRow<D>(qr, cK + jj * D, c);
      const float dp = DotRow<D>(dor, cV + jj * D, c);
      float p = exp2f(fmaf(s, g.scale_log2, -lse2));
      if (!valid || key >= g.tk || (g.causal && key > row)) p = 0.f;
      AxpyRow<D>(dq_acc, p * (dp - dl), cK + jj * D, c);
    }
  }
  if (valid) StoreRow<D>(dq_row, dq_acc, c, g.scale);
}

}  // namespace
}  // namespace blujax
