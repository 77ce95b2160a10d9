// What the kernels that write an FP8 copy of their output share (blujax.fp8's per-tensor
// scaling; the first is SwiGLU's, common/swiglu.h): the formats, the checks of the scale and
// amax operands, and on the host the rounding of a float to a format.
//
// A kernel's FP8 copy of v is q = fp8(clip(v / scale, -top, top)), rounded to nearest even,
// where v is the value the kernel would have written in its own dtype (so the copy is what
// casting that output would give, bit for bit), scale a float32 scalar, top the format's
// largest finite value; its amax is max |v| over the tensor (float32; NaN where any v is).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/ffi_util.h"

namespace blujax {

enum class Fp8Format { kE4M3, kE5M2 };

// float8_e4m3fn (4 exponent bits, bias 7, no infinities, 0x7f NaN) and float8_e5m2 (5, bias
// 15, IEEE-like), the two blujax.fp8 uses.
inline bool Fp8FormatOf(ffi::DataType t, Fp8Format* f) {
  if (t == ffi::DataType::F8E4M3FN) { *f = Fp8Format::kE4M3; return true; }
  if (t == ffi::DataType::F8E5M2) { *f = Fp8Format::kE5M2; return true; }
  return false;
}

// q and qt, the copy of a [rows, cols] output and its transpose [cols, rows], in one FP8
// format; scale a float32 scalar; amax a float32 scalar result.
inline ffi::Error CheckFp8Copy(const char* op, const ffi::AnyBuffer& scale,
                               const ffi::AnyBuffer& q, const ffi::AnyBuffer& qt,
                               const ffi::AnyBuffer& amax, int64_t rows, int64_t cols,
                               Fp8Format* format) {
  BLUJAX_RETURN_IF_ERROR(CheckDtype(op, "scale", scale, ffi::DataType::F32));
  BLUJAX_RETURN_IF_ERROR(CheckCount(op, "scale", scale, 1));
  BLUJAX_RETURN_IF_ERROR(CheckDtype(op, "amax", amax, ffi::DataType::F32));
  BLUJAX_RETURN_IF_ERROR(CheckCount(op, "amax", amax, 1));
  if (!Fp8FormatOf(q.element_type(), format))
    return InvalidArgument(op, ": q must be float8_e4m3fn or float8_e5m2, got ",
                           DtypeName(q.element_type()));
  if (qt.element_type() != q.element_type())
    return InvalidArgument(op, ": qt is ", DtypeName(qt.element_type()), " but q is ",
                           DtypeName(q.element_type()));
  BLUJAX_RETURN_IF_ERROR(CheckCount(op, "q", q, rows * cols));
  auto d = qt.dimensions();
  if (d.size() != 2 || d[0] != cols || d[1] != rows)
    return InvalidArgument(op, ": qt has shape ", ShapeString(qt), ", expected [", cols, ", ",
                           rows, "] (q's transpose)");
  return ffi::Error::Success();
}

// v rounded to the format (nearest even), saturated to its largest finite value; NaN to NaN.
inline uint8_t FloatToFp8(float v, Fp8Format f) {
  const int mbits = f == Fp8Format::kE4M3 ? 3 : 2;
  const int bias = f == Fp8Format::kE4M3 ? 7 : 15;
  const float top = f == Fp8Format::kE4M3 ? 448.f : 57344.f;
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  if (std::isnan(v)) return f == Fp8Format::kE4M3 ? uint8_t(sign | 0x7f) : uint8_t(sign | 0x7e);
  const float a = std::fmin(std::fabs(v), top);
  // The spacing of the format's values around a: 2^(e - mbits) in the binade [2^e, 2^(e+1)),
  // 2^(1 - bias - mbits) among the subnormals. Scaling by a power of two is exact, and
  // nearbyint rounds to nearest even in the default rounding mode.
  int e;
  std::frexp(a, &e);  // a = m 2^e, m in [0.5, 1): a's binade is [2^(e-1), 2^e)
  const int exp = std::max(e - 1, 1 - bias);
  const float units = std::nearbyint(std::ldexp(a, mbits - exp));  // a in units of the spacing
  // units is in [0, 2^(mbits+1)]: 2^(mbits+1) carries into the next binade, and below
  // 2^mbits (only where exp is the least) the value is subnormal.
  uint32_t u = static_cast<uint32_t>(units);
  int field = exp + bias;
  if (u >= (2u << mbits)) { u >>= 1; ++field; }
  if (u < (1u << mbits)) return static_cast<uint8_t>(sign | u);  // subnormal or zero
  return static_cast<uint8_t>(sign | (field << mbits) | (u - (1u << mbits)));
}

}  // namespace blujax
