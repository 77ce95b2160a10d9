// PTX wrappers for Hopper (sm_90a): warpgroup MMAs (wgmma) and the forms of product built on
// them, the 128-byte-swizzled shared-memory tiles they read, mbarriers, TMA copies and bulk
// reductions, named barriers and setmaxnreg; and, on the host, whether a kernel's sm_90a code
// runs on a device and the driver's TMA descriptor encoder. Used by the attention kernels
// (cuda/attention_sm90_*.cuh); the sm_80 instructions they also use are in common/sm80.cuh.
//
// Shared-memory tiles use the hardware's 128-byte swizzle, which TMA writes and wgmma reads:
// rows of 64 elements (128 bytes) with 16-byte chunk c of row r stored at chunk c ^ (r % 8), in
// 1024-byte atoms of 8 rows; a tile of D = 128 is two such 64-column halves one after the other.
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include "common/cuda_launch.cuh"
#include "common/sm80.cuh"

// wgmma exists only in code compiled for sm_90a; other targets compile an empty kernel that
// the launcher never runs (it checks the binary it would launch: Sm90Runs below).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define BLUJAX_WGMMA 1
#endif

namespace blujax {

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

// The descriptor of the operand `bytes` (a multiple of 16) past desc's. The start address is
// the low 14-bit field, in 16-byte units; shared memory's 256 KB fit it, so the sum does not
// carry into the other fields, and one 32-bit add replaces recomputing the descriptor (whose
// mask and shifts the compiler cannot fold: some 5 uniform instructions a product).
__device__ __forceinline__ uint64_t DescPlus(uint64_t desc, uint32_t bytes) {
  const uint32_t lo = static_cast<uint32_t>(desc) + (bytes >> 4);
  return (desc & 0xFFFFFFFF00000000ull) | lo;
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

// d (64 x 64) (+)= A B for one k-step of 16, as Wgmma<64>::SS but with B a transposed
// (MN-major) shared-memory tile (the attention backward's dQ = dS K: B is K's rows of keys).
__device__ __forceinline__ void WgmmaTransB(float (&d)[8][4], uint64_t a, uint64_t b,
                                            int accumulate) {
#ifdef BLUJAX_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, "
      "%7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 1;\n}\n"
      : BLUJAX_D4(0), BLUJAX_D4(1), BLUJAX_D4(2), BLUJAX_D4(3), BLUJAX_D4(4), BLUJAX_D4(5),
        BLUJAX_D4(6), BLUJAX_D4(7)
      : "l"(a), "l"(b), "r"(accumulate));
#endif
}

#undef BLUJAX_D4
#undef BLUJAX_D16
#undef BLUJAX_REGS32
#undef BLUJAX_REGS64

// Products of a warpgroup, issued and committed as one group. acc (64 x N) = A B^T over D: A
// the 64 rows at `a` of a K-major tile of kARows rows, B a K-major tile of N rows (attention's
// S = Q K^T, S^T = K Q^T, dP = dO V^T, dP^T = V dO^T).
template <int N, int D, int kARows>
__device__ __forceinline__ void IssueRowsByRows(float (&acc)[N / 8][4], const bf16* a,
                                                const bf16* b) {
  const uint64_t da = Sw128Desc(a), db = Sw128Desc(b);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {  // 32 bytes along a swizzled row, then the next half
    const int half = kk / 4, at = (kk % 4) * 16;
    Wgmma<N>::SS(acc, DescPlus(da, (half * kARows * 64 + at) * sizeof(bf16)),
                 DescPlus(db, (half * N * 64 + at) * sizeof(bf16)), kk > 0);
  }
  WgmmaCommit();
}

// acc (64 x D) += A B over K: A in registers (K / 16 operands, an accumulator converted by
// AccToOperand), B a tile of K rows x D read transposed (attention's O += P V, dV += P^T dO,
// dK += dS^T Q, dQ += dS K).
template <int K, int D>
__device__ __forceinline__ void IssueAccumulate(float (&acc)[D / 8][4],
                                                const uint32_t (&a)[K / 16][4], const bf16* b) {
  const uint64_t db = Sw128Desc(b, K * 64 * sizeof(bf16));  // LBO: bytes between B's halves
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk)  // 16 rows of B a step
    Wgmma<D>::RS(acc, a[kk], DescPlus(db, kk * 16 * 64 * sizeof(bf16)), 1);
  WgmmaCommit();
}

// ---------------------------------------------------------------------------------------------
// 128-byte-swizzled tiles.

// Element offset of (row, col) in a tile of kRows rows: 64-column halves one after the other.
template <int kRows>
__device__ __forceinline__ int Sw128(int row, int col) {
  return (col / 64) * kRows * 64 + row * 64 + ((((col % 64) / 8) ^ (row & 7)) * 8) + col % 8;
}

// The first 1024-byte boundary in dynamic shared memory (kernels ask for 1024 bytes more than
// their tiles): the swizzle is a function of address bits 7-9, so tiles start on one.
__device__ __forceinline__ bf16* Aligned1024(void* smem) {
  char* p = static_cast<char*>(smem);
  return reinterpret_cast<bf16*>(p + ((1024 - (SmemAddr(p) & 1023)) & 1023));
}

// A warp's accumulator rows wrow + gr and wrow + gr + 8 (gr = lane / 4) of acc (64 x D),
// times scale[0] and scale[1], as bfloat16 into rows of a tile of kRows rows.
template <int kRows, int D>
__device__ __forceinline__ void StageRows(bf16* tile, const float (&acc)[D / 8][4], int wrow,
                                          const float (&scale)[2], int lane) {
  const int gr = lane / 4, t4 = lane % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn)
      *reinterpret_cast<uint32_t*>(tile + Sw128<kRows>(wrow + gr + 8 * r, dn * 8 + 2 * t4)) =
          PackBf16(acc[dn][2 * r] * scale[r], acc[dn][2 * r + 1] * scale[r]);
  }
}

// A warp's 16 staged rows [wrow, wrow + 16) of a tile of kRows rows -> rows t0 + wrow, ... of
// one (batch, head) slice `head` of a [B, T, H, D] tensor, in whole 16-byte chunks; rows before
// 0 or at or past t_len are not written.
template <int kRows, int D>
__device__ __forceinline__ void StoreRows(bf16* head, const bf16* tile, int wrow, int t0,
                                          int t_len, int64_t stride, int lane) {
  constexpr int KC = D / 8;
#pragma unroll
  for (int i = 0; i < 16 * KC / 32; ++i) {
    const int c = lane + 32 * i, row = wrow + c / KC, col = (c % KC) * 8;
    if (t0 + row >= 0 && t0 + row < t_len)
      *reinterpret_cast<uint4*>(head + int64_t(t0 + row) * stride + col) =
          *reinterpret_cast<const uint4*>(tile + Sw128<kRows>(row, col));
  }
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

// Turns: the kW consumer warpgroups of a CTA issue each tile's products in a fixed round, so
// that one's products run on the tensor cores while the others work on their registers (the
// softmax, dS), rather than all waiting on the products and then all on the exponentials
// (FlashAttention-3's "ping-pong"). Named barrier 1 + w is warpgroup w's turn: it takes the
// turn before issuing and passes it to the next warpgroup once issued, without waiting for the
// products. Every warpgroup passes the turn `turns` times, also for tiles it has no pairs in,
// and the last does not pass its last, so each barrier's arrivals are matched when the CTA ends.
template <int kW>
struct Turns {
  int wg, turns;
  __device__ __forceinline__ Turns(int wg_, int turns_) : wg(wg_), turns(turns_) {
    if (kW > 1 && wg == kW - 1) asm volatile("bar.arrive 1, 256;\n" ::: "memory");  // 0 first
  }
  __device__ __forceinline__ void Take() const {
    if constexpr (kW > 1) asm volatile("bar.sync %0, 256;\n" ::"r"(1 + wg) : "memory");
  }
  // No memory clobber: between issuing the products and waiting for them, one would make ptxas
  // serialise the wgmmas (C7514).
  __device__ __forceinline__ void Pass(int j) const {
    if constexpr (kW > 1) {
      if (wg + 1 < kW || j + 1 < turns)
        asm volatile("bar.arrive %0, 256;\n" ::"r"(1 + (wg + 1) % kW));
    }
  }
};

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

// A box of the map's rows x D at row t0 of (b, h) into a shared tile of `rows` rows, stored as
// 64-column halves of `rows` rows each: one copy per half. (The attention forward fills its Q
// tile a warpgroup's 64 rows at a time, at dst = the tile + 64 w rows.)
template <int D>
__device__ __forceinline__ void TmaTile(bf16* dst, int rows, const CUtensorMap* map, int h,
                                        int t0, int b, uint64_t* bar) {
#pragma unroll
  for (int half = 0; half < D / 64; ++half)
    TmaLoad(dst + half * rows * 64, map, half * 64, h, t0, b, bar);
}

// The other way: `rows` staged rows at `src` (in a shared tile of kRows rows, stored as its
// 64-column halves) -> rows t0, t0 + 1, ... of (b, h), by bulk tensor stores (the map's box
// has `rows` rows; rows past T are not written), committed as one group of this thread's. The
// shared rows must stay as they are until BulkWaitRead.
template <int D, int kRows>
__device__ __forceinline__ void TmaStoreRows(const CUtensorMap* map, const bf16* src, int h,
                                             int t0, int b) {
#pragma unroll
  for (int half = 0; half < D / 64; ++half)
    asm volatile(
        "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n"
        ::"l"(reinterpret_cast<uint64_t>(map)), "r"(half * 64), "r"(h), "r"(t0), "r"(b),
        "r"(SmemAddr(src + half * kRows * 64))
        : "memory");
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}

// Until this thread's bulk copies have read their shared memory (a thread with none goes on).
__device__ __forceinline__ void BulkWaitRead() {
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
// Until they have completed.
__device__ __forceinline__ void BulkWaitAll() {
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

// Named barrier `id` (1-15; 0 is __syncthreads') over `threads` threads: arrive and go on, or
// wait until all have arrived.
__device__ __forceinline__ void NamedBarrier(int id, int threads, bool arrive) {
  if (arrive) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
  } else {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
  }
}

// global[0, bytes) += shared[0, bytes) in float32, by the TMA unit (a bulk reduction).
__device__ __forceinline__ void BulkReduceAdd(float* global, const float* shared, int bytes) {
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
      "cp.async.bulk.commit_group;\n" ::"l"(global),
      "r"(SmemAddr(shared)), "r"(bytes)
      : "memory");
}

// ---------------------------------------------------------------------------------------------
// Host side.

// Whether an op's Hopper kernels run on this device: the module holds sm_90a code of `kernel`
// (one of them) and the device runs it (compute capability 9.0), unless BLUJAX_NO_WGMMA=1 asks
// for the portable kernels (to compare the two, or test the portable ones on a Hopper GPU).
// The answer per device is kept (per kernel signature: the module's kernels share targets).
template <typename Kernel>
bool Sm90Runs(Kernel kernel, int device) {
  static std::atomic<int> known[64] = {};  // 0 unknown, 1 no, 2 yes
  if (device < 0 || device >= 64) return false;
  int state = known[device].load(std::memory_order_relaxed);
  if (state == 0) {
    const char* no = std::getenv("BLUJAX_NO_WGMMA");
    cudaFuncAttributes attr{};
    int major = 0, minor = 0;
    bool yes = !(no && no[0] == '1') &&
               cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) ==
                   cudaSuccess &&
               cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) ==
                   cudaSuccess &&
               major == 9 && minor == 0;
    // cudaFuncGetAttributes reports the binary the device would run.
    yes = yes &&
          OnDevice(device, [&] {
            return cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(kernel));
          }) == cudaSuccess &&
          attr.binaryVersion == 90;
    cudaGetLastError();  // a query only: leave no error behind for the launch check
    state = yes ? 2 : 1;
    known[device].store(state, std::memory_order_relaxed);
  }
  return state == 2;
}

// cuTensorMapEncodeTiled, from the driver (the module links no driver symbols, so that it loads
// on machines without CUDA); null when the driver has none.
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                   const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                   const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                   CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
inline EncodeTiledFn TensorMapEncoder() {
  static const EncodeTiledFn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      f = nullptr;
    }
    return reinterpret_cast<EncodeTiledFn>(f);
  }();
  return fn;
}

}  // namespace blujax
