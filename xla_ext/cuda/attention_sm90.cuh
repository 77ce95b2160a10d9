// The bfloat16 attention forward on Hopper (sm_90a): warpgroup MMAs (wgmma) read Q, K and V
// straight from shared memory, where the tensor memory accelerator (TMA) puts them, so no
// ldmatrix or copy instructions compete with the tensor cores (xla_ext/cuda/attention.cu has
// the overview, the launchers and the handlers).
//
// A CTA is kWarpgroups consumer warpgroups of 128 threads, each owning 64 query rows, and one
// producer warp. The producer's one thread issues TMA copies of Q and of every K and V tile
// into two buffers each, and mbarriers say when a buffer is full (the copy's bytes arrived) and
// when it is empty again (every consumer warp is done with it), so the warpgroups never wait
// on each other. Per key tile j a consumer warpgroup
//   issues S_j = Q K_j^T          wgmma m64n{BN}k16, A = Q and B = K from shared memory,
//   issues O += P_{j-1} V_{j-1}   wgmma m64n{D}k16, A = P from registers, B = V read transposed,
//   waits for S_j and runs the online softmax on its registers (the per-thread layout of
//   mma.sync's accumulators) while the second product is still on the tensor cores,
//   then waits for that product and rescales O.
// The warpgroups take turns to issue their products (Turns, attention_sm90_common.cuh).
// In a causal call a warpgroup stops at the last key tile its own rows reach (and one whose
// rows all lie past the end does no tiles); it hands the later tiles straight back. Causal
// blocks start before row 0 where T is not a multiple of the block (the launcher's `lead`), so
// the warpgroups left idle are in the first block, the cheapest, not the last.
// A causal call's CTA takes two blocks of query rows, block p and block n - 1 - p (FwdBlocks),
// so every CTA has the same number of key tiles, and the second block's Q and first K/V tiles
// load while the first block's output is written. Each block has its own Q buffer; K and V
// stream through the same two buffers without a pause between the blocks.

#pragma once

#include "cuda/attention_sm90_common.cuh"

namespace blujax {
namespace {

// ---------------------------------------------------------------------------------------------
// The forward kernel: one CTA per block of 64 * kWarpgroups query rows of one (batch, head),
// or with kTiles = 2 per two such blocks.

template <int D, int WG, int BN, int TILES>
struct FwdSm90Cfg {
  static constexpr int kD = D, kWarpgroups = WG, kBN = BN, kTiles = TILES;
  // kWarpgroups consumers and a producer warpgroup, whose registers go to the consumers: per
  // quarter of the register file (a warp of each warpgroup) 32 x (24 + 2 x 240) <= 16384.
  static constexpr int kConsumers = 128 * WG, kThreads = kConsumers + 128, kBM = 64 * WG;
  static constexpr int kConsumerRegs = WG == 2 ? 240 : 160, kProducerRegs = WG == 2 ? 24 : 32;
  // kTiles Q blocks, 2 x (K, V), the mbarriers, and room to align the tiles to 1024 bytes.
  static constexpr int kSmem = (kTiles * kBM + 4 * kBN) * D * int(sizeof(bf16)) + 128 + 1024;
};

// Measured on an H100 (benchmarks/RESULTS.md): D = 64 runs up to 19% faster with three
// consumer warpgroups than with two (the same at T = 1024 causal): its softmax costs about as
// much as its products, and a third warpgroup hides more of it. D = 128 has registers for two
// only. 64-key tiles ran 6-14% slower. With turns, two warpgroups at D = 64 are still 5-13%
// slower than three.
template <int D, int TILES = 1>
using FwdSm90 = FwdSm90Cfg<D, D == 64 ? 3 : 2, 128, TILES>;

// The TMA descriptors of q (boxes of 64 rows) and k, v (kBN rows), made on the host per call.
struct FwdSm90Maps {
  CUtensorMap q, k, v;
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

// The blocks of query rows a CTA takes, in order: one, or with C::kTiles = 2 block p and block
// n_qt - 1 - p (the launcher pairs causal calls' blocks, so that every CTA has the same number
// of key tiles; with n_qt odd the middle block is alone). Returns how many.
template <typename C>
__device__ __forceinline__ int FwdBlocks(const Geometry& g, int n_qt, int64_t* bh, int (&qt)[2]) {
  if constexpr (C::kTiles == 1) {
    BlockCoords(n_qt, g.causal, &qt[0], bh);
    return 1;
  } else {
    const int n_pairs = (n_qt + 1) / 2;
    *bh = blockIdx.x / n_pairs;
    const int p = static_cast<int>(blockIdx.x % n_pairs);
    qt[0] = n_qt - 1 - p;  // the longer of the two when causal
    qt[1] = p;
    return qt[1] == qt[0] ? 1 : 2;
  }
}

template <typename C>
__global__ void __launch_bounds__(C::kThreads, 1)
AttentionFwdSm90Kernel(const __grid_constant__ FwdSm90Maps maps, bf16* __restrict__ out,
                       float* __restrict__ lse, Geometry g, int n_qt, int lead) {
#ifdef BLUJAX_WGMMA
  constexpr int D = C::kD, BM = C::kBM, BN = C::kBN;
  extern __shared__ uint4 smem_fwd_sm90[];
  bf16* sQ = Aligned1024(smem_fwd_sm90);  // [kTiles][BM][D]
  bf16* sK = sQ + C::kTiles * BM * D;    // [2][BN][D]
  bf16* sV = sK + 2 * BN * D;            // [2][BN][D]
  uint64_t* bars = reinterpret_cast<uint64_t*>(sV + 2 * BN * D);
  const KvStream<2> pipe(bars);
  // Q of the CTA's block t is full: pipe.q_full for the first, then these.
  uint64_t* q_full_more = bars + KvStream<2>::kBarriers;

  int64_t bh;
  int qt[2];
  const int n_blocks = FwdBlocks<C>(g, n_qt, &bh, qt);
  // Per block: its first row and its key tiles (named, not indexed, so they stay in registers).
  const int q0_0 = qt[0] * BM - lead, n_kt_0 = KeyTiles(g, q0_0, BM, BN);
  const int q0_1 = n_blocks > 1 ? qt[1] * BM - lead : 0;
  const int n_kt_1 = n_blocks > 1 ? KeyTiles(g, q0_1, BM, BN) : 0;
  auto q0 = [&](int t) { return t == 0 ? q0_0 : q0_1; };
  auto n_kt = [&](int t) { return t == 0 ? n_kt_0 : n_kt_1; };
  auto q_full = [&](int t) { return t == 0 ? pipe.q_full : q_full_more + t - 1; };
  const int b = static_cast<int>(bh / g.heads), h = static_cast<int>(bh % g.heads);
  constexpr int kConsumerWarps = C::kConsumers / 32;
  if (threadIdx.x == 0) {
    for (int t = 1; t < C::kTiles; ++t) MbarInit(q_full(t), 1);
    pipe.Init(kConsumerWarps);
  }
  __syncthreads();

  // Roles by warpgroup, read through a shuffle so the compiler knows they are warp-uniform.
  const int wg = __shfl_sync(kFull, threadIdx.x / 128, 0);
  if (wg == C::kWarpgroups) {
    // The producer: every block's Q at once (each has its own buffer), then K_j and V_j of
    // each block in turn through the two buffers, without a pause between blocks.
    SetMaxRegs<C::kProducerRegs>();
    if (threadIdx.x == C::kConsumers) {
      for (int t = 0; t < n_blocks; ++t) {
        // Q a warpgroup's 64 rows at a time, none for rows before 0 (only causal blocks start
        // there, and those warpgroups have no work), so every copy starts inside the tensor.
        const int first_wg = q0(t) < 0 ? -q0(t) / 64 : 0;
        MbarExpectBytes(q_full(t), (C::kWarpgroups - first_wg) * 64 * D * int(sizeof(bf16)));
        for (int w = first_wg; w < C::kWarpgroups; ++w)
          TmaTile<D>(sQ + t * BM * D + w * 64 * 64, BM, &maps.q, h, q0(t) + w * 64, b,
                     q_full(t));
      }
      for (int t = 0, first = 0; t < n_blocks; first += n_kt(t), ++t)
        pipe.Stream<D, BN>(sK, sV, &maps.k, &maps.v, h, b, n_kt(t), first);
    }
    return;
  }
  SetMaxRegs<C::kConsumerRegs>();

  const int warp = threadIdx.x % 128 / 32, lane = threadIdx.x % 32;
  const int gr = lane / 4, t4 = lane % 4;  // accumulator row group and column pair
  const int wrow = wg * 64 + warp * 16;    // this warp's first row in the block
  // One arrival per consumer warp, after the wgmma wait that ends its use of the buffer.
  auto release = [&](uint64_t* bar) { MbarArrive(bar, lane == 0); };
  const Turns<C::kWarpgroups> turns(wg, n_kt_0 + n_kt_1);

#pragma unroll 1
  for (int t = 0, first = 0; t < n_blocks; first += n_kt(t), ++t) {
    // Key tile j of this block is the buffers' (first + j)-th.
    const int q0t = q0(t), n_ktt = n_kt(t);
    bf16* sQt = sQ + t * BM * D;
    const bf16* sQw = sQt + wg * 64 * 64;  // this warpgroup's 64 rows in each 64-column half
    float o[D / 8][4] = {};
    float s[BN / 8][4];
    uint32_t p[BN / 16][4];
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // running max (log2), partial sum
    // Key tiles this warpgroup has pairs in: fewer than the block's when causal (its rows end
    // before the block's last), none when its rows start past the end or lie before row 0 (a
    // causal call's `lead`). Skipping the rest gave the others the tensor cores: +8% at
    // T = 1024, D = 64, causal, +4% at T = 2048 (H100).
    const int q0w = q0t + wg * 64;
    const int n_own = q0w >= g.tq || q0w < 0 ? 0 : KeyTiles(g, q0w, 64, BN);
    MbarWait(q_full(t), 0);
    for (int j = 0; j < n_own; ++j) {
      const int jj = first + j, buf = jj & 1, prev = (jj - 1) & 1;
      MbarWait(pipe.k_full + buf, (jj >> 1) & 1);
      if (j > 0) MbarWait(pipe.v_full + prev, ((jj - 1) >> 1) & 1);
      turns.Take();
      WgmmaFence();
      IssueRowsByRows<BN, D, BM>(s, sQw, sK + buf * BN * D);  // S_j = Q K_j^T
      if (j > 0) {
        IssueAccumulate<BN, D>(o, p, sV + prev * BN * D);  // O += P_{j-1} V_{j-1}
        turns.Pass(jj);
        WgmmaWait<1>();
      } else {
        turns.Pass(jj);
        WgmmaWait<0>();
      }
      release(pipe.k_empty + buf);
      FenceRegs(s);
      float alpha[2];
      SoftmaxStep<BN>(s, m, l, alpha, g, j * BN, q0t + wrow, gr, t4);
      WgmmaWait<0>();
      FenceRegs(o);
      FenceRegs(p);
      if (j > 0) release(pipe.v_empty + prev);
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
    if (n_own > 0) {
      const int jj = first + n_own - 1, last = jj & 1;
      MbarWait(pipe.v_full + last, (jj >> 1) & 1);
      WgmmaFence();
      IssueAccumulate<BN, D>(o, p, sV + last * BN * D);
      WgmmaWait<0>();
      FenceRegs(o);
      release(pipe.v_empty + last);
    }
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

    // Normalise, stage this warp's rows in its own rows of the block's Q buffer (only its
    // warpgroup read them, and its MMAs are done), and write whole 16-byte chunks.
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float sum = l[r];
      sum += __shfl_xor_sync(kFull, sum, 1);
      sum += __shfl_xor_sync(kFull, sum, 2);
      inv[r] = sum > 0.f ? 1.f / sum : 0.f;
      const int row = q0t + wrow + gr + 8 * r;
      if (t4 == 0 && row >= 0 && row < g.tq) lse[bh * g.tq + row] = (m[r] + log2f(sum)) * kLn2;
    }
    StageRows<BM, D>(sQt, o, wrow, inv, lane);
    __syncwarp();
    StoreRows<BM, D>(out + HeadOffset<D>(bh, g.tq, g.heads), sQt, wrow, q0t, g.tq,
                     int64_t(g.heads) * D, lane);
  }
#endif  // BLUJAX_WGMMA
}

}  // namespace
}  // namespace blujax

