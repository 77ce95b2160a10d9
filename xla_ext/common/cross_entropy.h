// The softmax cross-entropy handler contract, shared by xla_ext/cpu/cross_entropy.cc and
// xla_ext/cuda/cross_entropy.cu.
//
// blujax_cross_entropy_fwd   (logits, targets) -> (loss, lse)
// blujax_cross_entropy_stats (logits, targets, vocab_start) -> (row_max, sum_exp, target_logit)
// blujax_cross_entropy_bwd   (logits, targets, lse, g, vocab_start) -> dlogits
// blujax_cross_entropy_loss_grad (logits, targets, scale) -> (loss, dlogits)
//
// logits is [..., V]: every leading index is one row of V classes. targets holds one int32 per
// row. vocab_start is int32 and a device operand (a sharded caller passes axis_index * V):
// either one value for all rows, or K values for the rows split into K equal consecutive
// groups (what vmap's "broadcast_all" makes of a scalar). Per-row results are float32 (float64
// for float64 logits); dlogits is like logits and may alias it (the backward reads each element
// before it writes it).
//
// fwd (attribute ignore_index): lse = log(sum(exp(logits))); loss = lse - logits[target].
//   Rows whose target == ignore_index get loss 0 and lse 0 and are not read; other targets
//   outside [0, V) get loss NaN and lse NaN, so the backward turns their rows into NaN too.
// stats: row_max = max(logits) (at least the most negative finite value, so that a row of -inf
//   combines with others without NaN), sum_exp = sum(exp(logits - row_max)), target_logit =
//   logits[target - vocab_start] when that is in [0, V), else 0. The log-sum-exp over a
//   vocabulary split over devices is M + log(sum_i sum_exp_i * exp(row_max_i - M)) with M the
//   largest row_max.
// Attribute num_classes (all three): only global columns vocab_start + c < num_classes are
//   classes; the rest (a vocabulary padded for the matrix units) are not read by fwd and stats
//   and get a zero gradient from bwd, and a target >= num_classes is outside the vocabulary.
//   ValidColumns gives a row's count of such columns.
// bwd (attribute ignore_index): dlogits = (exp(logits - lse) - [c == target - vocab_start]) * g;
//   rows whose target == ignore_index are zeros (ignore_index is compared with the target as
//   given, before vocab_start is subtracted).
// loss_grad (attributes ignore_index, num_classes): fwd's loss and, in the same pass over each
//   row, bwd's dlogits with g = scale (vocab_start 0): the gradient of a mean (scale = 1/count)
//   while the row is on chip. scale is one value of the statistics dtype for all rows, or K
//   values for K equal groups of rows, as vocab_start. Ignored rows: loss 0, zero gradient;
//   other targets outside [0, num_classes): loss NaN, gradient NaN over the classes and zero
//   beyond. dlogits may alias logits: every element (the target's included, which the loss
//   needs) is read before it is written.
#pragma once

#include <cstdint>
#include <limits>

#include "common/ffi_util.h"

namespace blujax {

struct CrossEntropyShape {
  int64_t rows = 0;
  int64_t vocab = 0;
};

inline ffi::DataType CrossEntropyStatType(ffi::DataType logits) {
  return logits == ffi::DataType::F64 ? ffi::DataType::F64 : ffi::DataType::F32;
}

inline ffi::Error CheckCrossEntropyLogits(const char* op, const ffi::AnyBuffer& logits,
                                          bool allow_f64, CrossEntropyShape* shape) {
  auto t = logits.element_type();
  bool ok = t == ffi::DataType::F32 || t == ffi::DataType::BF16 ||
            (allow_f64 && t == ffi::DataType::F64);
  if (!ok)
    return InvalidArgument(op, ": unsupported logits dtype ", DtypeName(t),
                           " (this backend supports ",
                           allow_f64 ? "float32, float64 and bfloat16)" : "float32 and bfloat16)");
  if (logits.dimensions().size() < 1)
    return InvalidArgument(op, ": logits must have rank >= 1 (the class axis last)");
  shape->vocab = LastDim(logits);
  if (shape->vocab < 1)
    return InvalidArgument(op, ": the class axis of logits is empty (shape ", ShapeString(logits),
                           ")");
  // Targets are int32, so no class index beyond this is reachable; kernels index rows with int.
  if (shape->vocab > std::numeric_limits<int32_t>::max())
    return InvalidArgument(op, ": more than 2^31 - 1 classes");
  shape->rows = static_cast<int64_t>(logits.element_count()) / shape->vocab;
  return ffi::Error::Success();
}

inline ffi::Error CheckCrossEntropyTargets(const char* op, const ffi::AnyBuffer& targets,
                                           const CrossEntropyShape& shape) {
  BLUJAX_RETURN_IF_ERROR(CheckDtype(op, "targets", targets, ffi::DataType::S32));
  return CheckCount(op, "targets", targets, shape.rows);
}

// A per-row float buffer (loss, lse, g, row_max, ...) of the statistics dtype.
inline ffi::Error CheckCrossEntropyRowValues(const char* op, const char* name,
                                             const ffi::AnyBuffer& b, const ffi::AnyBuffer& logits,
                                             const CrossEntropyShape& shape) {
  BLUJAX_RETURN_IF_ERROR(CheckDtype(op, name, b, CrossEntropyStatType(logits.element_type())));
  return CheckCount(op, name, b, shape.rows);
}

// A buffer of one value for all rows, or one per equal group of consecutive rows (what vmap's
// "broadcast_all" makes of a scalar). Returns how many consecutive rows share one value.
inline ffi::Error CheckRowGroupValues(const char* op, const char* name, const ffi::AnyBuffer& b,
                                      ffi::DataType dtype, const CrossEntropyShape& shape,
                                      int64_t* rows_per_value) {
  BLUJAX_RETURN_IF_ERROR(CheckDtype(op, name, b, dtype));
  const int64_t k = static_cast<int64_t>(b.element_count());
  if (k < 1 || (shape.rows > 0 && shape.rows % k != 0))
    return InvalidArgument(op, ": ", name, " has shape ", ShapeString(b),
                           "; it must hold one value, or one per equal group of the ", shape.rows,
                           " rows");
  *rows_per_value = shape.rows > 0 ? shape.rows / k : 1;
  return ffi::Error::Success();
}

// Returns how many consecutive rows share one vocab_start value.
inline ffi::Error CheckVocabStart(const char* op, const ffi::AnyBuffer& vocab_start,
                                  const CrossEntropyShape& shape, int64_t* rows_per_start) {
  return CheckRowGroupValues(op, "vocab_start", vocab_start, ffi::DataType::S32, shape,
                             rows_per_start);
}

// loss_grad's scale: the statistics dtype, one value or one per equal group of rows.
inline ffi::Error CheckCrossEntropyScale(const char* op, const ffi::AnyBuffer& scale,
                                         const ffi::AnyBuffer& logits,
                                         const CrossEntropyShape& shape,
                                         int64_t* rows_per_scale) {
  return CheckRowGroupValues(op, "scale", scale, CrossEntropyStatType(logits.element_type()),
                             shape, rows_per_scale);
}

// The number of leading columns of a row (of `vocab`, starting at global class `vocab_start`)
// that are classes, i.e. below num_classes.
inline int64_t ValidColumns(int64_t num_classes, int64_t vocab_start, int64_t vocab) {
  const int64_t n = num_classes - vocab_start;
  return n < 0 ? 0 : (n > vocab ? vocab : n);
}

inline ffi::Error CheckNumClasses(const char* op, int64_t num_classes) {
  if (num_classes < 1)
    return InvalidArgument(op, ": num_classes must be >= 1, got ", num_classes);
  return ffi::Error::Success();
}

// Every operand, result and attribute of blujax_cross_entropy_fwd, as both platforms' handlers
// take them (ignore_index takes any value). allow_f64: the backend runs float64 (the CPU).
// Fills shape.
inline ffi::Error CheckCrossEntropyFwd(const char* op, bool allow_f64,
                                       const ffi::AnyBuffer& logits,
                                       const ffi::AnyBuffer& targets, const ffi::AnyBuffer& loss,
                                       const ffi::AnyBuffer& lse, int64_t num_classes,
                                       CrossEntropyShape* shape) {
  BLUJAX_RETURN_IF_ERROR(CheckNumClasses(op, num_classes));
  BLUJAX_RETURN_IF_ERROR(CheckCrossEntropyLogits(op, logits, allow_f64, shape));
  BLUJAX_RETURN_IF_ERROR(CheckCrossEntropyTargets(op, targets, *shape));
  BLUJAX_RETURN_IF_ERROR(CheckCrossEntropyRowValues(op, "loss", loss, logits, *shape));
  return CheckCrossEntropyRowValues(op, "lse", lse, logits, *shape);
}

// The same for blujax_cross_entropy_stats; also how many rows share each vocab_start value.
inline ffi::Error CheckCrossEntropyStats(const char* op, bool allow_f64,
                                         const ffi::AnyBuffer& logits,
                                         const ffi::AnyBuffer& targets,
                                         const ffi::AnyBuffer& vocab_start,
                                         const ffi::AnyBuffer& row_max,
                                         const ffi::AnyBuffer& sum_exp,
                                         const ffi::AnyBuffer& target_logit, int64_t num_classes,
                                         CrossEntropyShape* shape, int64_t* rows_per_start) {
  BLUJAX_RETURN_IF_ERROR(CheckNumClasses(op, num_classes));
  BLUJAX_RETURN_IF_ERROR(CheckCrossEntropyLogits(op, logits, allow_f64, shape));
  BLUJAX_RETURN_IF_ERROR(CheckCrossEntropyTargets(op, targets, *shape));
  BLUJAX_RETURN_IF_ERROR(CheckVocabStart(op, vocab_start, *shape, rows_per_start));
  BLUJAX_RETURN_IF_ERROR(CheckCrossEntropyRowValues(op, "row_max", row_max, logits, *shape));
  BLUJAX_RETURN_IF_ERROR(CheckCrossEntropyRowValues(op, "sum_exp", sum_exp, logits, *shape));
  return CheckCrossEntropyRowValues(op, "target_logit", target_logit, logits, *shape);
}

// The same for blujax_cross_entropy_bwd; also how many rows share each vocab_start value.
inline ffi::Error CheckCrossEntropyBwd(const char* op, bool allow_f64,
                                       const ffi::AnyBuffer& logits,
                                       const ffi::AnyBuffer& targets, const ffi::AnyBuffer& lse,
                                       const ffi::AnyBuffer& g, const ffi::AnyBuffer& vocab_start,
                                       const ffi::AnyBuffer& dlogits, int64_t num_classes,
                                       CrossEntropyShape* shape, int64_t* rows_per_start) {
  BLUJAX_RETURN_IF_ERROR(CheckNumClasses(op, num_classes));
  BLUJAX_RETURN_IF_ERROR(CheckCrossEntropyLogits(op, logits, allow_f64, shape));
  BLUJAX_RETURN_IF_ERROR(CheckCrossEntropyTargets(op, targets, *shape));
  BLUJAX_RETURN_IF_ERROR(CheckCrossEntropyRowValues(op, "lse", lse, logits, *shape));
  BLUJAX_RETURN_IF_ERROR(CheckCrossEntropyRowValues(op, "g", g, logits, *shape));
  BLUJAX_RETURN_IF_ERROR(CheckVocabStart(op, vocab_start, *shape, rows_per_start));
  return CheckLike(op, "dlogits", dlogits, "logits", logits);
}

// The same for blujax_cross_entropy_loss_grad; also how many rows share each scale value.
inline ffi::Error CheckCrossEntropyLossGrad(const char* op, bool allow_f64,
                                            const ffi::AnyBuffer& logits,
                                            const ffi::AnyBuffer& targets,
                                            const ffi::AnyBuffer& scale,
                                            const ffi::AnyBuffer& loss,
                                            const ffi::AnyBuffer& dlogits, int64_t num_classes,
                                            CrossEntropyShape* shape, int64_t* rows_per_scale) {
  BLUJAX_RETURN_IF_ERROR(CheckNumClasses(op, num_classes));
  BLUJAX_RETURN_IF_ERROR(CheckCrossEntropyLogits(op, logits, allow_f64, shape));
  BLUJAX_RETURN_IF_ERROR(CheckCrossEntropyTargets(op, targets, *shape));
  BLUJAX_RETURN_IF_ERROR(CheckCrossEntropyScale(op, scale, logits, *shape, rows_per_scale));
  BLUJAX_RETURN_IF_ERROR(CheckCrossEntropyRowValues(op, "loss", loss, logits, *shape));
  return CheckLike(op, "dlogits", dlogits, "logits", logits);
}

}  // namespace blujax
