// The CPU twins' FP8 store (cpu/swiglu.cc, cpu/rms_norm.cc): one output value as the kernel
// would write it, then its FP8 copy (common/fp8.h) and the running amax.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/bf16.h"
#include "common/fp8.h"

namespace blujax {

// v as the kernel would write it in T, then its FP8 copy at (r, c) of q [rows, cols] and
// qt [cols, rows]; the running amax (a NaN, once in, stays: no value compares above it).
template <typename T>
inline void StoreFp8(float v, float scale, Fp8Format f, uint8_t* q, uint8_t* qt, int64_t r,
                     int64_t c, int64_t rows, int64_t cols, float* amax) {
  T rounded;
  Store(&rounded, 0, v);
  const float w = Load(&rounded, 0);
  const uint8_t b = FloatToFp8(w / scale, f);
  q[r * cols + c] = b;
  qt[c * rows + r] = b;
  const float a = std::fabs(w);
  if (std::isnan(a) || a > *amax) *amax = a;
}

}  // namespace blujax
