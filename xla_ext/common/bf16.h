// bfloat16 <-> float on the host. XLA's FFI hands bf16 buffers over as uint16_t.
#pragma once

#include <cstdint>
#include <cstring>

namespace blujax {

inline float Bf16ToFloat(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Round to nearest even, as XLA does; NaN stays NaN.
inline uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// Storage type T <-> compute type: bf16 and f32 compute in float, f64 in double.
template <typename T> struct Compute { using type = T; };
template <> struct Compute<uint16_t> { using type = float; };

template <typename T> inline typename Compute<T>::type Load(const T* p, int64_t i) { return p[i]; }
template <> inline float Load<uint16_t>(const uint16_t* p, int64_t i) { return Bf16ToFloat(p[i]); }

template <typename T, typename S>
inline void Store(T* p, int64_t i, S v) {
  p[i] = static_cast<T>(v);
}
template <>
inline void Store<uint16_t, float>(uint16_t* p, int64_t i, float v) {
  p[i] = FloatToBf16(v);
}

}  // namespace blujax
