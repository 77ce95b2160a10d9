// The LayerNorm handler contract, shared by xla_ext/cpu/layernorm.cc and xla_ext/cuda/layernorm.cu.
//
// blujax_layer_norm_fwd      (x, weight, bias)               -> (y, mean, rstd)
// blujax_add_layer_norm_fwd  (x, residual, weight, bias)     -> (y, sum, mean, rstd)
// blujax_layer_norm_bwd      (dy, x, weight, mean, rstd)     -> (dx, dweight, dbias, workspace)
// blujax_add_layer_norm_bwd  (dy, dsum, sum, weight, mean, rstd)
//                                                            -> (dx, dweight, dbias, workspace)
// blujax_add_bias_layer_norm_fwd  (x, x_bias, residual, weight, bias) -> (y, sum, mean, rstd)
// blujax_add_bias_layer_norm_bwd  (dy, dsum, sum, weight, mean, rstd)
//                                               -> (dx, dweight, dbias, dx_bias, workspace)
// x is [..., C] and normalised over its last axis; weight and bias hold C elements (leading
// size-1 axes allowed, which is what vmap's "expand_dims" produces); mean and rstd hold one
// value per row, float32 (float64 for float64 x). The add variant normalises sum = x + residual
// (rounded to x's dtype) and returns sum too. workspace is float32 [P, 2, C]: the CUDA backward
// writes per-block partial dweight/dbias there before a small reduction over blocks (scratch as
// an output keeps the handler CUDA-graph safe); the CPU backward does not need it.
// The add-bias variant folds in the preceding matmul's bias: sum = x + x_bias + residual (x_bias
// [C] broadcast over rows, float32 arithmetic, rounded once), and its backward also returns
// dx_bias = the column sum of dsum + dx, so its workspace is [P, 3, C].
#pragma once

#include <cmath>
#include <cstdint>

#include "common/ffi_util.h"

namespace blujax {

inline ffi::DataType LayerNormStatType(ffi::DataType x) {
  return x == ffi::DataType::F64 ? ffi::DataType::F64 : ffi::DataType::F32;
}

inline ffi::Error CheckLayerNormInput(const char* op, const ffi::AnyBuffer& x, bool allow_f64,
                                      RowsCols* rc) {
  BLUJAX_RETURN_IF_ERROR(CheckFloatRows(op, x, allow_f64, rc));
  if (rc->cols < 1)
    return InvalidArgument(op, ": the normalised axis is empty (x has shape ", ShapeString(x), ")");
  return ffi::Error::Success();
}

inline ffi::Error CheckLayerNormParam(const char* op, const char* name, const ffi::AnyBuffer& p,
                                      const ffi::AnyBuffer& x, int64_t cols) {
  BLUJAX_RETURN_IF_ERROR(CheckDtype(op, name, p, x.element_type()));
  if (static_cast<int64_t>(p.element_count()) != cols || (p.dimensions().size() != 0 &&
                                                          p.dimensions().back() != cols))
    return InvalidArgument(op, ": ", name, " has shape ", ShapeString(p), " but x has ", cols,
                           " features (shape ", ShapeString(x), ")");
  return ffi::Error::Success();
}

inline ffi::Error CheckLayerNormStats(const char* op, const ffi::AnyBuffer& mean,
                                      const ffi::AnyBuffer& rstd, const ffi::AnyBuffer& x,
                                      int64_t rows) {
  auto st = LayerNormStatType(x.element_type());
  BLUJAX_RETURN_IF_ERROR(CheckDtype(op, "mean", mean, st));
  BLUJAX_RETURN_IF_ERROR(CheckDtype(op, "rstd", rstd, st));
  BLUJAX_RETURN_IF_ERROR(CheckCount(op, "mean", mean, rows));
  return CheckCount(op, "rstd", rstd, rows);
}

inline ffi::Error CheckEps(const char* op, float eps) {
  if (!(eps >= 0.0f) || !std::isfinite(eps))
    return InvalidArgument(op, ": eps must be finite and >= 0, got ", eps);
  return ffi::Error::Success();
}

// Returns the number of partial rows P the workspace [P, planes, C] holds.
inline ffi::Error CheckLayerNormWorkspace(const char* op, const ffi::AnyBuffer& ws, int64_t cols,
                                          int64_t* partials, int64_t planes = 2) {
  BLUJAX_RETURN_IF_ERROR(CheckDtype(op, "workspace", ws, ffi::DataType::F32));
  int64_t n = static_cast<int64_t>(ws.element_count());
  if (n < planes * cols || n % (planes * cols) != 0)
    return InvalidArgument(op, ": workspace must hold P x ", planes, " x ", cols,
                           " float32, got shape ", ShapeString(ws));
  *partials = n / (planes * cols);
  return ffi::Error::Success();
}

// Every operand, result and attribute of a forward target, as both platforms' handlers take
// them: blujax_layer_norm_fwd (x_bias, residual and sum null), blujax_add_layer_norm_fwd (x_bias
// null) or blujax_add_bias_layer_norm_fwd. allow_f64: the backend runs float64 (the CPU). Fills
// rc.
inline ffi::Error CheckLayerNormFwd(const char* op, bool allow_f64, const ffi::AnyBuffer& x,
                                    const ffi::AnyBuffer* x_bias, const ffi::AnyBuffer* residual,
                                    const ffi::AnyBuffer& weight, const ffi::AnyBuffer& bias,
                                    const ffi::AnyBuffer& y, const ffi::AnyBuffer* sum,
                                    const ffi::AnyBuffer& mean, const ffi::AnyBuffer& rstd,
                                    float eps, RowsCols* rc) {
  BLUJAX_RETURN_IF_ERROR(CheckLayerNormInput(op, x, allow_f64, rc));
  BLUJAX_RETURN_IF_ERROR(CheckEps(op, eps));
  BLUJAX_RETURN_IF_ERROR(CheckLayerNormParam(op, "weight", weight, x, rc->cols));
  BLUJAX_RETURN_IF_ERROR(CheckLayerNormParam(op, "bias", bias, x, rc->cols));
  if (x_bias) BLUJAX_RETURN_IF_ERROR(CheckLayerNormParam(op, "x_bias", *x_bias, x, rc->cols));
  BLUJAX_RETURN_IF_ERROR(CheckLike(op, "y", y, "x", x));
  if (residual) {
    BLUJAX_RETURN_IF_ERROR(CheckLike(op, "residual", *residual, "x", x));
    BLUJAX_RETURN_IF_ERROR(CheckLike(op, "sum", *sum, "x", x));
  }
  return CheckLayerNormStats(op, mean, rstd, x, rc->rows);
}

// The same for a backward target: blujax_layer_norm_bwd (dsum and dx_bias null),
// blujax_add_layer_norm_bwd (dx_bias null) or blujax_add_bias_layer_norm_bwd; x is the saved
// sum for the add variants. Fills rc, and partials with the workspace's partial rows P.
inline ffi::Error CheckLayerNormBwd(const char* op, bool allow_f64, const ffi::AnyBuffer& dy,
                                    const ffi::AnyBuffer* dsum, const ffi::AnyBuffer& x,
                                    const ffi::AnyBuffer& weight, const ffi::AnyBuffer& mean,
                                    const ffi::AnyBuffer& rstd, const ffi::AnyBuffer& dx,
                                    const ffi::AnyBuffer& dweight, const ffi::AnyBuffer& dbias,
                                    const ffi::AnyBuffer* dx_bias,
                                    const ffi::AnyBuffer& workspace, RowsCols* rc,
                                    int64_t* partials) {
  BLUJAX_RETURN_IF_ERROR(CheckLayerNormInput(op, x, allow_f64, rc));
  BLUJAX_RETURN_IF_ERROR(CheckLike(op, "dy", dy, "x", x));
  if (dsum) BLUJAX_RETURN_IF_ERROR(CheckLike(op, "dsum", *dsum, "x", x));
  BLUJAX_RETURN_IF_ERROR(CheckLayerNormParam(op, "weight", weight, x, rc->cols));
  BLUJAX_RETURN_IF_ERROR(CheckLayerNormStats(op, mean, rstd, x, rc->rows));
  BLUJAX_RETURN_IF_ERROR(CheckLike(op, "dx", dx, "x", x));
  BLUJAX_RETURN_IF_ERROR(CheckLayerNormParam(op, "dweight", dweight, x, rc->cols));
  BLUJAX_RETURN_IF_ERROR(CheckLayerNormParam(op, "dbias", dbias, x, rc->cols));
  if (dx_bias) {
    if (!dsum) return InvalidArgument(op, ": dx_bias needs dsum");  // not reachable from a target
    BLUJAX_RETURN_IF_ERROR(CheckLayerNormParam(op, "dx_bias", *dx_bias, x, rc->cols));
  }
  return CheckLayerNormWorkspace(op, workspace, rc->cols, partials, dx_bias ? 3 : 2);
}

}  // namespace blujax
