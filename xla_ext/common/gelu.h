// The GELU handler contract, shared by xla_ext/cpu/gelu.cc and xla_ext/cuda/gelu.cu.
//
// blujax_gelu_fwd       (x)               -> y
// blujax_gelu_bwd       (dy, x)           -> dx
// blujax_bias_gelu_fwd  (x, bias)         -> y
// blujax_bias_gelu_bwd  (dy, x, bias)     -> (dx, dbias, workspace)
//
// y = gelu(v), the tanh approximation 0.5 v (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3))), with
// v = x + bias computed in float32 (float64 for float64 x) and not rounded to x's dtype before
// GELU; y is rounded to x's dtype once. dx = dy * gelu'(v), rounded once; dbias is the sum of the
// unrounded dx over all rows, rounded once. x is [..., C] (rank >= 1); bias holds C elements
// (leading size-1 axes allowed, which is what vmap's "expand_dims" produces). workspace is
// float32 [P, C], P >= 1: the CUDA backward leaves per-block partial dbias rows there before a
// small reduction over blocks (scratch as an output keeps the handler CUDA-graph safe); the CPU
// backward does not need it.
#pragma once

#include <cstdint>

#include "common/ffi_util.h"

namespace blujax {

// The tanh-approximation constants, as jax.nn.gelu(approximate=True) writes them.
constexpr double kGeluSqrt2OverPi = 0.7978845608028654;
constexpr double kGeluCubic = 0.044715;

inline ffi::Error CheckGeluInput(const char* op, const ffi::AnyBuffer& x, bool allow_f64,
                                 RowsCols* shape) {
  return CheckFloatRows(op, x, allow_f64, shape);
}

inline ffi::Error CheckGeluBias(const char* op, const char* name, const ffi::AnyBuffer& b,
                                const ffi::AnyBuffer& x, int64_t cols) {
  BLUJAX_RETURN_IF_ERROR(CheckDtype(op, name, b, x.element_type()));
  auto dims = b.dimensions();
  if (dims.size() < 1 || dims.back() != cols || static_cast<int64_t>(b.element_count()) != cols)
    return InvalidArgument(op, ": ", name, " has shape ", ShapeString(b), " but x has ", cols,
                           " features (shape ", ShapeString(x), "); ", name, " must hold ", cols,
                           " elements (one bias shared by every row)");
  return ffi::Error::Success();
}

// Returns the number of partial rows P the workspace holds.
inline ffi::Error CheckGeluWorkspace(const char* op, const ffi::AnyBuffer& ws, int64_t cols,
                                     int64_t* partials) {
  BLUJAX_RETURN_IF_ERROR(CheckDtype(op, "workspace", ws, ffi::DataType::F32));
  auto dims = ws.dimensions();
  if (dims.size() != 2 || dims[0] < 1 || dims[1] != cols)
    return InvalidArgument(op, ": workspace must be float32 [P, ", cols,
                           "] with P >= 1, got shape ", ShapeString(ws));
  *partials = dims[0];
  return ffi::Error::Success();
}

// Every operand and result of a forward target, as both platforms' handlers take them:
// blujax_gelu_fwd (bias null) or blujax_bias_gelu_fwd. allow_f64: the backend runs float64 (the
// CPU). Fills rc.
inline ffi::Error CheckGeluFwd(const char* op, bool allow_f64, const ffi::AnyBuffer& x,
                               const ffi::AnyBuffer* bias, const ffi::AnyBuffer& y,
                               RowsCols* rc) {
  BLUJAX_RETURN_IF_ERROR(CheckGeluInput(op, x, allow_f64, rc));
  if (bias) BLUJAX_RETURN_IF_ERROR(CheckGeluBias(op, "bias", *bias, x, rc->cols));
  return CheckLike(op, "y", y, "x", x);
}

// The same for a backward target: blujax_gelu_bwd (bias, dbias and workspace null) or
// blujax_bias_gelu_bwd. Fills rc, and partials with the workspace's partial rows P (0 without
// bias).
inline ffi::Error CheckGeluBwd(const char* op, bool allow_f64, const ffi::AnyBuffer& dy,
                               const ffi::AnyBuffer& x, const ffi::AnyBuffer* bias,
                               const ffi::AnyBuffer& dx, const ffi::AnyBuffer* dbias,
                               const ffi::AnyBuffer* workspace, RowsCols* rc,
                               int64_t* partials) {
  *partials = 0;
  BLUJAX_RETURN_IF_ERROR(CheckGeluInput(op, x, allow_f64, rc));
  BLUJAX_RETURN_IF_ERROR(CheckLike(op, "dy", dy, "x", x));
  BLUJAX_RETURN_IF_ERROR(CheckLike(op, "dx", dx, "x", x));
  if (!bias) return ffi::Error::Success();
  BLUJAX_RETURN_IF_ERROR(CheckGeluBias(op, "bias", *bias, x, rc->cols));
  BLUJAX_RETURN_IF_ERROR(CheckGeluBias(op, "dbias", *dbias, x, rc->cols));
  return CheckGeluWorkspace(op, *workspace, rc->cols, partials);
}

}  // namespace blujax
