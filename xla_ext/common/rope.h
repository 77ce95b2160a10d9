// The rotary position embedding (RoPE) handler contract, shared by xla_ext/cpu/rope.cc and
// xla_ext/cuda/rope.cu.
//
// blujax_rope_fwd  (x, cos, sin)   -> y
// blujax_rope_bwd  (dy, cos, sin)  -> dx
//
// Hugging Face Llama's "rotate_half" form: x is [..., T, N, D] (positions, heads, head size;
// D even, H = D / 2) and cos, sin are [T, H] (leading size-1 axes allowed, which is what vmap's
// "expand_dims" produces). For d < H:
//   y[d]     = x[d] cos[t, d] - x[d + H] sin[t, d]
//   y[d + H] = x[d + H] cos[t, d] + x[d] sin[t, d]
// computed in float32 (float64 for float64 x) and rounded to x's dtype once. The backward is
// the inverse rotation, the same with -sin (the transpose of a rotation is its inverse); cos
// and sin get no gradient. cos and sin are float32; with float64 x (CPU only) they may also be
// float64 (both the same dtype).
#pragma once

#include <cstdint>

#include "common/ffi_util.h"

namespace blujax {

struct RopeDims {
  int64_t positions = 0;  // rows of cos a pass covers: the product of the axes before N, D
  int64_t seq = 0;        // T: position p uses row p % T of cos and sin
  int64_t heads = 0;      // N
  int64_t half = 0;       // H = D / 2
};

// x: [..., T, N, D] with D even, in a dtype this backend runs.
inline ffi::Error CheckRopeInput(const char* op, const char* name, const ffi::AnyBuffer& x,
                                 bool allow_f64, RopeDims* d) {
  RowsCols rc;
  BLUJAX_RETURN_IF_ERROR(CheckFloatRows(op, x, allow_f64, &rc));
  auto dims = x.dimensions();
  if (dims.size() < 3)
    return InvalidArgument(op, ": ", name, " must be [..., T, N, D] (positions, heads, head "
                           "size), got shape ", ShapeString(x));
  if (rc.cols % 2 != 0)
    return InvalidArgument(op, ": the head size D must be even, got shape ", ShapeString(x));
  d->seq = dims[dims.size() - 3];
  d->heads = dims[dims.size() - 2];
  d->half = rc.cols / 2;
  d->positions = d->heads == 0 ? 0 : rc.rows / d->heads;
  return ffi::Error::Success();
}

// cos or sin: float32 (or float64 where allowed, the same for both) holding [T, H].
inline ffi::Error CheckRopeTable(const char* op, const char* name, const ffi::AnyBuffer& table,
                                 const ffi::AnyBuffer& x, const RopeDims& d, bool allow_f64) {
  auto t = table.element_type();
  if (!(t == ffi::DataType::F32 || (allow_f64 && t == ffi::DataType::F64)))
    return InvalidArgument(op, ": ", name, " must be float32",
                           allow_f64 ? " (or float64 with float64 x)" : "", ", got ",
                           DtypeName(t));
  auto dims = table.dimensions();
  const size_t r = dims.size();
  bool ok = r >= 2 && dims[r - 2] == d.seq && dims[r - 1] == d.half;
  for (size_t i = 0; ok && i + 2 < r; ++i) ok = dims[i] == 1;
  if (!ok)
    return InvalidArgument(op, ": ", name, " has shape ", ShapeString(table), " but x has shape ",
                           ShapeString(x), "; ", name, " must be [T, D/2] = [", d.seq, ", ",
                           d.half, "] (one row per position, shared by every head)");
  return ffi::Error::Success();
}

// x, cos, sin, and the result checked together.
inline ffi::Error CheckRope(const char* op, const char* in_name, const ffi::AnyBuffer& x,
                            const ffi::AnyBuffer& cos, const ffi::AnyBuffer& sin,
                            const char* out_name, const ffi::AnyBuffer& y, bool allow_f64,
                            RopeDims* d) {
  BLUJAX_RETURN_IF_ERROR(CheckRopeInput(op, in_name, x, allow_f64, d));
  const bool f64 = allow_f64 && x.element_type() == ffi::DataType::F64;
  BLUJAX_RETURN_IF_ERROR(CheckRopeTable(op, "cos", cos, x, *d, f64));
  BLUJAX_RETURN_IF_ERROR(CheckRopeTable(op, "sin", sin, x, *d, f64));
  if (sin.element_type() != cos.element_type())
    return InvalidArgument(op, ": sin is ", DtypeName(sin.element_type()), " but cos is ",
                           DtypeName(cos.element_type()), "; use one dtype");
  return CheckLike(op, out_name, y, in_name, x);
}

}  // namespace blujax
