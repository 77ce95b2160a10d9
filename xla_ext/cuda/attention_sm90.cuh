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

#pragma once

#include "cuda/attention_sm90_common.cuh"

namespace blujax {
namespace {

// ---------------------------------------------------------------------------------------------
// The forward kernel: one CTA per 64 * kWarpgroups query rows of one (batch, head).

template <int D, int WG, int BN>
struct FwdSm90Cfg {
  static constexpr int kD = D, kWarpgroups = WG, kBN = BN;
  // kWarpgroups consumers and a producer warpgroup, whose registers go to the consumers: per
  // quarter of the register file (a warp of each warpgroup) 32 x (24 + 2 x 240) <= 16384.
  static constexpr int kConsumers = 128 * WG, kThreads = kConsumers + 128, kBM = 64 * WG;
  static constexpr int kConsumerRegs = WG == 2 ? 240 : 160, kProducerRegs = WG == 2 ? 24 : 32;
  // Q, 2 x (K, V), the mbarriers, and room to align the tiles to 1024 bytes.
  static constexpr int kSmem = (kBM + 4 * kBN) * D * int(sizeof(bf16)) + 128 + 1024;
};

// Measured on an H100 (benchmarks/RESULTS.md): D = 64 runs up to 19% faster with three
// consumer warpgroups than with two (the same at T = 1024 causal): its softmax costs about as
// much as its products, and a third warpgroup hides more of it. D = 128 has registers for two
// only. 64-key tiles ran 6-14% slower. With turns, two warpgroups at D = 64 are still 5-13%
// slower than three.
template <int D>
using FwdSm90 = FwdSm90Cfg<D, D == 64 ? 3 : 2, 128>;

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

template <typename C>
__global__ void __launch_bounds__(C::kThreads, 1)
AttentionFwdSm90Kernel(const __grid_constant__ FwdSm90Maps maps, bf16* __restrict__ out,
                       float* __restrict__ lse, Geometry g, int n_qt, int lead) {
#ifdef BLUJAX_WGMMA
  constexpr int D = C::kD, BM = C::kBM, BN = C::kBN;
  extern __shared__ uint4 smem_fwd_sm90[];
  bf16* sQ = Aligned1024(smem_fwd_sm90);
  bf16* sK = sQ + BM * D;      // [2][BN][D]
  bf16* sV = sK + 2 * BN * D;  // [2][BN][D]
  const KvStream<2> pipe(reinterpret_cast<uint64_t*>(sV + 2 * BN * D));

  int qt;
  int64_t bh;
  BlockCoords(n_qt, g.causal, &qt, &bh);
  const int q0 = qt * BM - lead, n_kt = KeyTiles(g, q0, BM, BN);
  const int b = static_cast<int>(bh / g.heads), h = static_cast<int>(bh % g.heads);
  constexpr int kConsumerWarps = C::kConsumers / 32;
  if (threadIdx.x == 0) pipe.Init(kConsumerWarps);
  __syncthreads();

  // Roles by warpgroup, read through a shuffle so the compiler knows they are warp-uniform.
  const int wg = __shfl_sync(kFull, threadIdx.x / 128, 0);
  if (wg == C::kWarpgroups) {
    // The producer: Q, then K_j and V_j into buffer j % 2.
    SetMaxRegs<C::kProducerRegs>();
    if (threadIdx.x == C::kConsumers) {
      // Q a warpgroup's 64 rows at a time, none for rows before 0 (only causal blocks start
      // there, and those warpgroups have no work), so every copy starts inside the tensor.
      const int first_wg = q0 < 0 ? -q0 / 64 : 0;
      MbarExpectBytes(pipe.q_full, (C::kWarpgroups - first_wg) * 64 * D * int(sizeof(bf16)));
      for (int w = first_wg; w < C::kWarpgroups; ++w)
        TmaTile<D>(sQ + w * 64 * 64, BM, &maps.q, h, q0 + w * 64, b, pipe.q_full);
      pipe.Stream<D, BN>(sK, sV, &maps.k, &maps.v, h, b, n_kt);
    }
    return;
  }
  SetMaxRegs<C::kConsumerRegs>();

  const int warp = threadIdx.x % 128 / 32, lane = threadIdx.x % 32;
  const int gr = lane / 4, t4 = lane % 4;  // accumulator row group and column pair
  const int wrow = wg * 64 + warp * 16;    // this warp's first row in the block
  const bf16* sQw = sQ + wg * 64 * 64;     // this warpgroup's 64 rows in each 64-column half
  // One arrival per consumer warp, after the wgmma wait that ends its use of the buffer.
  auto release = [&](uint64_t* bar) { MbarArrive(bar, lane == 0); };

  float o[D / 8][4] = {};
  float s[BN / 8][4];
  uint32_t p[BN / 16][4];
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // running max (log2), partial sum
  // Key tiles this warpgroup has pairs in: fewer than the CTA's when causal (its rows end
  // before the block's last), none when its rows start past the end or lie before row 0 (a
  // causal call's `lead`). Skipping the rest gave the others the tensor cores: +8% at
  // T = 1024, D = 64, causal, +4% at T = 2048 (H100).
  const int q0w = q0 + wg * 64;
  const int n_own = q0w >= g.tq || q0w < 0 ? 0 : KeyTiles(g, q0w, 64, BN);
  const Turns<C::kWarpgroups> turns(wg, n_kt);
  MbarWait(pipe.q_full, 0);
  for (int j = 0; j < n_own; ++j) {
    const int buf = j & 1, prev = (j - 1) & 1;
    MbarWait(pipe.k_full + buf, (j >> 1) & 1);
    if (j > 0) MbarWait(pipe.v_full + prev, ((j - 1) >> 1) & 1);
    turns.Take();
    WgmmaFence();
    IssueRowsByRows<BN, D, BM>(s, sQw, sK + buf * BN * D);  // S_j = Q K_j^T
    if (j > 0) {
      IssueAccumulate<BN, D>(o, p, sV + prev * BN * D);  // O += P_{j-1} V_{j-1}
      turns.Pass(j);
      WgmmaWait<1>();
    } else {
      turns.Pass(j);
      WgmmaWait<0>();
    }
    release(pipe.k_empty + buf);
    FenceRegs(s);
    float alpha[2];
    SoftmaxStep<BN>(s, m, l, alpha, g, j * BN, q0 + wrow, gr, t4);
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
    const int last = (n_own - 1) & 1;
    MbarWait(pipe.v_full + last, ((n_own - 1) >> 1) & 1);
    WgmmaFence();
    IssueAccumulate<BN, D>(o, p, sV + last * BN * D);
    WgmmaWait<0>();
    FenceRegs(o);
    if (n_own < n_kt) release(pipe.v_empty + last);
  }
  // The tiles past this warpgroup's last pair: it waits for each and hands it straight back,
  // so that every buffer still gets all its arrivals and the producer stays in step.
  for (int j = n_own; j < n_kt; ++j) {
    const int buf = j & 1, phase = (j >> 1) & 1;
    turns.Take();
    turns.Pass(j);
    MbarWait(pipe.k_full + buf, phase);
    release(pipe.k_empty + buf);
    MbarWait(pipe.v_full + buf, phase);
    release(pipe.v_empty + buf);
  }

  // Normalise, stage this warp's rows in its own rows of sQ (only its warpgroup read them,
  // and its MMAs are done), and write whole 16-byte chunks.
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = l[r];
    sum += __shfl_xor_sync(kFull, sum, 1);
    sum += __shfl_xor_sync(kFull, sum, 2);
    inv[r] = sum > 0.f ? 1.f / sum : 0.f;
    const int row = q0 + wrow + gr + 8 * r;
    if (t4 == 0 && row >= 0 && row < g.tq) lse[bh * g.tq + row] = (m[r] + log2f(sum)) * kLn2;
  }
  StageRows<BM, D>(sQ, o, wrow, inv, lane);
  __syncwarp();
  StoreRows<BM, D>(out + HeadOffset<D>(bh, g.tq, g.heads), sQ, wrow, q0, g.tq,
                   int64_t(g.heads) * D, lane);
#endif  // BLUJAX_WGMMA
}

}  // namespace
}  // namespace blujax

