// The bfloat16 attention backward on Hopper (sm_90a): the portable backward's two kernels (dK
// and dV per key block, dQ per query block; attention_sm80_bf16.cuh) rebuilt on warpgroup MMAs
// fed by TMA, as the forward in attention_sm90_fwd.cuh is (attention.cu has the overview, the
// launchers and the handlers). Both keep the portable kernels' properties: each output element
// is written by one CTA, so the result is deterministic, and no float32 scratch the size of dQ
// is needed. The dK/dV kernel can instead sum dQ as well (BwdKvDqSm90, below; the call's
// sum_dq attribute), and the dQ kernel is not run.
//
// Every product has one of the two forms the forward uses: a "scores" form, A and B both
// K-major tiles in shared memory (S = Q K^T; here also S^T = K Q^T, dP^T = V dO^T, dP = dO V^T),
// and an "accumulate" form, A from registers (a score-shaped accumulator converted in place)
// and B a [rows][D] tile read transposed (dV += P^T dO, dK += dS^T Q, dQ += dS K).
//
// dK/dV: a CTA is two consumer warpgroups, each owning 64 keys, and a producer warpgroup. The
// producer's first warp copies K and V once, then Q and dO of every query tile into two
// buffers (TMA); its second warp puts the tile's lse (in log2 units) and delta in shared memory
// beside them. Per query tile a consumer warpgroup issues S^T and dP^T, turns S^T into P^T,
// issues dV += P^T dO, turns dP^T into dS^T while that runs, and issues dK += dS^T Q.
// dQ: a CTA is kWarpgroups consumer warpgroups of 64 query rows and a producer that copies Q
// and dO once, then K and V of every key tile into kStages buffers. Per key tile j a consumer
// warpgroup issues S_j and dP_j, then dQ += dS_{j-1} K_{j-1}, and computes dS_j while that
// product runs (the forward's schedule, with dS in place of P); the two warpgroups take turns
// to issue (Turns). The dK/dV kernel does not: turns before its S^T and dP^T measured slower
// in causal calls, and no faster in the others.
// Causal: a warpgroup lets pass the tiles in which none of its (query, key) pairs survive the
// mask (a query tile before all its keys, a key tile after all its rows), still waiting for
// each and releasing it so that the buffers' mbarriers count its arrival.
// Grouped-query attention (kGqa): a dK/dV CTA holds 128 keys of one (batch, key/value head),
// and its producer streams the query tiles of the group's G query heads one head after the
// other through the same buffers (QuerySteps, attention_common.cuh), so the consumers sum dK
// and dV over the group in their accumulators and write them once: no copies per query head,
// and deterministic as the multi-head kernel. With dQ sums, each head's tiles go to its own
// rows of the workspace. The dQ kernel only reads K and V of its query head's key/value head.
// dQ in the dK/dV kernel: per query tile each consumer warpgroup also stores its dS^T
// transposed (stmatrix .trans) as its 64-key half of dS [64 queries][128 keys] in shared
// memory. The warpgroups take turns to finish the tile's dQ share, dS K over all 128 keys:
// warpgroup t % 2 owns query tile t. The owner waits for the other's half of dS, computes
// dQ's columns 64 at a time in S^T's registers (free by then) and stages them as float32 in
// its own buffer; the other only signals that its half is in and goes on to the next tile.
// So the two fall half a tile apart and one's exponentials run beside the other's products
// (measured faster than both computing half of dQ's columns after a barrier every tile, which
// kept them in step). The producer's third warp adds each staged tile into the workspace with
// one bulk reduction (cp.reduce.async.bulk .add.f32) and frees the buffer once it is read, so
// the owner does not wait on the sums. The CTA's share of dQ leaves it once per query tile:
// over a call the sums move Tk / 128 times dQ's float32 size through L2. Against the two
// kernels it runs forward+backward faster, but for causal calls of few keys, where a query
// tile gets the shares of too few key blocks to repay zeroing and converting the sums: the
// Python side keeps the two kernels there (CAUSAL_TWO_KERNEL_KEYS). Issuing the dQ product
// behind the next tile's S^T and dP^T instead of waiting for it (before the turns) made ptxas
// serialise the wgmmas (C7514), and gained nothing. The figures are in the experiment log
// (benchmarks/LOG.md).

#pragma once

#include "cuda/attention_sm90_common.cuh"

namespace blujax {
namespace {

// The TMA descriptors of q and dout (boxes of a query tile) and k, v (boxes of a key tile).
struct BwdSm90Maps {
  CUtensorMap q, k, v, dout;
};

// ---------------------------------------------------------------------------------------------
// dQ summed by the dK/dV kernel.

// 64 columns of a dQ tile (64 queries x D) = dS K: dS [64][128 keys] as two swizzled 64-key
// halves, kcols the [128 keys][64] half of the K tile that holds the columns.
__device__ __forceinline__ void IssueDsK(float (&acc)[8][4], const bf16* ds, const bf16* kcols) {
  const uint64_t da = Sw128Desc(ds), db = Sw128Desc(kcols, 128 * 64 * sizeof(bf16));
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    const int half = kk / 4, at = (kk % 4) * 16;
    WgmmaTransB(acc, DescPlus(da, (half * 64 * 64 + at) * sizeof(bf16)),
                DescPlus(db, kk * 16 * 64 * sizeof(bf16)), kk > 0);
  }
  WgmmaCommit();
}

// A warp's dS^T operands (its 16 keys x 64 queries, the A operand of dK's product) stored
// transposed, as rows of queries, into a swizzled [64 queries][64 keys] half: stmatrix .trans
// writes each 8 x 8 piece with its rows and columns swapped; lane l gives the row address of
// piece l / 8, whose keys are 8 (l / 8 % 2) and queries 8 (l / 16) past the operand's first.
__device__ __forceinline__ void StoreDsTransposed(bf16* half, const uint32_t (&dst)[4][4],
                                                  int warp, int lane) {
  const int piece = lane / 8, key = warp * 16 + (piece & 1) * 8;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const int query = kk * 16 + (piece >> 1) * 8 + lane % 8;
    asm volatile(
        "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(
            SmemAddr(half + Sw128<64>(query, key))),
        "r"(dst[kk][0]), "r"(dst[kk][1]), "r"(dst[kk][2]), "r"(dst[kk][3])
        : "memory");
  }
}

// dQ tiles (64 x D) are summed in the order the accumulators hold them, not row-major: chunk
// (warp * D / 8 + n) * 8 + lane / 4 of 16 floats holds rows warp * 16 + lane / 4 (+ 8) and
// columns 8 n .. 8 n + 8, each lane's 4 floats one 16-byte store here (a warp writes 512
// contiguous bytes, no bank conflicts) and DqFromSums reading a chunk as two rows' 8 columns.
// This stores columns [64 c, 64 c + 64).
template <int D>
__device__ __forceinline__ void StoreDqChunk(float* tile, const float (&acc)[8][4], int c,
                                             int warp, int lane) {
#pragma unroll
  for (int n = 0; n < 8; ++n)
    *reinterpret_cast<float4*>(tile + ((warp * (D / 8) + 8 * c + n) * 32 + lane) * 4) =
        make_float4(acc[n][0], acc[n][1], acc[n][2], acc[n][3]);
}

// Named barriers of the dQ sums; buf is also the warpgroup that stages into that buffer.
// 2 + buf "tile buf staged" (warpgroup buf arrives, the summing warp waits) and 4 + buf "tile
// buf read out" (the other way round), 160 threads; 6 + buf "both halves of dS buffer buf
// in" (the other warpgroup arrives, warpgroup buf waits), 256. Barrier 1 is the consumers'.
__device__ __forceinline__ void DqTileFull(int buf, bool arrive) {
  NamedBarrier(2 + buf, 128 + 32, arrive);
}
__device__ __forceinline__ void DqTileEmpty(int buf, bool arrive) {
  NamedBarrier(4 + buf, 128 + 32, arrive);
}
__device__ __forceinline__ void DsHalvesIn(int buf, bool arrive) {
  NamedBarrier(6 + buf, 256, arrive);
}

// dq (bfloat16, [B, Tq, H, D], rows g.grad_stride apart) = scale * the summed tiles, one CTA
// of 4 D threads per tile, a thread per chunk (StoreDqChunk has the order). Both sides go
// through shared memory so that every warp reads and writes whole contiguous runs: the tile
// in as it lies, then each thread's chunk out of it, and the bfloat16 tile back in as rows,
// written out 16 bytes a thread along each row. A chunk a thread straight from and to global
// memory (four 16-byte loads 64 bytes apart per warp instruction, and 64-byte pieces of rows)
// measured slower, and each side through shared memory faster (benchmarks/LOG.md).
// Pads keep the shared-memory accesses free of bank conflicts: a float4 after every 8 (a
// quarter warp reads chunks 64 bytes apart), and 16 bytes after every row (it writes 8 rows).
template <int D>
__global__ void __launch_bounds__(4 * D) DqFromSums(const float* __restrict__ dq_sum,
                                                    bf16* __restrict__ dq, Geometry g, int n_qt) {
  constexpr int kThreads = 4 * D, kF4 = 16 * D;  // float4s a tile
  __shared__ float4 staged[kF4 + kF4 / 8];
  auto at = [](int i) { return i + i / 8; };
  const int64_t tile = blockIdx.x, bh = tile / n_qt;
  const int qt = static_cast<int>(tile % n_qt), c = threadIdx.x;
  const float4* src = reinterpret_cast<const float4*>(dq_sum + tile * 64 * D);
#pragma unroll
  for (int t = 0; t < 4; ++t) staged[at(t * kThreads + c)] = src[t * kThreads + c];
  __syncthreads();
  float4 f[4];
#pragma unroll
  for (int t = 0; t < 4; ++t) f[t] = staged[at(4 * c + t)];
  const int gr = c % 8, n = c / 8 % (D / 8), warp = c / D;
  const int r0 = warp * 16 + gr, c0 = n * 8;  // this chunk's rows r0, r0 + 8
  const float s = g.scale;
  __syncthreads();  // every thread has read its chunk: the bfloat16 tile goes where they were
  // [64][D / 8 + 1] uint4: rows padded by 16 bytes, so a quarter warp's 8 rows miss each other
  uint4* rows = reinterpret_cast<uint4*>(staged);
  constexpr int kRowChunks = D / 8, kPitch = kRowChunks + 1;
  rows[r0 * kPitch + c0 / 8] =
      make_uint4(PackBf16(f[0].x * s, f[0].y * s), PackBf16(f[1].x * s, f[1].y * s),
                 PackBf16(f[2].x * s, f[2].y * s), PackBf16(f[3].x * s, f[3].y * s));
  rows[(r0 + 8) * kPitch + c0 / 8] =
      make_uint4(PackBf16(f[0].z * s, f[0].w * s), PackBf16(f[1].z * s, f[1].w * s),
                 PackBf16(f[2].z * s, f[2].w * s), PackBf16(f[3].z * s, f[3].w * s));
  __syncthreads();
  // Whole rows out: consecutive threads write consecutive 16 bytes of a row.
  bf16* head = dq + GradOffset<D>(bh, g.tq, g);
#pragma unroll
  for (int t = 0; t < 2; ++t) {
    const int i = t * kThreads + c, row = i / kRowChunks, col = i % kRowChunks;
    if (qt * 64 + row < g.tq)
      *reinterpret_cast<uint4*>(head + int64_t(qt * 64 + row) * g.grad_stride + col * 8) =
          rows[row * kPitch + col];
  }
}

// ---------------------------------------------------------------------------------------------
// dK and dV: one CTA per 128 keys of one (batch, head), looping over query tiles of kBM.

template <int D, int BM, int kStages, bool kDq = false>
struct BwdKvSm90Cfg {
  static constexpr int kD = D, kBM = BM, kStageCount = kStages;
  static constexpr bool kSumsDq = kDq;
  static constexpr int kWarpgroups = 2, kBN = 64 * kWarpgroups;  // keys per CTA
  static constexpr int kConsumers = 128 * kWarpgroups, kThreads = kConsumers + 128;
  static constexpr int kConsumerRegs = 240, kProducerRegs = 24;
  // With kDq: two buffers of dS [BM][kBN] bfloat16 and two of a dQ tile [BM][D] float32
  // (one a warpgroup).
  static constexpr int kDqBytes = kDq ? 2 * BM * kBN * 2 + 2 * BM * D * 4 : 0;
  // K, V, kStages x (Q, dO, lse, delta), the mbarriers, and room to align to 1024 bytes.
  static constexpr int kSmem = (2 * kBN + 2 * kStages * BM) * D * int(sizeof(bf16)) + kDqBytes +
                               2 * kStages * BM * int(sizeof(float)) + 8 * (1 + 2 * kStages) +
                               1024;
};

// dK and dV take D / 2 accumulator registers each per thread; 64-query tiles leave room for
// S^T, dP^T and their bfloat16 operands beside them at D = 128. 128-query tiles at D = 64,
// three buffers, and issuing the next tile's S^T and dP^T behind this tile's dV and dK products
// each measured the same or slower.
template <int D>
using BwdKvSm90 = BwdKvSm90Cfg<D, 64, 2>;

// The same kernel summing dQ too: see AttentionBwdKvSm90Kernel. At D = 128 its shared memory
// (K, V, two Q and dO buffers, two of dS and two float32 dQ tiles) is 226 of the 227 KB.
template <int D>
using BwdKvDqSm90 = BwdKvSm90Cfg<D, 64, 2, true>;

template <typename C, bool kGqa>
__global__ void __launch_bounds__(C::kThreads, 1)
AttentionBwdKvSm90Kernel(const __grid_constant__ BwdSm90Maps maps, const float* __restrict__ lse,
                         const float* __restrict__ delta, bf16* __restrict__ dk,
                         bf16* __restrict__ dv, float* __restrict__ dq_sum, Geometry g,
                         int n_kt) {
#ifdef BLUJAX_WGMMA
  constexpr int D = C::kD, BM = C::kBM, BN = C::kBN, S = C::kStageCount;
  constexpr int kTileBytes = BM * D * int(sizeof(bf16));
  constexpr bool kDq = C::kSumsDq;
  static_assert(!kDq || BM == 64, "dQ sums: 64-query tiles");
  extern __shared__ uint4 smem_kv_sm90[];
  bf16* sK = Aligned1024(smem_kv_sm90);
  bf16* sV = sK + BN * D;
  bf16* sQ = sV + BN * D;       // [S][BM][D]
  bf16* sdO = sQ + S * BM * D;  // [S][BM][D]
  bf16* sdS = sdO + S * BM * D;  // kDq: [2][BM][BN], dS (not transposed)
  float* sdQ = reinterpret_cast<float*>(sdS + (kDq ? 2 * BM * BN : 0));  // kDq: [2][BM * D]
  float* sL = sdQ + (kDq ? 2 * BM * D : 0);  // [S][BM], lse * log2(e)
  float* sDl = sL + S * BM;                  // [S][BM]
  // kv_full; then per buffer: full (Q, dO, lse and delta arrived), empty.
  uint64_t* bars = reinterpret_cast<uint64_t*>(sDl + S * BM);
  uint64_t *kv_full = bars, *full = bars + 1, *empty = full + S;

  int kt;
  int64_t bh;
  BlockCoords(n_kt, false, &kt, &bh);  // causal: key tile 0 has the most work, so it goes first
  // bh is (batch, key/value head) and h the key/value head (kGqa: one of KV, else of H).
  const int k0 = kt * BN, b = static_cast<int>(bh / KvHeads<kGqa>(g));
  const int h = static_cast<int>(bh % KvHeads<kGqa>(g));
  const int n_qt = (g.tq + BM - 1) / BM;
  const int first = g.causal ? k0 / BM : 0;  // earlier queries see none of these keys
  const QuerySteps steps(bh, first, n_qt, g);
  const int last = kGqa ? steps.Last() : n_qt;  // n_qt - first query tiles per query head
  constexpr int kConsumerWarps = C::kConsumers / 32;
  if (threadIdx.x == 0) {
    MbarInit(kv_full, 1);
    for (int i = 0; i < S; ++i) {
      MbarInit(full + i, 1 + 32);  // the copying thread and the 32 lanes writing the statistics
      MbarInit(empty + i, kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  const int wg = __shfl_sync(kFull, threadIdx.x / 128, 0);
  const int warp = threadIdx.x % 128 / 32, lane = threadIdx.x % 32;
  if (wg == C::kWarpgroups) {
    SetMaxRegs<C::kProducerRegs>();
    // Query step i (tile i, multi-head) goes to buffer (i - first) % S once step i - S has
    // left it.
    if (warp == 0 && lane == 0) {
      MbarExpectBytes(kv_full, 2 * BN * D * int(sizeof(bf16)));
      TmaTile<D>(sK, BN, &maps.k, h, k0, b, kv_full);
      TmaTile<D>(sV, BN, &maps.v, h, k0, b, kv_full);
      for (int i = first; i < last; ++i) {
        const int buf = (i - first) % S, use = (i - first) / S;
        const int hq = kGqa ? h * g.group + steps.Member(i) : h;  // the tile's query head
        const int q0 = (kGqa ? steps.Tile(i) : i) * BM;
        if (use > 0) MbarWait(empty + buf, (use - 1) & 1);
        MbarExpectBytes(full + buf, 2 * kTileBytes);
        TmaTile<D>(sQ + buf * BM * D, BM, &maps.q, hq, q0, b, full + buf);
        TmaTile<D>(sdO + buf * BM * D, BM, &maps.dout, hq, q0, b, full + buf);
      }
    } else if (warp == 1) {
      // Queries past Tq get lse = +inf, so their P and dS are exactly 0.
      const float* lh = lse + (kGqa ? steps.Head(first) : bh) * g.tq;
      const float* dlh = delta + (kGqa ? steps.Head(first) : bh) * g.tq;
      for (int i = first; i < last; ++i) {
        const int buf = (i - first) % S, use = (i - first) / S;
        if constexpr (kGqa) {
          lh = lse + steps.Head(i) * g.tq;
          dlh = delta + steps.Head(i) * g.tq;
        }
        if (use > 0) MbarWait(empty + buf, (use - 1) & 1);
        for (int r = lane; r < BM; r += 32) {
          const int query = (kGqa ? steps.Tile(i) : i) * BM + r;
          const bool valid = query < g.tq;
          sL[buf * BM + r] = valid ? lh[query] * kLog2e : INFINITY;
          sDl[buf * BM + r] = valid ? dlh[query] : 0.f;
        }
        MbarArrive(full + buf, true);
      }
    } else if (kDq && warp == 2) {
      // The dQ tiles the consumers stage, each added into dq_sum by one bulk reduction, so
      // the consumers never wait on the sums (DqTileFull and DqTileEmpty are the barriers).
      float* dq_bh = dq_sum + (kGqa ? steps.Head(first) : bh) * n_qt * BM * D;
      for (int i = first; i < last; ++i) {
        const int t = i - first, buf = t % 2;
        if constexpr (kGqa) dq_bh = dq_sum + steps.Head(i) * n_qt * BM * D;
        DqTileFull(buf, false);
        if (lane == 0) {
          BulkReduceAdd(dq_bh + int64_t(kGqa ? steps.Tile(i) : i) * BM * D, sdQ + buf * BM * D,
                        BM * D * 4);
          BulkWaitRead();
        }
        __syncwarp();
        if (i + 2 < last) DqTileEmpty(buf, true);
      }
      if (lane == 0) BulkWaitAll();
    }
    return;
  }
  SetMaxRegs<C::kConsumerRegs>();

  const int gr = lane / 4, t4 = lane % 4;
  const int key_a = k0 + wg * 64 + warp * 16 + gr;  // the key of accumulator entries 0, 1 (+8)
  const bf16* sKw = sK + wg * 64 * 64;  // this warpgroup's 64 keys in each 64-column half
  const bf16* sVw = sV + wg * 64 * 64;
  auto release = [&](uint64_t* bar) { MbarArrive(bar, lane == 0); };

  float dk_acc[D / 8][4] = {}, dv_acc[D / 8][4] = {};
  float st[BM / 8][4], dpt[BM / 8][4];
  uint32_t pt[BM / 16][4], dst[BM / 16][4];
  // Causal: query tiles before this warpgroup's first key see none of its keys. It lets them
  // pass, waiting for each so that its arrival counts for that tile.
  // (With dQ sums both warpgroups run every tile: they meet at a barrier per tile.)
  const int mine = g.causal && !kDq ? min((k0 + wg * 64) / BM, n_qt) : first;
  // Grouped-query attention: the same for each of the group's query heads in turn, its steps
  // (QuerySteps) numbered on from the steps of the heads before it.
  for (int j = 0; j < (kGqa ? g.group : 1); ++j) {
    const int base = j * (n_qt - first) - first;  // step i is base + i (multi-head: i - first)
    for (int i = first; i < mine; ++i) {
      const int step = kGqa ? base + i : i - first;
      const int buf = step % S;
      MbarWait(full + buf, (step / S) & 1);
      release(empty + buf);
    }
    if (j == 0) MbarWait(kv_full, 0);
    for (int i = mine; i < n_qt; ++i) {
      const int step = kGqa ? base + i : i - first;
      const int buf = step % S, q0 = i * BM;
      const bf16* cQ = sQ + buf * BM * D;
      const bf16* cdO = sdO + buf * BM * D;
      const float* cL = sL + buf * BM;
      const float* cDl = sDl + buf * BM;
      MbarWait(full + buf, (step / S) & 1);
      WgmmaFence();
      IssueRowsByRows<BM, D, BN>(st, sKw, cQ);    // S^T = K Q^T
      IssueRowsByRows<BM, D, BN>(dpt, sVw, cdO);  // dP^T = V dO^T
      WgmmaWait<1>();
      FenceRegs(st);
      // P^T = exp(scale S^T - lse of each column's query); above the diagonal 0.
      const bool mask = g.causal && k0 + wg * 64 + 63 > q0;  // uniform in the warpgroup
#pragma unroll
      for (int n = 0; n < BM / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = n * 8 + 2 * t4 + (e & 1);
          float p = exp2f(fmaf(st[n][e], g.scale_log2, -cL[col]));
          if (mask && key_a + (e >> 1) * 8 > q0 + col) p = 0.f;
          st[n][e] = p;
        }
      }
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) AccToOperand(pt[kk], st, kk);
      WgmmaFence();
      IssueAccumulate<BM, D>(dv_acc, pt, cdO);  // dV += P^T dO
      WgmmaWait<1>();
      FenceRegs(dpt);
      // dS^T = P^T (dP^T - delta), while dV's product runs.
#pragma unroll
      for (int n = 0; n < BM / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e)
          dpt[n][e] = st[n][e] * (dpt[n][e] - cDl[n * 8 + 2 * t4 + (e & 1)]);
      }
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) AccToOperand(dst[kk], dpt, kk);
      WgmmaFence();
      IssueAccumulate<BM, D>(dk_acc, dst, cQ);  // dK += dS^T Q (scaled at the end)
      if constexpr (kDq) {
        // dS (queries x keys) into shared memory, this warpgroup's 64 keys as one swizzled
        // 64-column half. Tile t's owner (t % 2) waits for the other half, computes dQ's tile
        // share, dS K over the CTA's 128 keys, 64 columns at a time in S^T's registers, and
        // stages it in its buffer; the other goes on (its dS buffer is next written in tile
        // t + 2, after it has waited as owner of t + 1 for the owner of t to be done).
        const int t = kGqa ? base + i : i - mine, dbuf = t % 2;  // (mine == first here)
        bf16* cdS = sdS + dbuf * BM * BN;
        StoreDsTransposed(cdS + wg * BM * 64, dst, warp, lane);
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        if (wg == dbuf) {
          DsHalvesIn(dbuf, false);
#pragma unroll
          for (int c = 0; c < D / 64; ++c) {
            WgmmaFence();
            IssueDsK(st, cdS, sK + c * BN * 64);
            WgmmaWait<0>();
            FenceRegs(st);
            if (c == 0 && t >= 2) DqTileEmpty(dbuf, false);
            StoreDqChunk<D>(sdQ + dbuf * BM * D, st, c, warp, lane);
          }
          asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
          DqTileFull(dbuf, true);
        } else {
          DsHalvesIn(dbuf, true);
          WgmmaWait<0>();
        }
      } else {
        WgmmaWait<0>();
      }
      FenceRegs(dv_acc);
      FenceRegs(dk_acc);
      FenceRegs(pt);
      FenceRegs(dst);
      release(empty + buf);
    }
  }
  // The owner of the last tile's dQ product may still read sK, which is staged into below.
  if constexpr (kDq) NamedBarrier(1, C::kConsumers, false);

  // Stage in this warp's own rows of sK / sV (only its warpgroup's finished MMAs read them),
  // and write whole 16-byte chunks.
  const int wrow = wg * 64 + warp * 16;
  const float scale[2] = {g.scale, g.scale}, one[2] = {1.f, 1.f};
  StageRows<BN, D>(sK, dk_acc, wrow, scale, lane);
  StageRows<BN, D>(sV, dv_acc, wrow, one, lane);
  __syncwarp();
  const int64_t grad_off = KvGradOffset<D, kGqa>(bh, g);
  const int64_t grad_stride = KvGradStride<D, kGqa>(g);
  StoreRows<BN, D>(dk + grad_off, sK, wrow, k0, g.tk, grad_stride, lane);
  StoreRows<BN, D>(dv + grad_off, sV, wrow, k0, g.tk, grad_stride, lane);
#endif  // BLUJAX_WGMMA
}

// ---------------------------------------------------------------------------------------------
// dQ: one CTA per 64 * kWarpgroups query rows of one (batch, head), looping over key tiles.

template <int D, int WG, int BN, int kStages>
struct BwdQSm90Cfg {
  static constexpr int kD = D, kWarpgroups = WG, kBN = BN, kBM = 64 * WG, kStageCount = kStages;
  static constexpr int kConsumers = 128 * WG, kThreads = kConsumers + 128;
  static constexpr int kConsumerRegs = WG == 2 ? 240 : 160, kProducerRegs = WG == 2 ? 24 : 32;
  // Q, dO, kStages x (K, V), the mbarriers, and room to align to 1024 bytes.
  static constexpr int kSmem = (2 * kBM + 2 * kStages * BN) * D * int(sizeof(bf16)) +
                               8 * KvStream<kStages>::kBarriers + 1024;
};

// Three K/V buffers: the next tile's copy has a tile more to arrive than with two (measured
// faster; four gain nothing more, nor do 128-key tiles or three warpgroups).
template <int D>
using BwdQSm90 = BwdQSm90Cfg<D, 2, 64, 3>;

template <typename C, bool kGqa>
__global__ void __launch_bounds__(C::kThreads, 1)
AttentionBwdQSm90Kernel(const __grid_constant__ BwdSm90Maps maps, const float* __restrict__ lse,
                        const float* __restrict__ delta, bf16* __restrict__ dq, Geometry g,
                        int n_qt) {
#ifdef BLUJAX_WGMMA
  constexpr int D = C::kD, BM = C::kBM, BN = C::kBN, S = C::kStageCount;
  extern __shared__ uint4 smem_q_sm90[];
  bf16* sQ = Aligned1024(smem_q_sm90);
  bf16* sdO = sQ + BM * D;
  bf16* sK = sdO + BM * D;     // [S][BN][D]
  bf16* sV = sK + S * BN * D;  // [S][BN][D]
  const KvStream<S> pipe(reinterpret_cast<uint64_t*>(sV + S * BN * D));

  int qt;
  int64_t bh;
  BlockCoords(n_qt, g.causal, &qt, &bh);
  const int q0 = qt * BM, n_kt = KeyTiles(g, q0, BM, BN);
  const int b = static_cast<int>(bh / g.heads), h = static_cast<int>(bh % g.heads);
  constexpr int kConsumerWarps = C::kConsumers / 32;
  if (threadIdx.x == 0) pipe.Init(kConsumerWarps);
  __syncthreads();

  const int wg = __shfl_sync(kFull, threadIdx.x / 128, 0);
  if (wg == C::kWarpgroups) {
    // The producer: Q and dO, then K_j and V_j into buffer j % S.
    SetMaxRegs<C::kProducerRegs>();
    if (threadIdx.x == C::kConsumers) {
      MbarExpectBytes(pipe.q_full, 2 * BM * D * int(sizeof(bf16)));
      TmaTile<D>(sQ, BM, &maps.q, h, q0, b, pipe.q_full);
      TmaTile<D>(sdO, BM, &maps.dout, h, q0, b, pipe.q_full);
      pipe.template Stream<D, BN>(sK, sV, &maps.k, &maps.v, kGqa ? h / g.group : h, b, n_kt);
    }
    return;
  }
  SetMaxRegs<C::kConsumerRegs>();

  const int warp = threadIdx.x % 128 / 32, lane = threadIdx.x % 32;
  const int gr = lane / 4, t4 = lane % 4;
  const int wrow = wg * 64 + warp * 16;  // this warp's first row in the block
  const bf16* sQw = sQ + wg * 64 * 64;   // this warpgroup's 64 rows in each 64-column half
  const bf16* sdOw = sdO + wg * 64 * 64;
  auto release = [&](uint64_t* bar) { MbarArrive(bar, lane == 0); };

  // Per-row statistics of rows wrow + gr (+ 8); rows past Tq are never stored.
  float lse2[2], dl[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = q0 + wrow + gr + 8 * r;
    lse2[r] = row < g.tq ? lse[bh * g.tq + row] * kLog2e : 0.f;
    dl[r] = row < g.tq ? delta[bh * g.tq + row] : 0.f;
  }

  float dq_acc[D / 8][4] = {};
  float s[BN / 8][4], dp[BN / 8][4];
  uint32_t ds[BN / 16][4];
  // Causal: key tiles after this warpgroup's last row add nothing to its dQ (the block's later
  // rows need them); it stops before them.
  const int n_mine = g.causal ? KeyTiles(g, q0 + wg * 64, 64, BN) : n_kt;
  const Turns<C::kWarpgroups> turns(wg, n_kt);
  MbarWait(pipe.q_full, 0);
  for (int j = 0; j < n_mine; ++j) {
    const int buf = j % S, prev = (j + S - 1) % S, phase = (j / S) & 1;
    MbarWait(pipe.k_full + buf, phase);
    MbarWait(pipe.v_full + buf, phase);
    turns.Take();
    WgmmaFence();
    IssueRowsByRows<BN, D, BM>(s, sQw, sK + buf * BN * D);    // S = Q K_j^T
    IssueRowsByRows<BN, D, BM>(dp, sdOw, sV + buf * BN * D);  // dP = dO V_j^T
    if (j > 0) {
      IssueAccumulate<BN, D>(dq_acc, ds, sK + prev * BN * D);  // dQ += dS_{j-1} K_{j-1}
      turns.Pass(j);
      WgmmaWait<1>();
    } else {
      turns.Pass(j);
      WgmmaWait<0>();
    }
    release(pipe.v_empty + buf);
    FenceRegs(s);
    FenceRegs(dp);
    // dS = P (dP - delta), P = exp(scale S - lse); past Tk or above the diagonal 0.
    const int k0 = j * BN;
    const bool mask = k0 + BN > g.tk || (g.causal && k0 + BN - 1 > q0 + wrow);
#pragma unroll
    for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = k0 + n * 8 + 2 * t4 + (e & 1), r = e >> 1;
        const int row = q0 + wrow + gr + 8 * r;
        float p = exp2f(fmaf(s[n][e], g.scale_log2, -lse2[r]));
        if (mask && (key >= g.tk || (g.causal && key > row))) p = 0.f;
        s[n][e] = p * (dp[n][e] - dl[r]);
      }
    }
    WgmmaWait<0>();
    FenceRegs(dq_acc);
    FenceRegs(ds);
    if (j > 0) release(pipe.k_empty + prev);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) AccToOperand(ds[kk], s, kk);
  }
  WgmmaFence();
  IssueAccumulate<BN, D>(dq_acc, ds, sK + (n_mine - 1) % S * BN * D);
  WgmmaWait<0>();
  FenceRegs(dq_acc);
  // Release the tiles it skipped, each once it has arrived (so the arrival counts for it).
  release(pipe.k_empty + (n_mine - 1) % S);
  for (int j = n_mine; j < n_kt; ++j) {
    const int buf = j % S, phase = (j / S) & 1;
    turns.Take();
    turns.Pass(j);
    MbarWait(pipe.k_full + buf, phase);
    MbarWait(pipe.v_full + buf, phase);
    release(pipe.k_empty + buf);
    release(pipe.v_empty + buf);
  }

  // Stage this warp's rows in its own rows of sQ (only its warpgroup's finished MMAs read
  // them) and write whole 16-byte chunks.
  const float scale[2] = {g.scale, g.scale};
  StageRows<BM, D>(sQ, dq_acc, wrow, scale, lane);
  __syncwarp();
  StoreRows<BM, D>(dq + GradOffset<D>(bh, g.tq, g), sQ, wrow, q0, g.tq, g.grad_stride, lane);
#endif  // BLUJAX_WGMMA
}

}  // namespace
}  // namespace blujax
