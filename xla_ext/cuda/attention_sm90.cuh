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
//
// Shared-memory tiles use the hardware's 128-byte swizzle, which TMA writes and wgmma reads:
// rows of 64 elements (128 bytes) with 16-byte chunk c of row r stored at chunk c ^ (r % 8), in
// 1024-byte atoms of 8 rows; a tile of D = 128 is two such 64-column halves one after the other.

#pragma once

#include <cuda.h>  // CUtensorMap

#include <type_traits>

#include "cuda/attention_common.cuh"

// wgmma exists only in code compiled for sm_90a; other targets compile an empty kernel that
// the launcher never runs (it checks the binary it would launch: Sm90Runs in attention.cu).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define BLUJAX_WGMMA 1
#endif

namespace blujax {
namespace {

// ---------------------------------------------------------------------------------------------
// PTX wrappers for warpgroup MMAs.

// Descriptor of a 128-byte-swizzled shared-memory operand at p (1024-byte aligned atoms).
// sbo: bytes between 8-row atoms; lbo: bytes between 64-column halves of a transposed
// (MN-major) operand, unused for K-major ones.
__device__ __forceinline__ uint64_t Sw128Desc(const void* p, uint32_t lbo = 16) {
  constexpr uint32_t kSbo = 1024;
  return uint64_t((SmemAddr(p) & 0x3FFFF) >> 4) | uint64_t((lbo >> 4) & 0x3FFF) << 16 |
         uint64_t(kSbo >> 4) << 32 | uint64_t(1) << 62;
}

__device__ __forceinline__ void WgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

template <int kPending>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving accesses of registers that an asynchronous wgmma reads or
// writes (accumulators, A fragments) across the wait or fence before this.
template <typename T, int kN>
__device__ __forceinline__ void FenceRegs(T (&d)[kN][4]) {
#pragma unroll
  for (int n = 0; n < kN; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if constexpr (std::is_same_v<T, float>) {
        asm volatile("" : "+f"(d[n][e])::"memory");
      } else {
        asm volatile("" : "+r"(d[n][e])::"memory");
      }
    }
  }
}

#define BLUJAX_D4(n) "+f"(d[n][0]), "+f"(d[n][1]), "+f"(d[n][2]), "+f"(d[n][3])
#define BLUJAX_D16(n) BLUJAX_D4(n), BLUJAX_D4(n + 1), BLUJAX_D4(n + 2), BLUJAX_D4(n + 3)
#define BLUJAX_REGS32                                                     \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29," \
  "%30, %31"
#define BLUJAX_REGS64                                                     \
  BLUJAX_REGS32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42," \
  "%43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, " \
  "%57, %58, %59, %60, %61, %62, %63"

// d (64 x N, the accumulators as N/8 mma-style [4] tiles per thread) (+)= A B for one k-step of
// 16. SS: A and B are K-major shared-memory tiles. RS: A is registers (the mma.sync A layout,
// per warp 16 rows), B a transposed (MN-major) shared-memory tile. accumulate = 0 overwrites.
template <int N>
struct Wgmma;

template <>
struct Wgmma<64> {
  static __device__ __forceinline__ void SS(float (&d)[8][4], uint64_t a, uint64_t b,
                                            int accumulate) {
#ifdef BLUJAX_WGMMA
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" BLUJAX_REGS32 "}, %32, %33, "
        "p, 1, 1, 0, 0;\n}\n"
        : BLUJAX_D16(0), BLUJAX_D16(4)
        : "l"(a), "l"(b), "r"(accumulate));
#endif
  }
  static __device__ __forceinline__ void RS(float (&d)[8][4], const uint32_t (&a)[4], uint64_t b,
                                            int accumulate) {
#ifdef BLUJAX_WGMMA
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" BLUJAX_REGS32 "}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
        : BLUJAX_D16(0), BLUJAX_D16(4)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
#endif
  }
};

template <>
struct Wgmma<128> {
  static __device__ __forceinline__ void SS(float (&d)[16][4], uint64_t a, uint64_t b,
                                            int accumulate) {
#ifdef BLUJAX_WGMMA
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" BLUJAX_REGS64 "}, %64, %65, "
        "p, 1, 1, 0, 0;\n}\n"
        : BLUJAX_D16(0), BLUJAX_D16(4), BLUJAX_D16(8), BLUJAX_D16(12)
        : "l"(a), "l"(b), "r"(accumulate));
#endif
  }
  static __device__ __forceinline__ void RS(float (&d)[16][4], const uint32_t (&a)[4],
                                            uint64_t b, int accumulate) {
#ifdef BLUJAX_WGMMA
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" BLUJAX_REGS64 "}, "
        "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : BLUJAX_D16(0), BLUJAX_D16(4), BLUJAX_D16(8), BLUJAX_D16(12)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
#endif
  }
};

#undef BLUJAX_D4
#undef BLUJAX_D16
#undef BLUJAX_REGS32
#undef BLUJAX_REGS64

// ---------------------------------------------------------------------------------------------
// 128-byte-swizzled tiles.

// Element offset of (row, col) in a tile of kRows rows: 64-column halves one after the other.
template <int kRows>
__device__ __forceinline__ int Sw128(int row, int col) {
  return (col / 64) * kRows * 64 + row * 64 + ((((col % 64) / 8) ^ (row & 7)) * 8) + col % 8;
}

// ---------------------------------------------------------------------------------------------
// mbarriers and TMA.

__device__ __forceinline__ void MbarInit(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(SmemAddr(bar)), "r"(count)
               : "memory");
}

// The producer's arrival: the phase completes when `bytes` more have arrived by TMA.
__device__ __forceinline__ void MbarExpectBytes(uint64_t* bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(SmemAddr(bar)),
               "r"(bytes)
               : "memory");
}

// One arrival, from the threads for which `signal` holds: predicated inside the asm so that the
// code around a warpgroup MMA stays free of divergent branches (ptxas serialises wgmma after
// those).
__device__ __forceinline__ void MbarArrive(uint64_t* bar, bool signal) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %1, 0;\n@p mbarrier.arrive.shared::cta.b64 _, [%0];\n}\n"
      ::"r"(SmemAddr(bar)), "r"(int(signal))
      : "memory");
}

// Waits until the phase with this parity (0 for the 1st, 3rd, ... completion) has completed;
// the loop is inside the asm, for the same reason (its labels are local to the { } scope).
__device__ __forceinline__ void MbarWait(uint64_t* bar, int parity) {
  asm volatile(
      "{\n.reg .pred p;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT;\n}\n" ::"r"(SmemAddr(bar)),
      "r"(parity)
      : "memory");
}

// Registers per thread of the warpgroup that runs this, from here on (setmaxnreg): the producer
// gives up what the consumers take.
template <int kRegs>
__device__ __forceinline__ void SetMaxRegs() {
  if constexpr (kRegs > 128) {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
  } else {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
  }
}

// Box {64 columns, 1 head, rows, 1 batch} of a [B, T, H, D] tensor at (col, h, t, b) -> smem
// (128-byte swizzled; rows past T arrive as zeros), completing `bytes` on bar.
__device__ __forceinline__ void TmaLoad(void* dst, const CUtensorMap* map, int col, int h, int t,
                                        int b, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
      "[%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(SmemAddr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(h), "r"(t), "r"(b), "r"(SmemAddr(bar))
      : "memory");
}

// A tile of `rows` rows x D at row t0 of (b, h): one box per 64-column half.
template <int D>
__device__ __forceinline__ void TmaTile(bf16* dst, int rows, const CUtensorMap* map, int h,
                                        int t0, int b, uint64_t* bar) {
#pragma unroll
  for (int half = 0; half < D / 64; ++half)
    TmaLoad(dst + half * rows * 64, map, half * 64, h, t0, b, bar);
}

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
// only. 64-key tiles ran 6-14% slower.
template <int D>
using FwdSm90 = FwdSm90Cfg<D, D == 64 ? 3 : 2, 128>;

// The TMA descriptors of q (boxes of kBM rows) and k, v (kBN rows), made on the host per call.
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
                       float* __restrict__ lse, Geometry g, int n_qt) {
#ifdef BLUJAX_WGMMA
  constexpr int D = C::kD, BM = C::kBM, BN = C::kBN;
  constexpr int kTileBytes = BN * D * int(sizeof(bf16));
  extern __shared__ uint4 smem_fwd_sm90[];
  // The swizzle is a function of address bits 7-9: tiles start on 1024-byte boundaries.
  char* base = reinterpret_cast<char*>(smem_fwd_sm90);
  base += (1024 - (SmemAddr(base) & 1023)) & 1023;
  bf16* sQ = reinterpret_cast<bf16*>(base);
  bf16* sK = sQ + BM * D;      // [2][BN][D]
  bf16* sV = sK + 2 * BN * D;  // [2][BN][D]
  // q_full; then per buffer b: k_full[b], k_empty[b], v_full[b], v_empty[b].
  uint64_t* bars = reinterpret_cast<uint64_t*>(sV + 2 * BN * D);
  uint64_t *q_full = bars, *k_full = bars + 1, *k_empty = bars + 3, *v_full = bars + 5,
           *v_empty = bars + 7;

  int qt;
  int64_t bh;
  BlockCoords(n_qt, g.causal, &qt, &bh);
  const int q0 = qt * BM, n_kt = KeyTiles(g, q0, BM, BN);
  const int b = static_cast<int>(bh / g.heads), h = static_cast<int>(bh % g.heads);
  constexpr int kConsumerWarps = C::kConsumers / 32;
  if (threadIdx.x == 0) {
    MbarInit(q_full, 1);
    for (int i = 0; i < 2; ++i) {
      MbarInit(k_full + i, 1);
      MbarInit(v_full + i, 1);
      MbarInit(k_empty + i, kConsumerWarps);
      MbarInit(v_empty + i, kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  // Roles by warpgroup, read through a shuffle so the compiler knows they are warp-uniform.
  const int wg = __shfl_sync(kFull, threadIdx.x / 128, 0);
  if (wg == C::kWarpgroups) {
    // The producer: K_j and V_j into buffer j % 2, once the tile two back has left it.
    SetMaxRegs<C::kProducerRegs>();
    if (threadIdx.x == C::kConsumers) {
      MbarExpectBytes(q_full, BM * D * int(sizeof(bf16)));
      TmaTile<D>(sQ, BM, &maps.q, h, q0, b, q_full);
      for (int j = 0; j < n_kt; ++j) {
        const int buf = j & 1, use = j >> 1;
        if (use > 0) MbarWait(k_empty + buf, (use - 1) & 1);
        MbarExpectBytes(k_full + buf, kTileBytes);
        TmaTile<D>(sK + buf * BN * D, BN, &maps.k, h, j * BN, b, k_full + buf);
        if (use > 0) MbarWait(v_empty + buf, (use - 1) & 1);
        MbarExpectBytes(v_full + buf, kTileBytes);
        TmaTile<D>(sV + buf * BN * D, BN, &maps.v, h, j * BN, b, v_full + buf);
      }
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

  // S = Q K^T over D in k-steps of 16: 32 bytes along a swizzled row, then the next half.
  auto issue_scores = [&](float (&s)[BN / 8][4], const bf16* cK) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const int half = kk / 4, at = (kk % 4) * 16;
      Wgmma<BN>::SS(s, Sw128Desc(sQw + half * BM * 64 + at),
                    Sw128Desc(cK + half * BN * 64 + at), kk > 0);
    }
    WgmmaCommit();
  };
  // O += P V over a tile's keys in k-steps of 16 swizzled rows of V.
  auto issue_pv = [&](float (&o)[D / 8][4], const uint32_t (&p)[BN / 16][4], const bf16* cV) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      Wgmma<D>::RS(o, p[kk], Sw128Desc(cV + kk * 16 * 64, BN * 64 * sizeof(bf16)), 1);
    WgmmaCommit();
  };

  float o[D / 8][4] = {};
  float s[BN / 8][4];
  uint32_t p[BN / 16][4];
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // running max (log2), partial sum
  MbarWait(q_full, 0);
  for (int j = 0; j < n_kt; ++j) {
    const int buf = j & 1, prev = (j - 1) & 1;
    MbarWait(k_full + buf, (j >> 1) & 1);
    WgmmaFence();
    issue_scores(s, sK + buf * BN * D);
    if (j > 0) {
      MbarWait(v_full + prev, ((j - 1) >> 1) & 1);
      issue_pv(o, p, sV + prev * BN * D);
      WgmmaWait<1>();
    } else {
      WgmmaWait<0>();
    }
    release(k_empty + buf);
    FenceRegs(s);
    float alpha[2];
    SoftmaxStep<BN>(s, m, l, alpha, g, j * BN, q0 + wrow, gr, t4);
    WgmmaWait<0>();
    FenceRegs(o);
    FenceRegs(p);
    if (j > 0) release(v_empty + prev);
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
  const int last = (n_kt - 1) & 1;
  MbarWait(v_full + last, ((n_kt - 1) >> 1) & 1);
  WgmmaFence();
  issue_pv(o, p, sV + last * BN * D);
  WgmmaWait<0>();
  FenceRegs(o);

  // Normalise, stage this warp's rows in its own rows of sQ (only its warpgroup read them,
  // and its MMAs are done), and write whole 16-byte chunks.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = l[r];
    sum += __shfl_xor_sync(kFull, sum, 1);
    sum += __shfl_xor_sync(kFull, sum, 2);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    const int row = wrow + gr + 8 * r;
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn)
      *reinterpret_cast<uint32_t*>(sQ + Sw128<BM>(row, dn * 8 + 2 * t4)) =
          PackBf16(o[dn][2 * r] * inv, o[dn][2 * r + 1] * inv);
    if (t4 == 0 && q0 + row < g.tq) lse[bh * g.tq + q0 + row] = (m[r] + log2f(sum)) * kLn2;
  }
  __syncwarp();
  const int64_t stride = int64_t(g.heads) * D;
  bf16* oh = out + HeadOffset<D>(bh, g.tq, g.heads);
  constexpr int KC = D / 8;
#pragma unroll
  for (int i = 0; i < 16 * KC / 32; ++i) {
    const int c = lane + 32 * i, row = wrow + c / KC, col = (c % KC) * 8;
    if (q0 + row < g.tq)
      *reinterpret_cast<uint4*>(oh + int64_t(q0 + row) * stride + col) =
          *reinterpret_cast<const uint4*>(sQ + Sw128<BM>(row, col));
  }
#endif  // BLUJAX_WGMMA
}

}  // namespace
}  // namespace blujax
