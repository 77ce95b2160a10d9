// Helpers shared by the CUDA handlers: error checks, bf16/float conversion, 16-byte packs,
// warp and group reductions, and the device's multiprocessor count.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "common/ffi_util.h"

namespace blujax {

// What every CUDA handler binds: the stream to launch on and the device it belongs to. Handlers
// only launch kernels on that stream (no allocation, no synchronisation), so all are marked safe
// to capture in CUDA graphs (XLA command buffers).
using Stream = ffi::PlatformStream<cudaStream_t>;
using Device = ffi::DeviceOrdinal;
constexpr auto kGraphSafe = {ffi::Traits::kCmdBufferCompatible};

// After a launch: turn a CUDA error into an ffi::Error naming the op.
inline ffi::Error LastCudaError(const char* op) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    return ffi::Error::Internal(std::string(op) + ": CUDA error: " + cudaGetErrorString(err));
  return ffi::Error::Success();
}

// Multiprocessor count of a device, looked up once (handlers run inside CUDA-graph capture,
// where only non-stream queries are allowed; this is one).
inline int SmCount(int device) {
  static std::atomic<int> cache[64];
  if (device < 0 || device >= 64) device = 0;
  int n = cache[device].load(std::memory_order_relaxed);
  if (n == 0) {
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || n <= 0)
      n = 132;  // a sizing hint only; every grid below is also correct with any count
    cache[device].store(n, std::memory_order_relaxed);
  }
  return n;
}

// The most shared memory one block may use once its kernel opts in (cudaFuncSetAttribute with
// cudaFuncAttributeMaxDynamicSharedMemorySize), looked up once per device like SmCount.
inline int MaxSharedMemoryPerBlockOptin(int device) {
  static std::atomic<int> cache[64];
  if (device < 0 || device >= 64) device = 0;
  int n = cache[device].load(std::memory_order_relaxed);
  if (n == 0) {
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
            cudaSuccess ||
        n <= 0) {
      cudaGetLastError();  // not an error of the launch that follows
      n = 48 << 10;        // what every device gives without opting in
    }
    cache[device].store(n, std::memory_order_relaxed);
  }
  return n;
}

// The dynamic shared memory one block of kKernel may use on `device`: raised once per device
// from the default 48 KB to all the device lets one block have (with the L1/shared split
// tilted to shared memory), and cached. cudaFuncSetAttribute is not a stream operation, so
// this is safe inside CUDA-graph capture; it is kept off the per-launch path all the same.
// 0 if that failed: the caller then takes a path that needs less.
template <auto kKernel>
size_t SharedMemoryLimit(int device) {
  static std::atomic<int64_t> cache[64];  // 0: not yet asked; -1: failed
  if (device < 0 || device >= 64) device = 0;
  int64_t limit = cache[device].load(std::memory_order_relaxed);
  if (limit == 0) {
    cudaFuncAttributes attr;
    limit = -1;
    if (cudaFuncGetAttributes(&attr, kKernel) == cudaSuccess) {
      const int64_t want = int64_t(MaxSharedMemoryPerBlockOptin(device)) -
                           static_cast<int64_t>(attr.sharedSizeBytes);
      if (want > 0 && cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(want)) == cudaSuccess) {
        limit = want;
        cudaFuncSetAttribute(kKernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                             cudaSharedmemCarveoutMaxShared);  // a hint
      }
    }
    cudaGetLastError();  // a failure here is not an error of the launch that follows
    cache[device].store(limit, std::memory_order_relaxed);
  }
  return limit > 0 ? static_cast<size_t>(limit) : 0;
}

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T FromFloat(float v);
template <> __device__ __forceinline__ float FromFloat<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// 16 bytes of T: one vectorised load or store.
template <typename T>
struct alignas(16) Pack {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

template <typename T>
__device__ __forceinline__ Pack<T> LoadPack(const T* p) {
  Pack<T> out;
  *reinterpret_cast<uint4*>(&out) = __ldg(reinterpret_cast<const uint4*>(p));
  return out;
}

template <typename T>
__device__ __forceinline__ void StorePack(T* p, const Pack<T>& v) {
  *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(&v);
}

// Bfloat16 k (0: the low half, at the lower address; 1: the high half) of a 32-bit word, as a
// float. A bfloat16 is the high half of a float, so a shift or a mask converts it, and the word
// stays whole in its register; converting element by element splits it into 16-bit values, a
// register each.
__device__ __forceinline__ float Bf16OfWord(uint32_t w, int k) {
  return __uint_as_float(k % 2 ? w & 0xffff0000u : w << 16);
}

// Element k of a pack, as a float (a bfloat16 pack stays in its 4 registers: Bf16OfWord).
template <typename T>
__device__ __forceinline__ float PackElem(const Pack<T>& p, int k) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return Bf16OfWord(reinterpret_cast<const uint32_t*>(p.v)[k / 2], k);
  } else {
    return ToFloat(p.v[k]);
  }
}

// A pack of T from kSize floats, rounded to nearest; bfloat16 converts two at a time (one
// cvt.rn.bf16x2.f32 a pair, not a conversion an element and a move to pair them).
template <typename T>
__device__ __forceinline__ Pack<T> PackFromFloats(const float (&f)[Pack<T>::kSize]) {
  Pack<T> out;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
#pragma unroll
    for (int k = 0; k < Pack<T>::kSize; k += 2)
      reinterpret_cast<__nv_bfloat162*>(out.v)[k / 2] = __floats2bfloat162_rn(f[k], f[k + 1]);
  } else {
#pragma unroll
    for (int k = 0; k < Pack<T>::kSize; ++k) out.v[k] = FromFloat<T>(f[k]);
  }
  return out;
}

// Loads and stores that do not allocate in L1 and keep L2's default policy, for rows read or
// written once. In the LayerNorm kernels on an H100 (benchmarks/RESULTS.md) they beat the
// streaming forms (__ldcs, __stcs: evict-first) that the kernels used before: forward 2-4%
// faster at C = 768 and 2% at bfloat16 C = 3072 (1% slower at bfloat16 C = 4096), backward up
// to 2% faster; plain write-back stores were up to 3% slower than either in the bfloat16
// backward.
template <typename T>
__device__ __forceinline__ Pack<T> LoadPackNoL1(const T* p) {
  Pack<T> out;
  uint4& r = *reinterpret_cast<uint4*>(&out);
  asm volatile("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return out;
}

// A pack from shared memory at a 32-bit address (see CopyAsync16At).
template <typename T>
__device__ __forceinline__ Pack<T> LoadSharedPack(uint32_t smem) {
  Pack<T> out;
  uint4& r = *reinterpret_cast<uint4*>(&out);
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "r"(smem));
  return out;
}

template <typename T>
__device__ __forceinline__ void StorePackNoL1(T* p, const Pack<T>& v) {
  const uint4& r = *reinterpret_cast<const uint4*>(&v);
  asm volatile("st.global.L1::no_allocate.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(r.x),
               "r"(r.y), "r"(r.z), "r"(r.w)
               : "memory");
}

// 16 bytes from global to shared memory without passing through registers (sm_80+: cp.async,
// L1 bypassed); the copies a thread has issued since its last commit form one group, and
// CopyAsyncWait<N> returns once all but the newest N of its groups have landed. Each thread
// waits only on its own copies, so a thread that reads back only what it copied needs no
// barrier.
// CopyAsync16At takes the shared-memory address as a 32-bit offset (__cvta_generic_to_shared),
// which a loop can keep in one register instead of a generic pointer's two.
__device__ __forceinline__ void CopyAsync16At(uint32_t smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem), "l"(gmem) : "memory");
}

__device__ __forceinline__ void CopyAsync16(void* smem, const void* gmem) {
#if __CUDA_ARCH__ >= 800
  CopyAsync16At(static_cast<uint32_t>(__cvta_generic_to_shared(smem)), gmem);
#else
  *static_cast<uint4*>(smem) = *static_cast<const uint4*>(gmem);
#endif
}

__device__ __forceinline__ void CopyAsyncCommit() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void CopyAsyncWait() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

__device__ __forceinline__ void CopyAsyncWaitAll() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

inline bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <int kWidth = 32>
__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = kWidth / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum of (a, b) over the kGroup consecutive threads that share a row. Groups wider than a warp
// meet in shared memory `red` (2 * blockDim.x / 32 floats). By default every thread of the block
// must call this together, since it synchronises the block; given the block's size kThreads
// (at most 15 groups), each group waits at a barrier of its own warps instead, so a group that
// is ahead need not wait for the others.
template <int kGroup, int kThreads = 0>
__device__ __forceinline__ void GroupSum2(float& a, float& b, float* red) {
  a = WarpSum(a);
  b = WarpSum(b);
  if constexpr (kGroup > 32) {
    constexpr int kWarps = kGroup / 32;
    constexpr bool kOwn = kThreads > kGroup;
    static_assert(!kOwn || kThreads / kGroup <= 15, "named barriers 1-15, one a group");
    const int warp = threadIdx.x / 32, first = warp / kWarps * kWarps;
    auto wait = [&] {
      if constexpr (kOwn) {
        asm volatile("bar.sync %0, %1;" ::"r"(1 + warp / kWarps), "r"(kGroup) : "memory");
      } else {
        __syncthreads();
      }
    };
    if (threadIdx.x % 32 == 0) {
      red[2 * warp] = a;
      red[2 * warp + 1] = b;
    }
    wait();
    a = 0.f;
    b = 0.f;
#pragma unroll
    for (int i = 0; i < kWarps; ++i) {
      a += red[2 * (first + i)];
      b += red[2 * (first + i) + 1];
    }
    wait();  // red is reused by the next call
  }
}

// Mean and sum of squared deviations (m2) over the kGroup threads of a row, each contributing
// the (count, mean, m2) of its own elements: Chan et al.'s pairwise merge, as accurate as two
// passes over the row, in one exchange. Same calling rule as GroupSum2; `red` holds
// 3 * blockDim.x / 32 floats.
__device__ __forceinline__ void MergeMoments(float& n, float& mean, float& m2, float nb,
                                             float mean_b, float m2_b) {
  const float total = n + nb;
  if (total > 0.f) {
    const float delta = mean_b - mean, wb = nb / total;
    mean += delta * wb;
    m2 += m2_b + delta * delta * n * wb;
  }
  n = total;
}

template <int kGroup>
__device__ __forceinline__ void GroupMoments(float& n, float& mean, float& m2, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    const float nb = __shfl_xor_sync(0xffffffffu, n, o);
    const float mb = __shfl_xor_sync(0xffffffffu, mean, o);
    const float m2b = __shfl_xor_sync(0xffffffffu, m2, o);
    MergeMoments(n, mean, m2, nb, mb, m2b);
  }
  if constexpr (kGroup > 32) {
    constexpr int kWarps = kGroup / 32;
    const int warp = threadIdx.x / 32, first = warp / kWarps * kWarps;
    if (threadIdx.x % 32 == 0) {
      red[3 * warp] = n;
      red[3 * warp + 1] = mean;
      red[3 * warp + 2] = m2;
    }
    __syncthreads();
    n = red[3 * first];
    mean = red[3 * first + 1];
    m2 = red[3 * first + 2];
#pragma unroll
    for (int i = 1; i < kWarps; ++i)
      MergeMoments(n, mean, m2, red[3 * (first + i)], red[3 * (first + i) + 1],
                   red[3 * (first + i) + 2]);
    __syncthreads();  // red is reused by the next call
  }
}

}  // namespace blujax
