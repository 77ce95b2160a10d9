// The bfloat16 attention forward on Hopper (sm_90a): warpgroup MMAs (wgmma) read Q, K and V
// straight from shared memory, where the tensor memory accelerator (TMA) puts them, so no
// ldmatrix or copy instructions compete with the tensor cores (xla_ext/cuda/attention.cu has
// the overview, the launchers and the handlers).
//
// The kernel is persistent: one CTA per multiprocessor takes units of work in turn, a unit
// being a block of 64 * kWarpgroups query rows of one (batch, head), or in a causal call the
// pair of blocks n - 1 - p and p, so that units have the same number of key tiles. A CTA is
// kWarpgroups consumer warpgroups of 128 threads, each owning 64 rows of the block, and one
// producer warp. The producer's one thread issues TMA copies of each block's Q into one of two
// buffers and of every K and V tile into two buffers each, streaming on from one block to the
// next without a pause; mbarriers say when a buffer is full (the copy's bytes arrived) and when
// it is empty again (every consumer warp is done with it), so the warpgroups never wait on each
// other. Per key tile j a consumer warpgroup
//   issues S_j = Q K_j^T          wgmma m64n{BN}k16, A = Q and B = K from shared memory,
//   issues O += P_{j-1} V_{j-1}   wgmma m64n{D}k16, A = P from registers, B = V read transposed,
//   waits for S_j and runs the online softmax on its registers (the per-thread layout of
//   mma.sync's accumulators) while the second product is still on the tensor cores,
//   then waits for that product and rescales O.
// The warpgroups take turns to issue their products (Turns, common/sm90.cuh).
// A finished block's rows leave the way its Q came: each warp stages its 16 rows of O in the
// block's Q buffer and one of its threads has the TMA unit store them; the buffer is given back
// in the next block, once the stores have read it.
// In a causal call a warpgroup stops at the last key tile its own rows reach (and one whose
// rows all lie past the end does no tiles); it hands the later tiles straight back. Causal
// blocks start before row 0 where T is not a multiple of the block (the launcher's `lead`), so
// the warpgroups left idle are in the first block, the cheapest, not the last.
// Which units a CTA takes: where all cost the same, every gridDim.x-th; where some are cheaper
// (a last block only partly inside the sequence, a causal middle block without a partner), the
// next one not yet taken, from a counter in global memory, so that no CTA is left with more
// than its share.
// Grouped-query attention (kGqa) changes only what the producer copies: a block's K and V
// tiles are those of its query head's key/value head (the maps of k and v have KV heads).

#pragma once

#include <climits>

#include "cuda/attention_sm90_common.cuh"

namespace blujax {
namespace {

// ---------------------------------------------------------------------------------------------
// The forward kernel's shape: blocks of 64 * kWarpgroups query rows, key tiles of kBN.

template <int D, int WG, int BN>
struct FwdSm90Cfg {
  static constexpr int kD = D, kWarpgroups = WG, kBN = BN;
  // kWarpgroups consumers and a producer warpgroup, whose registers go to the consumers: per
  // quarter of the register file (a warp of each warpgroup) 32 x (24 + 2 x 240) <= 16384, and
  // the consumers' increase must fit in what the producer gives back.
  static constexpr int kConsumers = 128 * WG, kThreads = kConsumers + 128, kBM = 64 * WG;
  static constexpr int kConsumerRegs = WG == 2 ? 240 : 160, kProducerRegs = WG == 2 ? 24 : 32;
  // 2 Q blocks, 2 x (K, V), the mbarriers and the blocks' coordinates, and room to align the
  // tiles to 1024 bytes.
  static constexpr int kSmem = (2 * kBM + 4 * kBN) * D * int(sizeof(bf16)) + 128 + 1024;
};

// D = 64 takes three consumer warpgroups: its softmax costs about as much as its products, and
// a third warpgroup hides more of it (faster than two, with turns or without). D = 128 has
// registers for two only. 64-key tiles measured slower (benchmarks/LOG.md).
template <int D>
using FwdSm90 = FwdSm90Cfg<D, D == 64 ? 3 : 2, 128>;

// The TMA descriptors of q (boxes of 64 rows), k, v (kBN rows) and out (16 rows, a warp's),
// made on the host per call.
struct FwdSm90Maps {
  CUtensorMap q, k, v, out;
};

// Rows gr and gr + 8 of a warp's 16 in an m64 accumulator, shared by a quad's 4 threads:
// masks keys past the end or after the row (causal), and steps the online softmax, leaving
// P in s. Returns nothing; alpha[r] is the factor the row's O and sum must be scaled by.
template <int BN>
__device__ __forceinline__ void SoftmaxStep(float (&s)[BN / 8][4], float (&m)[2], float (&l)[2],
                                            float (&alpha)[2], const Geometry& g, int k0,
                                            int row0, int gr, int t4) {
  if (k0 + BN > g.tk || (g.causal && k0 + BN - 1 > row0)) {
#pragma unroll
    for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = k0 + n * 8 + 2 * t4 + (e & 1), row = row0 + gr + (e >> 1) * 8;
        if (key >= g.tk || (g.causal && key > row)) s[n][e] = -INFINITY;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = -INFINITY;
#pragma unroll
    for (int n = 0; n < BN / 8; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 2));
    const float m_new = fmaxf(m[r], mx * g.scale_log2);
    const float base = m_new == -INFINITY ? 0.f : m_new;  // a row with no key yet
    alpha[r] = exp2f(m[r] - base);
    m[r] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float p = exp2f(fmaf(s[n][2 * r + e], g.scale_log2, -base));
        s[n][2 * r + e] = p;
        sum += p;
      }
    }
    l[r] = l[r] * alpha[r] + sum;
  }
}

// In the warpgroup's turn (taken): issues S_j = Q K_j^T and, when has_prev, O += P_{j-1}
// V_{j-1}, passes the turn on, and waits for S_j.
template <int BN, int D, int BM, typename TurnsT>
__device__ __forceinline__ void FwdIssue(float (&s)[BN / 8][4], float (&o)[D / 8][4],
                                         const uint32_t (&p)[BN / 16][4], const bf16* q,
                                         const bf16* k, const bf16* v, bool has_prev,
                                         const TurnsT& turns, int jj) {
  IssueRowsByRows<BN, D, BM>(s, q, k);
  if (has_prev) {
    IssueAccumulate<BN, D>(o, p, v);
    turns.Pass(jj);
    WgmmaWait<1>();
  } else {
    turns.Pass(jj);
    WgmmaWait<0>();
  }
}

// The rest of key tile j once S_j is done (and O += P_{j-1} V_{j-1} issued, when has_prev):
// K_j's buffer back, the online softmax on S_j while that product runs, then V_{j-1}'s buffer
// back, O rescaled and P_j made into the operands of the next product.
template <int BN, int D>
__device__ __forceinline__ void FwdTileRest(float (&o)[D / 8][4], float (&s)[BN / 8][4],
                                            uint32_t (&p)[BN / 16][4], float (&m)[2],
                                            float (&l)[2], uint64_t* k_empty, uint64_t* v_empty,
                                            bool has_prev, const Geometry& g, int k0, int row0,
                                            int lane) {
  MbarArrive(k_empty, lane == 0);
  FenceRegs(s);
  float alpha[2];
  SoftmaxStep<BN>(s, m, l, alpha, g, k0, row0, lane / 4, lane % 4);
  WgmmaWait<0>();
  FenceRegs(o);
  FenceRegs(p);
  MbarArrive(v_empty, lane == 0 && has_prev);
#pragma unroll
  for (int dn = 0; dn < D / 8; ++dn) {
    o[dn][0] *= alpha[0];
    o[dn][1] *= alpha[0];
    o[dn][2] *= alpha[1];
    o[dn][3] *= alpha[1];
  }
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) AccToOperand(p[kk], s, kk);
}

// A warp's rows [wrow, wrow + 16) of a block at row q0 of (batch, head) bh, done: O
// normalised, staged as bfloat16 in the same rows of `staged` (a Q buffer) and stored from
// there by the TMA unit (lane 0's bulk group: the rows stay in use until its BulkWaitRead);
// the log-sum-exp to `lse`. Rows before 0 or past the end are not written.
template <int BM, int D>
__device__ __forceinline__ void FwdWriteRows(const float (&o)[D / 8][4], const float (&m)[2],
                                             const float (&l)[2], bf16* staged,
                                             const CUtensorMap* out, float* lse, int64_t bh,
                                             int q0, const Geometry& g, int wrow, int lane) {
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = l[r];
    sum += __shfl_xor_sync(kFull, sum, 1);
    sum += __shfl_xor_sync(kFull, sum, 2);
    inv[r] = sum > 0.f ? 1.f / sum : 0.f;
    const int row = q0 + wrow + lane / 4 + 8 * r;
    if (lane % 4 == 0 && row >= 0 && row < g.tq) lse[bh * g.tq + row] = (m[r] + log2f(sum)) * kLn2;
  }
  StageRows<BM, D>(staged, o, wrow, inv, lane);
  // The rows were written by this warp's threads (the generic proxy) and are read by the TMA
  // unit (the async proxy). A warp's rows are all before row 0 or none are (the causal lead
  // is whole warpgroups); the unit leaves out those past the end.
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncwarp();
  if (lane == 0 && q0 + wrow >= 0 && q0 + wrow < g.tq)
    TmaStoreRows<D, BM>(out, staged + wrow * 64, static_cast<int>(bh % g.heads), q0 + wrow,
                        static_cast<int>(bh / g.heads));
}

// The producer's copy of the block of query rows at q0 of (b, h) into `dst`, a warpgroup's 64
// rows at a time, none for rows before 0 (only causal blocks start there, and those warpgroups
// have no work), so every copy starts inside the tensor.
template <typename C>
__device__ __forceinline__ void LoadQ(bf16* dst, const CUtensorMap* map, int h, int q0, int b,
                                      uint64_t* full) {
  const int first_wg = q0 < 0 ? -q0 / 64 : 0;
  MbarExpectBytes(full, (C::kWarpgroups - first_wg) * 64 * C::kD * int(sizeof(bf16)));
  for (int w = first_wg; w < C::kWarpgroups; ++w)
    TmaTile<C::kD>(dst + w * 64 * 64, C::kBM, map, h, q0 + w * 64, b, full);
}

// The blocks of unit u, in order; returns how many. Each (batch, head) starts its blocks at
// another place in the row: CTA c takes units c, c + gridDim.x, ..., and where gridDim.x shares
// a factor with the units of a (batch, head), the same CTAs would otherwise always get the
// same blocks.
__device__ __forceinline__ int UnitBlocks(const Geometry& g, int n_qt, int u, int* bh, int* qt0,
                                          int* qt1) {
  const int per_bh = g.causal ? (n_qt + 1) / 2 : n_qt;
  *bh = u / per_bh;
  const int k = (u % per_bh + *bh) % per_bh;
  if (!g.causal) {
    *qt0 = *qt1 = k;
    return 1;
  }
  *qt1 = k;
  *qt0 = n_qt - 1 - k;  // the longer of the two
  return *qt0 == *qt1 ? 1 : 2;
}

// gridDim.x CTAs take the n_units units: with kCounted, a CTA's first is blockIdx.x and each
// later one gridDim.x + the count it reads from *unit_counter (zero at launch) as it adds 1;
// otherwise u, u + gridDim.x, ....
template <typename C, bool kCounted, bool kGqa>
__global__ void __launch_bounds__(C::kThreads, 1)
AttentionFwdSm90Kernel(const __grid_constant__ FwdSm90Maps maps, float* __restrict__ lse,
                       Geometry g, int n_units, int n_qt, int lead,
                       int* __restrict__ unit_counter) {
#ifdef BLUJAX_WGMMA
  constexpr int D = C::kD, BM = C::kBM, BN = C::kBN;
  extern __shared__ uint4 smem_fwd_sm90[];
  bf16* sQ = Aligned1024(smem_fwd_sm90);  // [2][BM][D]
  bf16* sK = sQ + 2 * BM * D;            // [2][BN][D]
  bf16* sV = sK + 2 * BN * D;            // [2][BN][D]
  uint64_t* bars = reinterpret_cast<uint64_t*>(sV + 2 * BN * D);
  const KvStream<2> pipe(bars);
  // Q buffer b is full: pipe.q_full for b = 0, q_full_1 for b = 1; empty: q_empty[b].
  uint64_t* q_full_1 = bars + KvStream<2>::kBarriers;
  uint64_t* q_empty = q_full_1 + 1;
  auto q_full = [&](int b) { return b == 0 ? pipe.q_full : q_full_1; };
  // The block in Q buffer b, written by the producer before the buffer fills: its (batch,
  // head) at [2 b], -1 once there are no more blocks, and its first row at [2 b + 1].
  int* block_of = reinterpret_cast<int*>(q_empty + 2);
  constexpr int kConsumerWarps = C::kConsumers / 32;
  if (threadIdx.x == 0) {
    MbarInit(q_full_1, 1);
    MbarInit(q_empty, kConsumerWarps);
    MbarInit(q_empty + 1, kConsumerWarps);
    pipe.Init(kConsumerWarps);
  }
  __syncthreads();

  // Roles by warpgroup, read through a shuffle so the compiler knows they are warp-uniform.
  const int wg = __shfl_sync(kFull, threadIdx.x / 128, 0);
  if (wg == C::kWarpgroups) {
    // The producer: per block, once the block two before has written its output from the
    // buffer, the block's coordinates and its Q, then its K_j and V_j.
    SetMaxRegs<C::kProducerRegs>();
    if (threadIdx.x == C::kConsumers) {
      int i = 0, first = 0;  // blocks and key tiles streamed so far
      auto next_buffer = [&]() {
        const int qb = i & 1;
        if (i >= 2) MbarWait(q_empty + qb, ((i >> 1) - 1) & 1);
        return qb;
      };
      for (int u = blockIdx.x; u < n_units;) {
        int bh, qt0, qt1;
        const int n_blocks = UnitBlocks(g, n_qt, u, &bh, &qt0, &qt1);
        const int b = static_cast<int>(bh / g.heads), h = static_cast<int>(bh % g.heads);
        for (int t = 0; t < n_blocks; ++t, ++i) {
          const int q0 = (t == 0 ? qt0 : qt1) * BM - lead, n_kt = KeyTiles(g, q0, BM, BN);
          const int qb = next_buffer();
          block_of[2 * qb] = bh;
          block_of[2 * qb + 1] = q0;
          LoadQ<C>(sQ + qb * BM * D, &maps.q, h, q0, b, q_full(qb));
          pipe.Stream<D, BN>(sK, sV, &maps.k, &maps.v, kGqa ? h / g.group : h, b, n_kt, first);
          first += n_kt;
        }
        u = kCounted ? static_cast<int>(gridDim.x) + atomicAdd(unit_counter, 1)
                     : u + static_cast<int>(gridDim.x);
      }
      // No more blocks: an arrival without bytes completes the next buffer's phase.
      const int qb = next_buffer();
      block_of[2 * qb] = -1;
      MbarArrive(q_full(qb), true);
    }
    return;
  }
  SetMaxRegs<C::kConsumerRegs>();

  const int warp = threadIdx.x % 128 / 32, lane = threadIdx.x % 32;
  const int wrow = wg * 64 + warp * 16;  // this warp's first row in the block
  // One arrival per consumer warp, after the wgmma wait that ends its use of the buffer.
  auto release = [&](uint64_t* bar) { MbarArrive(bar, lane == 0); };
  // The Q buffer whose staged output rows the TMA unit may still be reading (-1: none). It is
  // released in the next block, once its first product has been waited for, rather than right
  // after the stores are issued, so that the warp does not wait for them.
  int staged_in = -1;
  auto release_staged = [&]() {
    if (staged_in >= 0) {
      BulkWaitRead();
      release(q_empty + staged_in);
      staged_in = -1;
    }
  };
  // Every warpgroup passes every turn; warpgroup 0 takes the last pass after the loop.
  const Turns<C::kWarpgroups> turns(wg, INT_MAX);

  int first = 0;  // key tiles gone through so far
#pragma unroll 1
  for (int i = 0;; ++i) {
    const int qb = i & 1;
    MbarWait(q_full(qb), (i >> 1) & 1);
    const int bh = block_of[2 * qb], q0t = block_of[2 * qb + 1];
    if (bh < 0) {
      release_staged();
      break;
    }
    // Key tile j of this block is the stream's (first + j)-th.
    const int n_ktt = KeyTiles(g, q0t, BM, BN);
    const bf16* sQw = sQ + qb * BM * D + wg * 64 * 64;  // this warpgroup's rows, each half
    float o[D / 8][4] = {};
    float s[BN / 8][4];
    uint32_t p[BN / 16][4];
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // running max (log2), partial sum
    // Key tiles this warpgroup has pairs in: fewer than the block's when causal (its rows end
    // before the block's last), none when its rows start past the end or lie before row 0 (a
    // causal call's `lead`). Skipping the rest gives the others the tensor cores (measured
    // faster in causal calls).
    const int q0w = q0t + wg * 64;
    const int n_own = q0w >= g.tq || q0w < 0 ? 0 : KeyTiles(g, q0w, 64, BN);
    for (int j = 0; j < n_own; ++j) {
      const int jj = first + j, buf = jj & 1, prev = (jj - 1) & 1;
      MbarWait(pipe.k_full + buf, (jj >> 1) & 1);
      if (j > 0) MbarWait(pipe.v_full + prev, ((jj - 1) >> 1) & 1);
      turns.Take();
      WgmmaFence();
      FwdIssue<BN, D, BM>(s, o, p, sQw, sK + buf * BN * D, sV + prev * BN * D, j > 0, turns, jj);
      if (j == 0) release_staged();
      FwdTileRest<BN, D>(o, s, p, m, l, pipe.k_empty + buf, pipe.v_empty + prev, j > 0, g,
                         j * BN, q0t + wrow, lane);
    }
    release_staged();  // where the warpgroup has no tiles in this block
    if (n_own > 0) {
      const int jj = first + n_own - 1, last = jj & 1;
      MbarWait(pipe.v_full + last, (jj >> 1) & 1);
      WgmmaFence();
      IssueAccumulate<BN, D>(o, p, sV + last * BN * D);
      WgmmaWait<0>();
      FenceRegs(o);
      release(pipe.v_empty + last);
    }
    // Staged in this warp's own rows of the block's Q buffer (only its warpgroup read them, and
    // its products are done), and stored by the TMA unit: copying them out with the warps' own
    // loads and stores took thousands of cycles a block, mostly while neither warpgroup had a
    // product running, and the TMA stores measured faster (benchmarks/LOG.md).
    FwdWriteRows<BM, D>(o, m, l, sQ + qb * BM * D, &maps.out, lse, bh, q0t, g, wrow, lane);
    staged_in = qb;
    // The tiles past this warpgroup's last pair: it waits for each and hands it straight back,
    // so that every buffer still gets all its arrivals and the producer stays in step.
    for (int j = n_own; j < n_ktt; ++j) {
      const int jj = first + j, buf = jj & 1, phase = (jj >> 1) & 1;
      turns.Take();
      turns.Pass(jj);
      MbarWait(pipe.k_full + buf, phase);
      release(pipe.k_empty + buf);
      MbarWait(pipe.v_full + buf, phase);
      release(pipe.v_empty + buf);
    }
    first += n_ktt;
  }
  if (C::kWarpgroups > 1 && wg == 0) turns.Take();
  BulkWaitAll();
#endif  // BLUJAX_WGMMA
}

}  // namespace
}  // namespace blujax

