// The portable bfloat16 attention kernels (sm_80 and later), on tensor cores (mma.sync):
// forward, dK/dV and dQ. On Hopper the sm90 kernels replace them (attention_sm90_fwd.cuh,
// attention_sm90_bwd.cuh); xla_ext/cuda/attention.cu has the overview, the launchers and the
// handlers.

#pragma once

#include "cuda/attention_common.cuh"

namespace blujax {
namespace {

// ---------------------------------------------------------------------------------------------
// Tensor-core products the bfloat16 kernels share.

// acc[mt] (16 rows x D) += p[mt] (16 rows x kN, mma accumulators) x tile (kN x D, a swizzled
// shared-memory tile), for each of a warp's kMT m-tiles: O += P V, dQ += dS K, dV += P^T dO and
// dK += dS^T Q. Each B fragment is read once and feeds kMT mmas.
template <int kMT, int kNCols, int kDCols>
__device__ __forceinline__ void MmaRowsByTile(float (&acc)[kMT][kDCols][4],
                                              const float (&p)[kMT][kNCols][4], const bf16* tile,
                                              int lane) {
  constexpr int kN = kNCols * 8, D = kDCols * 8;  // the arrays hold 8-column mma tiles
#pragma unroll
  for (int kk = 0; kk < kN / 16; ++kk) {
    uint32_t a[kMT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) AccToOperand(a[mt], p[mt], kk);
#pragma unroll
    for (int dn = 0; dn < D / 16; ++dn) {
      uint32_t b[4];
      LdMatrixTrans(b, tile + Swz<D / 8>(kk * 16 + (lane & 7) + (lane & 8), 2 * dn + (lane >> 4)));
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        Mma(acc[mt][2 * dn], a[mt], b[0], b[1]);
        Mma(acc[mt][2 * dn + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// The same for one m-tile held as plain [columns][4] accumulator arrays.
template <int kNCols, int kDCols>
__device__ __forceinline__ void MmaRowsByTile(float (&acc)[kDCols][4],
                                              const float (&p)[kNCols][4], const bf16* tile,
                                              int lane) {
  MmaRowsByTile(reinterpret_cast<float (&)[1][kDCols][4]>(acc),
                reinterpret_cast<const float (&)[1][kNCols][4]>(p), tile, lane);
}

// acc (16 keys from row key0 of `keys` x the tile's rows) += keys rows^T over D: S^T = K Q^T
// and dP^T = V dO^T. The keys' A fragments come from `frag` (kRegs) or from shared memory.
template <bool kRegs, int D, int kNCols, int kFrags>
__device__ __forceinline__ void KeysByRows(float (&acc)[kNCols][4],
                                           const uint32_t (&frag)[kFrags][4], const bf16* keys,
                                           const bf16* rows, int key0, int lane) {
  constexpr int KC = D / 8;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t a[4];
    if constexpr (kRegs) {
#pragma unroll
      for (int r = 0; r < 4; ++r) a[r] = frag[kk][r];
    } else {
      LdMatrix(a, keys + Swz<KC>(key0 + (lane & 15), 2 * kk + (lane >> 4)));
    }
#pragma unroll
    for (int np = 0; np < kNCols / 2; ++np) {
      uint32_t b[4];
      LdMatrix(b, rows + Swz<KC>(np * 16 + (lane & 7) + ((lane >> 4) << 3),
                                 2 * kk + ((lane >> 3) & 1)));
      Mma(acc[2 * np], a, b[0], b[1]);
      Mma(acc[2 * np + 1], a, b[2], b[3]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// bfloat16 forward: one CTA per 64 * kMT query rows of one (batch, head); a warp owns kMT
// m-tiles of 16 rows. Every K or V fragment a warp reads from shared memory feeds kMT mmas, so
// kMT = 2 halves the shared-memory traffic per FLOP (at kMT = 1 the tile loop waits on ldmatrix,
// not on the tensor cores). kQRegs keeps Q's fragments in registers for the whole loop;
// without it they are re-read per key tile, which leaves room for the accumulators at D = 128.

template <int D, int MT, int BN, bool QRegs>
struct FwdBf16Cfg {
  static constexpr int kD = D, kMT = MT, kBN = BN;
  static constexpr bool kQRegs = QRegs;
  static constexpr int kBM = 64 * kMT, kChunks = D / 8;
  static constexpr int kSmem = (kBM + 4 * kBN) * D * int(sizeof(bf16));  // Q, 2 x (K, V)
};

// kMT = 2 (measured faster than kMT = 1, benchmarks/LOG.md). At D = 64, 64-key tiles with Q in
// registers (no spills); at D = 128, 32-key tiles with Q re-read (Q in registers or 64-key
// tiles spill, and measured slower).
template <int D>
using FwdBf16 = FwdBf16Cfg<D, 2, D == 64 ? 64 : 32, D == 64>;

// kGqa: grouped-query attention (k, v of g.kv_heads heads; attention.cu has the outline).
template <typename C, bool kGqa>
__global__ void __launch_bounds__(kThreads)
AttentionFwdBf16Kernel(const bf16* __restrict__ q, const bf16* __restrict__ k,
                       const bf16* __restrict__ v, bf16* __restrict__ out,
                       float* __restrict__ lse, Geometry g, int n_qt) {
  constexpr int D = C::kD, BM = C::kBM, BN = C::kBN, KC = C::kChunks, MT = C::kMT;
  extern __shared__ uint4 smem_fwd_bf16[];
  bf16* sQ = reinterpret_cast<bf16*>(smem_fwd_bf16);
  bf16* sK = sQ + BM * D;      // [2][BN][D]
  bf16* sV = sK + 2 * BN * D;  // [2][BN][D]

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gr = lane / 4, t4 = lane % 4;  // accumulator row group and column pair
  int qt;
  int64_t bh;
  BlockCoords(n_qt, g.causal, &qt, &bh);
  const int q0 = qt * BM;
  const int wrow = warp * 16 * MT;  // this warp's first row in the block
  const int64_t stride = int64_t(g.heads) * D, kv_stride = int64_t(KvHeads<kGqa>(g)) * D;
  const bf16* qh = q + HeadOffset<D>(bh, g.tq, g.heads);
  const bf16* kh = k + KvHeadOffset<D, kGqa>(bh, g);
  const bf16* vh = v + KvHeadOffset<D, kGqa>(bh, g);
  const int n_kt = KeyTiles(g, q0, BM, BN);

  LoadTile<BM, D, true>(sQ, qh, stride, q0, g.tq);
  LoadTile<BN, D, true>(sK, kh, kv_stride, 0, g.tk);
  LoadTile<BN, D, true>(sV, vh, kv_stride, 0, g.tk);
  CopyAsyncCommit();

  uint32_t qf[C::kQRegs ? MT : 1][C::kQRegs ? D / 16 : 1][4];
  float o[MT][D / 8][4] = {};
  float m[MT][2], l[MT][2];  // running max (log2 units) and this thread's part of the sum
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) m[mt][0] = m[mt][1] = -INFINITY, l[mt][0] = l[mt][1] = 0.f;
  // Q's A fragment of m-tile mt, k-step kk.
  auto q_frag = [&](uint32_t (&a)[4], int mt, int kk) {
    LdMatrix(a, sQ + Swz<KC>(wrow + mt * 16 + (lane & 15), 2 * kk + (lane >> 4)));
  };

  for (int j = 0; j < n_kt; ++j) {
    CopyAsyncWaitAll();
    __syncthreads();  // tile j is in; every warp is done with tile j - 1's buffer
    if (j + 1 < n_kt) {
      const int nb = (j + 1) & 1;
      LoadTile<BN, D, true>(sK + nb * BN * D, kh, kv_stride, (j + 1) * BN, g.tk);
      LoadTile<BN, D, true>(sV + nb * BN * D, vh, kv_stride, (j + 1) * BN, g.tk);
    }
    CopyAsyncCommit();
    if constexpr (C::kQRegs) {
      if (j == 0) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int kk = 0; kk < D / 16; ++kk) q_frag(qf[mt][kk], mt, kk);
      }
    }
    const bf16* cK = sK + (j & 1) * BN * D;
    const bf16* cV = sV + (j & 1) * BN * D;
    const int k0 = j * BN;

    // S = Q K^T: this warp's 16 * MT rows x BN keys.
    float s[MT][BN / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if constexpr (C::kQRegs) {
#pragma unroll
          for (int i = 0; i < 4; ++i) a[mt][i] = qf[mt][kk][i];
        } else {
          q_frag(a[mt], mt, kk);
        }
      }
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        uint32_t b[4];
        LdMatrix(b, cK + Swz<KC>(np * 16 + (lane & 7) + ((lane >> 4) << 3),
                                 2 * kk + ((lane >> 3) & 1)));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          Mma(s[mt][2 * np], a[mt], b[0], b[1]);
          Mma(s[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
      }
    }
    if (k0 + BN > g.tk || (g.causal && k0 + BN - 1 > q0 + wrow)) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = k0 + n * 8 + 2 * t4 + (e & 1);
            const int row = q0 + wrow + mt * 16 + gr + (e >> 1) * 8;
            if (key >= g.tk || (g.causal && key > row)) s[mt][n][e] = -INFINITY;
          }
        }
      }
    }

    // Online softmax; rows g and g + 8 of each m-tile are shared by the 4 threads of a quad.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = -INFINITY;
#pragma unroll
        for (int n = 0; n < BN / 8; ++n)
          mx = fmaxf(mx, fmaxf(s[mt][n][2 * r], s[mt][n][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 2));
        const float m_new = fmaxf(m[mt][r], mx * g.scale_log2);
        const float base = m_new == -INFINITY ? 0.f : m_new;  // a row with no key yet
        const float alpha = exp2f(m[mt][r] - base);
        m[mt][r] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float p = exp2f(fmaf(s[mt][n][2 * r + e], g.scale_log2, -base));
            s[mt][n][2 * r + e] = p;
            sum += p;
          }
        }
        l[mt][r] = l[mt][r] * alpha + sum;
#pragma unroll
        for (int dn = 0; dn < D / 8; ++dn) {
          o[mt][dn][2 * r] *= alpha;
          o[mt][dn][2 * r + 1] *= alpha;
        }
      }
    }

    MmaRowsByTile(o, s, cV, lane);  // O += P V
  }

  // Normalise, stage this warp's rows in its own rows of sQ (only it read them), and write
  // whole 16-byte chunks.
  __syncwarp();
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float sum = l[mt][r];
      sum += __shfl_xor_sync(kFull, sum, 1);
      sum += __shfl_xor_sync(kFull, sum, 2);
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      const int row = wrow + mt * 16 + gr + 8 * r;
#pragma unroll
      for (int dn = 0; dn < D / 8; ++dn)
        *reinterpret_cast<uint32_t*>(sQ + Swz<KC>(row, dn) + 2 * t4) =
            PackBf16(o[mt][dn][2 * r] * inv, o[mt][dn][2 * r + 1] * inv);
      if (t4 == 0 && q0 + row < g.tq)
        lse[bh * g.tq + q0 + row] = (m[mt][r] + log2f(sum)) * kLn2;
    }
  }
  __syncwarp();
  bf16* oh = out + HeadOffset<D>(bh, g.tq, g.heads);
#pragma unroll
  for (int i = 0; i < 16 * MT * KC / 32; ++i) {
    const int c = lane + 32 * i, row = wrow + c / KC, ch = c % KC;
    if (q0 + row < g.tq)
      *reinterpret_cast<uint4*>(oh + int64_t(q0 + row) * stride + ch * 8) =
          *reinterpret_cast<const uint4*>(sQ + Swz<KC>(row, ch));
  }
}

// ---------------------------------------------------------------------------------------------
// bfloat16 backward, dK and dV: one CTA per 64 keys of one (batch, head), looping over query
// tiles. A warp owns 16 keys, so P^T and dS^T (keys x queries) stay in its registers and feed
// the dV and dK products directly. Grouped-query attention (kGqa): one CTA per 64 keys of one
// (batch, key/value head), looping over the query tiles of each of its group's query heads in
// turn (QuerySteps), so dK and dV sum the group in its registers.

template <int D>
struct BwdKvBf16 {
  static constexpr int kBN = 64;                 // keys per CTA
  static constexpr int kBM = D == 128 ? 32 : 64;  // queries per tile: the accumulators of
                                                  // dK and dV take D/2 registers each
  static constexpr int kChunks = D / 8;
  // This warp's K and V fragments (the A operands of S^T and dP^T) held in registers rather
  // than re-read per query tile: 32 registers at D = 64; no room at D = 128.
  static constexpr bool kKvRegs = D == 64;
  static constexpr int kSmem = (2 * kBN + 4 * kBM) * D * int(sizeof(bf16)) +  // K, V, 2 x (Q, dO)
                               4 * kBM * int(sizeof(float));                   // 2 x (lse, delta)
};

template <int D, bool kGqa>
__global__ void __launch_bounds__(kThreads)
AttentionBwdKvBf16Kernel(const bf16* __restrict__ q, const bf16* __restrict__ k,
                         const bf16* __restrict__ v, const bf16* __restrict__ dout,
                         const float* __restrict__ lse, const float* __restrict__ delta,
                         bf16* __restrict__ dk, bf16* __restrict__ dv, Geometry g, int n_kt) {
  using C = BwdKvBf16<D>;
  constexpr int BM = C::kBM, BN = C::kBN, KC = C::kChunks;
  extern __shared__ uint4 smem_kv_bf16[];
  bf16* sK = reinterpret_cast<bf16*>(smem_kv_bf16);
  bf16* sV = sK + BN * D;
  bf16* sQ = sV + BN * D;       // [2][BM][D]
  bf16* sdO = sQ + 2 * BM * D;  // [2][BM][D]
  float* sL = reinterpret_cast<float*>(sdO + 2 * BM * D);  // [2][BM]
  float* sDl = sL + 2 * BM;                                // [2][BM]

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gr = lane / 4, t4 = lane % 4;
  int kt;
  int64_t bh;
  BlockCoords(n_kt, false, &kt, &bh);  // causal: key tile 0 has the most work, so it goes first
  const int k0 = kt * BN;
  const int64_t stride = int64_t(g.heads) * D, kv_stride = int64_t(KvHeads<kGqa>(g)) * D;
  // The (batch, query head) whose tiles load next: bh's own, or (kGqa, bh being a key/value
  // head) its group's first, then the next one once the loop is through its tiles.
  int64_t bq = kGqa ? bh * g.group : bh;
  const bf16* qh = q + HeadOffset<D>(bq, g.tq, g.heads);
  const bf16* doh = dout + HeadOffset<D>(bq, g.tq, g.heads);
  const float* lh = lse + bq * g.tq;
  const float* dlh = delta + bq * g.tq;
  const int n_qt = (g.tq + BM - 1) / BM;
  const int first = g.causal ? k0 / BM : 0;  // earlier queries see none of these keys
  const QuerySteps steps(bh, first, n_qt, g);
  const int last = kGqa ? steps.Last() : n_qt;
  const int key_a = k0 + warp * 16 + gr;     // the key of accumulator entries 0, 1 (+8: 2, 3)

  LoadTile<BN, D, true>(sK, k + HeadOffset<D>(bh, g.tk, KvHeads<kGqa>(g)), kv_stride, k0, g.tk);
  LoadTile<BN, D, true>(sV, v + HeadOffset<D>(bh, g.tk, KvHeads<kGqa>(g)), kv_stride, k0, g.tk);
  LoadTile<BM, D, true>(sQ, qh, stride, first * BM, g.tq);
  LoadTile<BM, D, true>(sdO, doh, stride, first * BM, g.tq);
  LoadStats<BM>(sL, lh, first * BM, g.tq);
  LoadStats<BM>(sDl, dlh, first * BM, g.tq);
  CopyAsyncCommit();

  float dk_acc[D / 8][4] = {}, dv_acc[D / 8][4] = {};
  uint32_t kf[C::kKvRegs ? D / 16 : 1][4], vf[C::kKvRegs ? D / 16 : 1][4];
  for (int i = first; i < last; ++i) {
    CopyAsyncWaitAll();
    __syncthreads();
    if constexpr (C::kKvRegs) {
      if (i == first) {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          const int at = Swz<KC>(warp * 16 + (lane & 15), 2 * kk + (lane >> 4));
          LdMatrix(kf[kk], sK + at);
          LdMatrix(vf[kk], sV + at);
        }
      }
    }
    if (i + 1 < last) {
      const int nb = (i + 1 - first) & 1, r0 = (kGqa ? steps.Tile(i + 1) : i + 1) * BM;
      if constexpr (kGqa) {
        if (steps.Head(i + 1) != bq) {  // on to the group's next query head
          bq = steps.Head(i + 1);
          qh = q + HeadOffset<D>(bq, g.tq, g.heads);
          doh = dout + HeadOffset<D>(bq, g.tq, g.heads);
          lh = lse + bq * g.tq;
          dlh = delta + bq * g.tq;
        }
      }
      LoadTile<BM, D, true>(sQ + nb * BM * D, qh, stride, r0, g.tq);
      LoadTile<BM, D, true>(sdO + nb * BM * D, doh, stride, r0, g.tq);
      LoadStats<BM>(sL + nb * BM, lh, r0, g.tq);
      LoadStats<BM>(sDl + nb * BM, dlh, r0, g.tq);
    }
    CopyAsyncCommit();
    const int buf = (i - first) & 1, q0 = (kGqa ? steps.Tile(i) : i) * BM;
    const bf16* cQ = sQ + buf * BM * D;
    const bf16* cdO = sdO + buf * BM * D;
    const float* cL = sL + buf * BM;
    const float* cDl = sDl + buf * BM;

    // S^T = K Q^T: this warp's 16 keys x BM queries.
    float st[BM / 8][4] = {};
    KeysByRows<C::kKvRegs, D>(st, kf, sK, cQ, warp * 16, lane);
    // P^T = exp(scale S^T - lse of each column's query); masked entries are 0.
    const bool mask = q0 + BM > g.tq || k0 + BN > g.tk || (g.causal && q0 < k0 + BN - 1);
#pragma unroll
    for (int n = 0; n < BM / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = n * 8 + 2 * t4 + (e & 1), query = q0 + col, key = key_a + (e >> 1) * 8;
        float p = exp2f(fmaf(st[n][e], g.scale_log2, -cL[col] * kLog2e));
        if (mask && (query >= g.tq || key >= g.tk || (g.causal && key > query))) p = 0.f;
        st[n][e] = p;
      }
    }
    MmaRowsByTile(dv_acc, st, cdO, lane);  // dV += P^T dO
    // dP^T = V dO^T.
    float dpt[BM / 8][4] = {};
    KeysByRows<C::kKvRegs, D>(dpt, vf, sV, cdO, warp * 16, lane);
    // dS^T = P^T (dP^T - delta), in place.
#pragma unroll
    for (int n = 0; n < BM / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        dpt[n][e] = st[n][e] * (dpt[n][e] - cDl[n * 8 + 2 * t4 + (e & 1)]);
    }
    MmaRowsByTile(dk_acc, dpt, cQ, lane);  // dK += dS^T Q (scaled at the end)
  }

  // Stage in this warp's own rows of sK / sV (no other warp reads them) and write.
  __syncwarp();
#pragma unroll
  for (int dn = 0; dn < D / 8; ++dn) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = warp * 16 + gr + 8 * r, at = Swz<KC>(row, dn) + 2 * t4;
      *reinterpret_cast<uint32_t*>(sK + at) =
          PackBf16(dk_acc[dn][2 * r] * g.scale, dk_acc[dn][2 * r + 1] * g.scale);
      *reinterpret_cast<uint32_t*>(sV + at) = PackBf16(dv_acc[dn][2 * r], dv_acc[dn][2 * r + 1]);
    }
  }
  __syncwarp();
  const int64_t grad_off = KvGradOffset<D, kGqa>(bh, g);
  const int64_t grad_stride = KvGradStride<D, kGqa>(g);
#pragma unroll
  for (int i = 0; i < 16 * KC / 32; ++i) {
    const int c = lane + 32 * i, row = warp * 16 + c / KC, ch = c % KC;
    if (k0 + row < g.tk) {
      const int64_t at = grad_off + int64_t(k0 + row) * grad_stride + ch * 8;
      *reinterpret_cast<uint4*>(dk + at) = *reinterpret_cast<const uint4*>(sK + Swz<KC>(row, ch));
      *reinterpret_cast<uint4*>(dv + at) = *reinterpret_cast<const uint4*>(sV + Swz<KC>(row, ch));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// bfloat16 backward, dQ: one CTA per 64 * kMT query rows, looping over key tiles; a warp owns
// kMT m-tiles of 16 rows, so each K or V fragment read from shared memory feeds kMT mmas (as
// in the forward). kGqa: the key tiles of the query head's key/value head.

template <int D, int MT, int BN>
struct BwdQBf16Cfg {
  static constexpr int kD = D, kMT = MT, kBM = 64 * MT, kBN = BN, kChunks = D / 8;
  static constexpr int kSmem = (2 * kBM + 4 * kBN) * D * int(sizeof(bf16));  // Q, dO, 2 x (K, V)
};

// kMT = 2 with 32-key tiles: measured faster per forward+backward than 64 rows x 64 keys (and
// than 128 x 64, which spills at D = 128).
template <int D>
using BwdQBf16 = BwdQBf16Cfg<D, 2, 32>;

template <typename C, bool kGqa>
__global__ void __launch_bounds__(kThreads)
AttentionBwdQBf16Kernel(const bf16* __restrict__ q, const bf16* __restrict__ k,
                        const bf16* __restrict__ v, const bf16* __restrict__ dout,
                        const float* __restrict__ lse, const float* __restrict__ delta,
                        bf16* __restrict__ dq, Geometry g, int n_qt) {
  constexpr int D = C::kD, BM = C::kBM, BN = C::kBN, KC = C::kChunks, MT = C::kMT;
  extern __shared__ uint4 smem_q_bf16[];
  bf16* sQ = reinterpret_cast<bf16*>(smem_q_bf16);
  bf16* sdO = sQ + BM * D;
  bf16* sK = sdO + BM * D;     // [2][BN][D]
  bf16* sV = sK + 2 * BN * D;  // [2][BN][D]

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gr = lane / 4, t4 = lane % 4;
  int qt;
  int64_t bh;
  BlockCoords(n_qt, g.causal, &qt, &bh);
  const int q0 = qt * BM;
  const int wrow = warp * 16 * MT;  // this warp's first row in the block
  const int64_t stride = int64_t(g.heads) * D, kv_stride = int64_t(KvHeads<kGqa>(g)) * D;
  const int64_t q_off = HeadOffset<D>(bh, g.tq, g.heads);
  const bf16* kh = k + KvHeadOffset<D, kGqa>(bh, g);
  const bf16* vh = v + KvHeadOffset<D, kGqa>(bh, g);
  const int n_kt = KeyTiles(g, q0, BM, BN);

  LoadTile<BM, D, true>(sQ, q + q_off, stride, q0, g.tq);
  LoadTile<BM, D, true>(sdO, dout + q_off, stride, q0, g.tq);
  LoadTile<BN, D, true>(sK, kh, kv_stride, 0, g.tk);
  LoadTile<BN, D, true>(sV, vh, kv_stride, 0, g.tk);
  CopyAsyncCommit();

  // Per-row statistics of rows wrow + 16 mt + gr (+ 8); rows past Tq are masked below.
  float lse2[MT][2], dl[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = q0 + wrow + mt * 16 + gr + 8 * r;
      lse2[mt][r] = row < g.tq ? lse[bh * g.tq + row] * kLog2e : 0.f;
      dl[mt][r] = row < g.tq ? delta[bh * g.tq + row] : 0.f;
    }
  }

  float dq_acc[MT][D / 8][4] = {};
  for (int j = 0; j < n_kt; ++j) {
    CopyAsyncWaitAll();
    __syncthreads();
    if (j + 1 < n_kt) {
      const int nb = (j + 1) & 1;
      LoadTile<BN, D, true>(sK + nb * BN * D, kh, kv_stride, (j + 1) * BN, g.tk);
      LoadTile<BN, D, true>(sV + nb * BN * D, vh, kv_stride, (j + 1) * BN, g.tk);
    }
    CopyAsyncCommit();
    const bf16* cK = sK + (j & 1) * BN * D;
    const bf16* cV = sV + (j & 1) * BN * D;
    const int k0 = j * BN;
    // Causal: a tile whose keys all come after this warp's last row adds nothing to its dQ
    // (the block's later rows need the tile). The same skip in the forward measured slower at
    // D = 128, so it is not there.
    if (g.causal && q0 + wrow + 16 * MT - 1 < k0) continue;

    // S = Q K^T and dP = dO V^T: this warp's 16 * MT rows x BN keys. The Q and dO operands
    // are re-read from shared memory rather than held, to leave registers to the accumulators.
    float s[MT][BN / 8][4] = {}, dp[MT][BN / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[MT][4], ao[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int at = Swz<KC>(wrow + mt * 16 + (lane & 15), 2 * kk + (lane >> 4));
        LdMatrix(a[mt], sQ + at);
        LdMatrix(ao[mt], sdO + at);
      }
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        const int at = Swz<KC>(np * 16 + (lane & 7) + ((lane >> 4) << 3),
                               2 * kk + ((lane >> 3) & 1));
        uint32_t b[4];
        LdMatrix(b, cK + at);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          Mma(s[mt][2 * np], a[mt], b[0], b[1]);
          Mma(s[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
        LdMatrix(b, cV + at);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          Mma(dp[mt][2 * np], ao[mt], b[0], b[1]);
          Mma(dp[mt][2 * np + 1], ao[mt], b[2], b[3]);
        }
      }
    }
    // dS = P (dP - delta), P = exp(scale S - lse); masked entries are 0.
    const bool mask = q0 + BM > g.tq || k0 + BN > g.tk || (g.causal && k0 + BN - 1 > q0 + wrow);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = k0 + n * 8 + 2 * t4 + (e & 1), r = e >> 1;
          const int row = q0 + wrow + mt * 16 + gr + 8 * r;
          float p = exp2f(fmaf(s[mt][n][e], g.scale_log2, -lse2[mt][r]));
          if (mask && (row >= g.tq || key >= g.tk || (g.causal && key > row))) p = 0.f;
          s[mt][n][e] = p * (dp[mt][n][e] - dl[mt][r]);
        }
      }
    }
    MmaRowsByTile(dq_acc, s, cK, lane);  // dQ += dS K (scaled at the end)
  }

  // Stage in this warp's own rows of sQ and write.
  __syncwarp();
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = wrow + mt * 16 + gr + 8 * r;
        *reinterpret_cast<uint32_t*>(sQ + Swz<KC>(row, dn) + 2 * t4) = PackBf16(
            dq_acc[mt][dn][2 * r] * g.scale, dq_acc[mt][dn][2 * r + 1] * g.scale);
      }
    }
  }
  __syncwarp();
  const int64_t grad_off = GradOffset<D>(bh, g.tq, g);
#pragma unroll
  for (int i = 0; i < 16 * MT * KC / 32; ++i) {
    const int c = lane + 32 * i, row = wrow + c / KC, ch = c % KC;
    if (q0 + row < g.tq)
      *reinterpret_cast<uint4*>(dq + grad_off + int64_t(q0 + row) * g.grad_stride + ch * 8) =
          *reinterpret_cast<const uint4*>(sQ + Swz<KC>(row, ch));
  }
}

}  // namespace
}  // namespace blujax
