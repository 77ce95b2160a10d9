// Device helpers for the flat elementwise kernels (swiglu, rope): kVec consecutive elements as
// one access, either a 16-byte Pack (common/cuda_util.cuh) where shape and alignment allow or a
// single element otherwise, and a cheap division for turning a flat index into coordinates.
#pragma once

#include <cstdint>
#include <type_traits>

#include "common/cuda_util.cuh"

namespace blujax {

// One element, with Pack's interface: the any-shape path of a kernel written for packs.
template <typename T>
struct Single {
  static constexpr int kSize = 1;
  T v[1];
};

// kVec is Pack<T>::kSize (16 bytes) or 1.
template <typename T, int kVec>
using Vec = std::conditional_t<kVec == 1, Single<T>, Pack<T>>;

template <typename T, int kVec>
__device__ __forceinline__ Vec<T, kVec> LoadVec(const T* p) {
  static_assert(kVec == 1 || kVec == Pack<T>::kSize, "a pack or one element");
  if constexpr (kVec == 1) {
    return Single<T>{{*p}};
  } else {
    return LoadPack(p);
  }
}

// Element k as a float (a bfloat16 pack stays in its 4 registers until used: PackElem).
template <typename T, int kVec>
__device__ __forceinline__ float VecElem(const Vec<T, kVec>& a, int k) {
  if constexpr (kVec == 1) {
    return ToFloat(a.v[0]);
  } else {
    return PackElem(a, k);
  }
}

template <typename T, int kVec>
__device__ __forceinline__ void StoreVec(T* p, const float (&f)[kVec]) {
  if constexpr (kVec == 1) {
    *p = FromFloat<T>(f[0]);
  } else {
    *reinterpret_cast<Pack<T>*>(p) = PackFromFloats<T>(f);
  }
}

// kVec float32 values at p (16-byte aligned where kVec is a multiple of 4).
template <int kVec>
__device__ __forceinline__ void LoadFloats(const float* p, float (&f)[kVec]) {
  if constexpr (kVec % 4 == 0) {
#pragma unroll
    for (int k = 0; k < kVec; k += 4) {
      const float4 q = __ldg(reinterpret_cast<const float4*>(p + k));
      f[k] = q.x;
      f[k + 1] = q.y;
      f[k + 2] = q.z;
      f[k + 3] = q.w;
    }
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k) f[k] = __ldg(p + k);
  }
}

// i / d, and i % d in *rem (i >= 0, d > 0), in 32-bit arithmetic where both fit: several times
// cheaper than 64-bit division, which a flat index of under 2^32 elements never needs.
__device__ __forceinline__ int64_t DivMod(int64_t i, int64_t d, int64_t* rem) {
  if (((i | d) >> 32) == 0) {
    const uint32_t q = static_cast<uint32_t>(i) / static_cast<uint32_t>(d);
    *rem = static_cast<int64_t>(static_cast<uint32_t>(i) - q * static_cast<uint32_t>(d));
    return q;
  }
  const int64_t q = i / d;
  *rem = i - q * d;
  return q;
}

}  // namespace blujax
