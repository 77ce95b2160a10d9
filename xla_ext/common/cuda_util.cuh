// Device-side helpers shared by the CUDA kernels: bf16/float conversion, 16-byte packs, loads
// and stores that skip L1, asynchronous copies to shared memory, and warp and group reductions.
// The host side (launches, device queries) is common/cuda_launch.cuh.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace blujax {

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
// written once. In the LayerNorm kernels they measured faster on the whole than the streaming
// forms (__ldcs, __stcs: evict-first) and, as stores, than plain write-back ones (the
// experiment log, benchmarks/LOG.md).
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

// A generic pointer into shared memory as the 32-bit shared-memory address that PTX's
// .shared instructions take.
__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes from global to shared memory without passing through registers (sm_80+: cp.async,
// L1 bypassed); the copies a thread has issued since its last commit form one group, and
// CopyAsyncWait<N> returns once all but the newest N of its groups have landed. Each thread
// waits only on its own copies, so a thread that reads back only what it copied needs no
// barrier.
// CopyAsync16At takes the shared-memory address as a 32-bit offset (SmemAddr), which a loop
// can keep in one register instead of a generic pointer's two.
__device__ __forceinline__ void CopyAsync16At(uint32_t smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem), "l"(gmem) : "memory");
}

// 16 (or 4) bytes as above, or where !valid nothing read and zeros written (cp.async's src-size
// 0): a tile's rows past the end of a sequence arrive as zeros. The 4-byte form goes through L1
// (.ca; .cg takes only 16 bytes).
__device__ __forceinline__ void CopyAsync16OrZeros(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SmemAddr(dst)),
               "l"(__cvta_generic_to_global(src)), "r"(valid ? 16 : 0)
               : "memory");
}

__device__ __forceinline__ void CopyAsync4OrZeros(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(SmemAddr(dst)),
               "l"(__cvta_generic_to_global(src)), "r"(valid ? 4 : 0)
               : "memory");
}

__device__ __forceinline__ void CopyAsync16(void* smem, const void* gmem) {
#if __CUDA_ARCH__ >= 800
  CopyAsync16At(SmemAddr(smem), gmem);
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
