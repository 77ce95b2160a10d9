// Host-side helpers shared by the CUDA handlers and launchers: what a handler binds, launch
// error checks, device queries, and the one way a kernel opts in to more than the default
// dynamic shared memory.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

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

inline bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Runs f() (a cudaError_t) with `device` current, then makes the caller's device current again:
// kernel attributes are set and read for the current device, not the one we launch on.
template <typename F>
cudaError_t OnDevice(int device, F&& f) {
  int current = -1;
  cudaError_t err = cudaGetDevice(&current);
  if (err == cudaSuccess && current != device) err = cudaSetDevice(device);
  if (err == cudaSuccess) err = f();
  if (current >= 0 && current != device) cudaSetDevice(current);
  return err;
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

// Shared memory a block may use (static and dynamic together) on every device without its
// kernel opting in to more.
constexpr size_t kDefaultSharedBytes = 48 << 10;

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
      n = kDefaultSharedBytes;
    }
    cache[device].store(n, std::memory_order_relaxed);
  }
  return n;
}

// The dynamic shared memory one block of kKernel may use on `device`: raised once per device
// from the default to all the device lets one block have (with the L1/shared split tilted to
// shared memory), and cached. Kernel attributes belong to the current device, so `device` is
// made current for it (OnDevice). cudaFuncSetAttribute is not a stream operation, so this is
// safe inside CUDA-graph capture; it is kept off the per-launch path all the same. 0 if that
// failed: the caller then takes a path that needs less, or reports it (LaunchKernel).
template <auto kKernel>
size_t SharedMemoryLimit(int device) {
  static std::atomic<int64_t> cache[64];  // 0: not yet asked; -1: failed
  const int slot = device >= 0 && device < 64 ? device : 0;
  int64_t limit = cache[slot].load(std::memory_order_relaxed);
  if (limit == 0) {
    limit = -1;
    OnDevice(device, [&] {
      cudaFuncAttributes attr;
      cudaError_t err = cudaFuncGetAttributes(&attr, kKernel);
      if (err != cudaSuccess) return err;
      const int64_t want = int64_t(MaxSharedMemoryPerBlockOptin(device)) -
                           static_cast<int64_t>(attr.sharedSizeBytes);
      if (want <= 0) return cudaErrorInvalidValue;
      err = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(want));
      if (err != cudaSuccess) return err;
      limit = want;
      return cudaFuncSetAttribute(kKernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                  cudaSharedmemCarveoutMaxShared);  // a hint
    });
    cudaGetLastError();  // a failure here is not an error of the launch that follows
    cache[slot].store(limit, std::memory_order_relaxed);
  }
  return limit > 0 ? static_cast<size_t>(limit) : 0;
}

// kKernel<<<blocks, threads, smem, stream>>>(args...), opting the kernel in first where `smem`
// bytes of dynamic shared memory are more than the default; an error names the op.
template <auto kKernel, typename... Args>
ffi::Error LaunchKernel(const char* op, int64_t blocks, int threads, size_t smem,
                        cudaStream_t stream, int device, Args... args) {
  if (smem > kDefaultSharedBytes && smem > SharedMemoryLimit<kKernel>(device))
    return ffi::Error::Internal(StrCat(op, ": a block needs ", smem,
                                       " bytes of shared memory; the device allows ",
                                       SharedMemoryLimit<kKernel>(device)));
  kKernel<<<static_cast<unsigned>(blocks), threads, smem, stream>>>(args...);
  return LastCudaError(op);
}

}  // namespace blujax
