// Helpers shared by every handler, CPU and CUDA: argument checks that return ffi::Error with a
// message a user can act on, and dtype names.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace blujax {

namespace ffi = xla::ffi;

// Return early from a handler when a check fails.
#define BLUJAX_RETURN_IF_ERROR(expr)          \
  do {                                        \
    ::xla::ffi::Error blujax_err_ = (expr);   \
    if (blujax_err_.failure()) return blujax_err_; \
  } while (0)

// Message pieces: strings and numbers. Plain string building, no iostreams: a handler's error
// path must not depend on the locale machinery of whichever C++ runtime the process loaded.
inline void AppendPart(std::string& s, const char* v) { s += v; }
inline void AppendPart(std::string& s, const std::string& v) { s += v; }
inline void AppendPart(std::string& s, char v) { s += v; }
inline void AppendPart(std::string& s, double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  s += buf;
}
inline void AppendPart(std::string& s, float v) { AppendPart(s, static_cast<double>(v)); }
template <typename I, typename = std::enable_if_t<std::is_integral_v<I>>>
inline void AppendPart(std::string& s, I v) { s += std::to_string(v); }

template <typename... Parts>
inline std::string StrCat(const Parts&... parts) {
  std::string s;
  (AppendPart(s, parts), ...);
  return s;
}

template <typename... Parts>
inline ffi::Error InvalidArgument(const Parts&... parts) {
  return ffi::Error::InvalidArgument(StrCat(parts...));
}

inline const char* DtypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U16: return "uint16";
    case ffi::DataType::F8E4M3FN: return "float8_e4m3fn";
    case ffi::DataType::F8E5M2: return "float8_e5m2";
    default: return "an unsupported dtype";
  }
}

// Shape as "[2, 3, 768]" for messages.
inline std::string ShapeString(const ffi::AnyBuffer& b) {
  std::string s = "[";
  auto dims = b.dimensions();
  for (size_t i = 0; i < dims.size(); ++i) s += StrCat(i ? ", " : "", dims[i]);
  return s + "]";
}

// The rows x cols view of an input normalised, activated or reduced along its last axis.
struct RowsCols {
  int64_t rows = 0;  // product of the leading axes
  int64_t cols = 0;  // the last axis
};

// A float input of rank >= 1 in a dtype this backend runs (bf16 and f32; f64 on the CPU).
inline ffi::Error CheckFloatRows(const char* op, const ffi::AnyBuffer& x, bool allow_f64,
                                 RowsCols* rc) {
  auto t = x.element_type();
  bool ok = t == ffi::DataType::F32 || t == ffi::DataType::BF16 ||
            (allow_f64 && t == ffi::DataType::F64);
  if (!ok)
    return InvalidArgument(op, ": unsupported dtype ", DtypeName(t), " (this backend supports ",
                           allow_f64 ? "float32, float64 and bfloat16)" : "float32 and bfloat16)");
  auto dims = x.dimensions();
  if (dims.size() < 1) return InvalidArgument(op, ": x must have rank >= 1");
  rc->cols = dims.back();
  if (rc->cols > (int64_t{1} << 30))
    return InvalidArgument(op, ": last axis too large (shape ", ShapeString(x), ")");
  rc->rows = 1;
  for (size_t i = 0; i + 1 < dims.size(); ++i) rc->rows *= dims[i];
  return ffi::Error::Success();
}

inline int64_t LastDim(const ffi::AnyBuffer& b) {
  auto dims = b.dimensions();
  return dims.size() == 0 ? 1 : dims.back();
}

inline ffi::Error CheckDtype(const char* op, const char* name, const ffi::AnyBuffer& b,
                             ffi::DataType want) {
  if (b.element_type() != want)
    return InvalidArgument(op, ": ", name, " must be ", DtypeName(want), ", got ",
                           DtypeName(b.element_type()));
  return ffi::Error::Success();
}

inline ffi::Error CheckCount(const char* op, const char* name, const ffi::AnyBuffer& b,
                             int64_t want) {
  if (static_cast<int64_t>(b.element_count()) != want)
    return InvalidArgument(op, ": ", name, " has shape ", ShapeString(b), " (",
                           b.element_count(), " elements), expected ", want, " elements");
  return ffi::Error::Success();
}

inline bool SameDims(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b) {
  auto da = a.dimensions(), db = b.dimensions();
  if (da.size() != db.size()) return false;
  for (size_t i = 0; i < da.size(); ++i)
    if (da[i] != db[i]) return false;
  return true;
}

// The buffer of an optional result, or null where the target has no such result (the checks
// below take operands and results alike as buffers). Not a pointer to const: jaxlib 0.10's
// Result has no const operator*.
inline const ffi::AnyBuffer* OptionalResult(ffi::Result<ffi::AnyBuffer>* r) {
  return r ? &**r : nullptr;
}

// Same dtype and shape as `like` (a result shaped like an operand, or two operands that must
// match).
inline ffi::Error CheckLike(const char* op, const char* name, const ffi::AnyBuffer& b,
                            const char* like_name, const ffi::AnyBuffer& like) {
  if (b.element_type() != like.element_type())
    return InvalidArgument(op, ": ", name, " is ", DtypeName(b.element_type()), " but ",
                           like_name, " is ", DtypeName(like.element_type()));
  if (!SameDims(b, like))
    return InvalidArgument(op, ": ", name, " has shape ", ShapeString(b), " but ", like_name,
                           " has shape ", ShapeString(like));
  return ffi::Error::Success();
}

}  // namespace blujax
