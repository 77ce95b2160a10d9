// Helpers shared by the CUDA handlers: error checks, bf16/float conversion, 16-byte packs,
// warp and group reductions, and the device's multiprocessor count.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "common/ffi_util.h"

namespace blujax {

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

inline bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <int kWidth = 32>
__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = kWidth / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum of (a, b) over the kGroup consecutive threads that share a row. Groups wider than a warp
// meet in shared memory `red` (2 * blockDim.x / 32 floats); every thread of the block must call
// this together, since it synchronises the block.
template <int kGroup>
__device__ __forceinline__ void GroupSum2(float& a, float& b, float* red) {
  a = WarpSum(a);
  b = WarpSum(b);
  if constexpr (kGroup > 32) {
    constexpr int kWarps = kGroup / 32;
    const int warp = threadIdx.x / 32, first = warp / kWarps * kWarps;
    if (threadIdx.x % 32 == 0) {
      red[2 * warp] = a;
      red[2 * warp + 1] = b;
    }
    __syncthreads();
    a = 0.f;
    b = 0.f;
#pragma unroll
    for (int i = 0; i < kWarps; ++i) {
      a += red[2 * (first + i)];
      b += red[2 * (first + i) + 1];
    }
    __syncthreads();  // red is reused by the next call
  }
}

}  // namespace blujax
