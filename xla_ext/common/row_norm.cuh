// What the two row normalizations (LayerNorm, RMSNorm) share about how their CUDA kernels are
// shaped and launched: a group of threads per row, its block, the registers a thread keeps, and
// the launch-time choice of the group. Each op's kernels, launchers and handlers stay in its
// own files (cuda/layernorm*.cu[h], cuda/rms_norm.cu).
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "common/cuda_launch.cuh"
#include "common/cuda_util.cuh"

namespace blujax {
namespace {

// Forward: threads per block, unless one row's group is wider.
constexpr int kBlock = 256;

template <int kGroup> __host__ __device__ constexpr int BlockFor() {
  return kGroup > kBlock ? kGroup : kBlock;
}

constexpr int kFwdFloats = 32;  // row elements a thread keeps in registers, forward

// Backward: groups share a block of at least 512 threads, so a multiprocessor holds one or two
// blocks and leaves as many partial rows of the weight gradients, not four or more (fewer to
// write and to sum: measured faster for narrow groups).
template <int kGroup> __host__ __device__ constexpr int BwdBlockFor() {
  return kGroup < 512 ? 512 : kGroup;
}
// Elements of dy (and of x) a backward thread keeps in registers: 16, in twice as many threads
// as 32 would need, each held to 64 registers so that 1024 threads fit a multiprocessor (32 and
// ~125 registers were latency-bound). bfloat16 fits the bound only with its packs kept whole.
constexpr int kBwdFloats = 16;
template <typename T> __host__ __device__ constexpr int BwdVecs() {
  return kBwdFloats / Pack<T>::kSize;
}
// Blocks a multiprocessor must hold, promised through __launch_bounds__.
template <int kThreads> __host__ __device__ constexpr int BwdMinBlocks() {
  return kThreads < 1024 ? 1024 / kThreads : 1;
}

// Dynamic shared memory a launch takes without opting in to more: the default, less room for
// the kernels' static shared memory.
constexpr int kMaxSharedBytes = kDefaultSharedBytes - (2 << 10);

// The narrowest group whose threads hold a row of `packs` packs, `vecs` a thread; 0 when even
// 1024 threads cannot.
inline int GroupFor(int packs, int vecs) {
  for (int g = 32; g <= 1024; g *= 2)
    if (int64_t(g) * vecs >= packs) return g;
  return 0;
}

// Blocks of a kernel that fit on one multiprocessor (at least 1).
template <typename Kernel>
int BlocksPerSm(Kernel kernel, int threads, size_t smem) {
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem) != cudaSuccess) {
    cudaGetLastError();  // a sizing query only: clear it and fall back to one block
    n = 1;
  }
  return n < 1 ? 1 : n;
}

// f(std::integral_constant<int, group>) for a group GroupFor chose: the kernels take it as a
// template argument.
template <typename F>
void WithGroup(int group, F&& f) {
  switch (group) {
    case 32: f(std::integral_constant<int, 32>{}); break;
    case 64: f(std::integral_constant<int, 64>{}); break;
    case 128: f(std::integral_constant<int, 128>{}); break;
    case 256: f(std::integral_constant<int, 256>{}); break;
    case 512: f(std::integral_constant<int, 512>{}); break;
    default: f(std::integral_constant<int, 1024>{}); break;
  }
}

}  // namespace
}  // namespace blujax
