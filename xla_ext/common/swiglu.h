// The SwiGLU handler contract, shared by xla_ext/cpu/swiglu.cc and xla_ext/cuda/swiglu.cu.
//
// blujax_swiglu_fwd  (x)      -> y
// blujax_swiglu_bwd  (dy, x)  -> dx
//
// x is [..., 2, F]: (gate, up), the two halves of a fused MLP input projection (h @ W with
// W [C, 2, F]); y and dy are [..., F], dx is like x. With g = gate, u = up, s = sigmoid(g):
//   y        = silu(g) u = g s u
//   d gate   = dy u s (1 + g (1 - s))
//   d up     = dy g s
// computed in float32 (float64 for float64 x) and rounded to x's dtype once. The backward
// recomputes s from x: nothing but x is saved.
//
// The FP8 forms (blujax.fp8's fused MLP) write, instead of y or dx, its FP8 copy, the copy's
// transpose and its amax (common/fp8.h), for the FP8 products that take them:
//
// blujax_swiglu_fwd_fp8  (x, scale)      -> q [rows, F], qt [F, rows], amax
// blujax_swiglu_bwd_fp8  (dy, x, scale)  -> q [rows, 2F], qt [2F, rows], amax
//
// rows the product of x's axes before (2, F); x float32 or bfloat16.
#pragma once

#include <cstdint>

#include "common/ffi_util.h"
#include "common/fp8.h"

namespace blujax {

struct SwigluDims {
  int64_t rows = 0;  // product of the axes before (2, F)
  int64_t cols = 0;  // F
};

// x: [..., 2, F] in a dtype this backend runs.
inline ffi::Error CheckSwigluInput(const char* op, const ffi::AnyBuffer& x, bool allow_f64,
                                   SwigluDims* d) {
  RowsCols rc;
  BLUJAX_RETURN_IF_ERROR(CheckFloatRows(op, x, allow_f64, &rc));
  auto dims = x.dimensions();
  if (dims.size() < 2 || dims[dims.size() - 2] != 2)
    return InvalidArgument(op, ": x must be [..., 2, F] (gate, up), got shape ", ShapeString(x));
  d->cols = rc.cols;
  d->rows = rc.rows / 2;
  return ffi::Error::Success();
}

// y or dy: x's dtype and x's shape without its axis of 2, [..., F].
inline ffi::Error CheckSwigluHalf(const char* op, const char* name, const ffi::AnyBuffer& y,
                                  const ffi::AnyBuffer& x) {
  if (y.element_type() != x.element_type())
    return InvalidArgument(op, ": ", name, " is ", DtypeName(y.element_type()), " but x is ",
                           DtypeName(x.element_type()));
  auto dy = y.dimensions(), dx = x.dimensions();
  bool ok = dy.size() + 1 == dx.size();
  for (size_t i = 0; ok && i < dy.size(); ++i)
    ok = dy[i] == dx[i + (i + 1 == dy.size() ? 1 : 0)];
  if (!ok)
    return InvalidArgument(op, ": ", name, " has shape ", ShapeString(y), " but x has shape ",
                           ShapeString(x), "; ", name, " must be x's shape without its axis of "
                           "2 ([..., F])");
  return ffi::Error::Success();
}

// Every operand and result of blujax_swiglu_fwd, as both platforms' handlers take them.
// allow_f64: the backend runs float64 (the CPU). Fills d.
inline ffi::Error CheckSwigluFwd(const char* op, bool allow_f64, const ffi::AnyBuffer& x,
                                 const ffi::AnyBuffer& y, SwigluDims* d) {
  BLUJAX_RETURN_IF_ERROR(CheckSwigluInput(op, x, allow_f64, d));
  return CheckSwigluHalf(op, "y", y, x);
}

// The same for blujax_swiglu_bwd.
inline ffi::Error CheckSwigluBwd(const char* op, bool allow_f64, const ffi::AnyBuffer& dy,
                                 const ffi::AnyBuffer& x, const ffi::AnyBuffer& dx,
                                 SwigluDims* d) {
  BLUJAX_RETURN_IF_ERROR(CheckSwigluInput(op, x, allow_f64, d));
  BLUJAX_RETURN_IF_ERROR(CheckSwigluHalf(op, "dy", dy, x));
  return CheckLike(op, "dx", dx, "x", x);
}

// blujax_swiglu_fwd_fp8's operands and results. Fills d and format.
inline ffi::Error CheckSwigluFwdFp8(const char* op, const ffi::AnyBuffer& x,
                                    const ffi::AnyBuffer& scale, const ffi::AnyBuffer& q,
                                    const ffi::AnyBuffer& qt, const ffi::AnyBuffer& amax,
                                    SwigluDims* d, Fp8Format* format) {
  BLUJAX_RETURN_IF_ERROR(CheckSwigluInput(op, x, /*allow_f64=*/false, d));
  return CheckFp8Copy(op, scale, q, qt, amax, d->rows, d->cols, format);
}

// blujax_swiglu_bwd_fp8's.
inline ffi::Error CheckSwigluBwdFp8(const char* op, const ffi::AnyBuffer& dy,
                                    const ffi::AnyBuffer& x, const ffi::AnyBuffer& scale,
                                    const ffi::AnyBuffer& q, const ffi::AnyBuffer& qt,
                                    const ffi::AnyBuffer& amax, SwigluDims* d,
                                    Fp8Format* format) {
  BLUJAX_RETURN_IF_ERROR(CheckSwigluInput(op, x, /*allow_f64=*/false, d));
  BLUJAX_RETURN_IF_ERROR(CheckSwigluHalf(op, "dy", dy, x));
  return CheckFp8Copy(op, scale, q, qt, amax, d->rows, 2 * d->cols, format);
}

}  // namespace blujax
