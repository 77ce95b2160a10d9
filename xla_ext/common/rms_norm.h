// The RMSNorm handler contract, shared by xla_ext/cpu/rms_norm.cc and xla_ext/cuda/rms_norm.cu.
//
// blujax_rms_norm_fwd      (x, weight)                      -> (y, rstd)
// blujax_add_rms_norm_fwd  (x, residual, weight)            -> (y, sum, rstd)
// blujax_rms_norm_bwd      (dy, x, weight, rstd)            -> (dx, dweight, workspace)
// blujax_add_rms_norm_bwd  (dy, dsum, sum, weight, rstd)    -> (dx, dweight, workspace)
// blujax_add_rms_norm_fwd_fp8 (x, residual, weight, scale)  -> (q, qt, amax, sum, rstd)
//
// x is [..., C] and normalised over its last axis: y = x * rstd * weight with
// rstd = 1 / sqrt(mean(x^2) + eps), no mean subtracted and no bias (Llama). weight holds C
// elements of x's dtype (leading size-1 axes allowed, which is what vmap's "expand_dims"
// produces); rstd holds one value per row, float32 (float64 for float64 x). eps is a float64
// attribute: exact for float64 x, rounded to float32 for float32 and bfloat16 (as the jnp spec
// rounds it). The add variant normalises sum = x + residual (rounded to x's dtype, as
// add_layer_norm's sum) and returns sum too; its backward adds dsum, the cotangent of sum, into
// dx, which is then the gradient of both x and residual. workspace is float32 [P, C]: the CUDA
// backward writes a partial dweight row per block there before a small reduction over blocks
// (scratch as an output keeps the handler CUDA-graph safe); the CPU backward does not need it.
//
// The FP8 form of the add variant (float32 and bfloat16 x) writes, instead of y, its FP8 copy
// at `scale` as rows q [N, C] (N the rows of x), the copy's transpose qt [C, N] and y's amax
// (common/fp8.h: y as the plain op writes it in x's dtype), beside sum and rstd as the plain op
// writes them; its backward is the plain one's.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/ffi_util.h"
#include "common/fp8.h"

namespace blujax {

inline ffi::DataType RmsNormStatType(ffi::DataType x) {
  return x == ffi::DataType::F64 ? ffi::DataType::F64 : ffi::DataType::F32;
}

inline ffi::Error CheckRmsNormInput(const char* op, const ffi::AnyBuffer& x, bool allow_f64,
                                    RowsCols* rc) {
  BLUJAX_RETURN_IF_ERROR(CheckFloatRows(op, x, allow_f64, rc));
  if (rc->cols < 1)
    return InvalidArgument(op, ": the normalised axis is empty (x has shape ", ShapeString(x), ")");
  return ffi::Error::Success();
}

// weight, dweight: C elements of x's dtype.
inline ffi::Error CheckRmsNormWeight(const char* op, const char* name, const ffi::AnyBuffer& w,
                                     const ffi::AnyBuffer& x, int64_t cols) {
  BLUJAX_RETURN_IF_ERROR(CheckDtype(op, name, w, x.element_type()));
  if (static_cast<int64_t>(w.element_count()) != cols || (w.dimensions().size() != 0 &&
                                                          w.dimensions().back() != cols))
    return InvalidArgument(op, ": ", name, " has shape ", ShapeString(w), " but x has ", cols,
                           " features (shape ", ShapeString(x), ")");
  return ffi::Error::Success();
}

inline ffi::Error CheckRmsNormRstd(const char* op, const ffi::AnyBuffer& rstd,
                                   const ffi::AnyBuffer& x, int64_t rows) {
  BLUJAX_RETURN_IF_ERROR(CheckDtype(op, "rstd", rstd, RmsNormStatType(x.element_type())));
  return CheckCount(op, "rstd", rstd, rows);
}

inline ffi::Error CheckRmsNormEps(const char* op, double eps) {
  if (!(eps >= 0.0) || !std::isfinite(eps))
    return InvalidArgument(op, ": eps must be finite and >= 0, got ", eps);
  return ffi::Error::Success();
}

// Returns the number of partial rows P the workspace [P, C] holds.
inline ffi::Error CheckRmsNormWorkspace(const char* op, const ffi::AnyBuffer& ws, int64_t cols,
                                        int64_t* partials) {
  BLUJAX_RETURN_IF_ERROR(CheckDtype(op, "workspace", ws, ffi::DataType::F32));
  const int64_t n = static_cast<int64_t>(ws.element_count());
  if (n < cols || n % cols != 0)
    return InvalidArgument(op, ": workspace must hold P x ", cols, " float32, got shape ",
                           ShapeString(ws));
  *partials = n / cols;
  return ffi::Error::Success();
}

// Every operand, result and attribute of a forward target, as both platforms' handlers take
// them: blujax_rms_norm_fwd (residual and sum null) or blujax_add_rms_norm_fwd. allow_f64: the
// backend runs float64 (the CPU). Fills rc.
inline ffi::Error CheckRmsNormFwd(const char* op, bool allow_f64, const ffi::AnyBuffer& x,
                                  const ffi::AnyBuffer* residual, const ffi::AnyBuffer& weight,
                                  const ffi::AnyBuffer& y, const ffi::AnyBuffer* sum,
                                  const ffi::AnyBuffer& rstd, double eps, RowsCols* rc) {
  BLUJAX_RETURN_IF_ERROR(CheckRmsNormInput(op, x, allow_f64, rc));
  BLUJAX_RETURN_IF_ERROR(CheckRmsNormEps(op, eps));
  BLUJAX_RETURN_IF_ERROR(CheckRmsNormWeight(op, "weight", weight, x, rc->cols));
  BLUJAX_RETURN_IF_ERROR(CheckLike(op, "y", y, "x", x));
  if (residual) {
    BLUJAX_RETURN_IF_ERROR(CheckLike(op, "residual", *residual, "x", x));
    BLUJAX_RETURN_IF_ERROR(CheckLike(op, "sum", *sum, "x", x));
  }
  return CheckRmsNormRstd(op, rstd, x, rc->rows);
}

// The same for blujax_add_rms_norm_fwd_fp8 (float32 and bfloat16 x on both platforms). Fills
// rc and format (q's).
inline ffi::Error CheckAddRmsNormFwdFp8(const char* op, const ffi::AnyBuffer& x,
                                        const ffi::AnyBuffer& residual,
                                        const ffi::AnyBuffer& weight, const ffi::AnyBuffer& scale,
                                        const ffi::AnyBuffer& q, const ffi::AnyBuffer& qt,
                                        const ffi::AnyBuffer& amax, const ffi::AnyBuffer& sum,
                                        const ffi::AnyBuffer& rstd, double eps, RowsCols* rc,
                                        Fp8Format* format) {
  BLUJAX_RETURN_IF_ERROR(CheckRmsNormInput(op, x, /*allow_f64=*/false, rc));
  BLUJAX_RETURN_IF_ERROR(CheckRmsNormEps(op, eps));
  BLUJAX_RETURN_IF_ERROR(CheckRmsNormWeight(op, "weight", weight, x, rc->cols));
  BLUJAX_RETURN_IF_ERROR(CheckLike(op, "residual", residual, "x", x));
  BLUJAX_RETURN_IF_ERROR(CheckLike(op, "sum", sum, "x", x));
  BLUJAX_RETURN_IF_ERROR(CheckRmsNormRstd(op, rstd, x, rc->rows));
  return CheckFp8Copy(op, scale, q, qt, amax, rc->rows, rc->cols, format);
}

// The same for a backward target: blujax_rms_norm_bwd (dsum null) or blujax_add_rms_norm_bwd,
// whose x is the saved sum. Fills rc, and partials with the workspace's partial rows P.
inline ffi::Error CheckRmsNormBwd(const char* op, bool allow_f64, const ffi::AnyBuffer& dy,
                                  const ffi::AnyBuffer* dsum, const ffi::AnyBuffer& x,
                                  const ffi::AnyBuffer& weight, const ffi::AnyBuffer& rstd,
                                  const ffi::AnyBuffer& dx, const ffi::AnyBuffer& dweight,
                                  const ffi::AnyBuffer& workspace, RowsCols* rc,
                                  int64_t* partials) {
  BLUJAX_RETURN_IF_ERROR(CheckRmsNormInput(op, x, allow_f64, rc));
  BLUJAX_RETURN_IF_ERROR(CheckLike(op, "dy", dy, "x", x));
  if (dsum) BLUJAX_RETURN_IF_ERROR(CheckLike(op, "dsum", *dsum, "x", x));
  BLUJAX_RETURN_IF_ERROR(CheckRmsNormWeight(op, "weight", weight, x, rc->cols));
  BLUJAX_RETURN_IF_ERROR(CheckRmsNormRstd(op, rstd, x, rc->rows));
  BLUJAX_RETURN_IF_ERROR(CheckLike(op, "dx", dx, "x", x));
  BLUJAX_RETURN_IF_ERROR(CheckRmsNormWeight(op, "dweight", dweight, x, rc->cols));
  return CheckRmsNormWorkspace(op, workspace, rc->cols, partials);
}

}  // namespace blujax
