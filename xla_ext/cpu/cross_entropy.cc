// Softmax cross-entropy on the CPU: the reference twin of xla_ext/cuda/cross_entropy.cu (float32,
// float64, and bfloat16 with float32 arithmetic). Handler contract: common/cross_entropy.h.
//
// Per row: m = max(x), s = sum(exp(x - m)), lse = m + log(s), loss = lse - x[target].
// Backward, per element: dlogits = (exp(x - lse) - [c == target]) * g, in one pass; it reads
// x[c] before writing dlogits[c], so dlogits may alias the logits buffer.
// loss_grad does both for one row at a time (the gradient of a mean, g = scale, known before
// the backward): the row is read twice here, but from the cache, and written once.

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/bf16.h"
#include "common/cpu_util.h"
#include "common/cross_entropy.h"
#include "common/ffi_util.h"
#include "common/registry.h"

namespace blujax {
namespace {

template <typename T> using Stat = typename Compute<T>::type;

// The row's max (floored at the most negative finite value, so that exp(x - max) of a row of
// -inf is 0, not NaN) and sum(exp(x - max)). Several partial sums keep the rounding error of a
// 50k-element sum small (the GPU sums in a tree, too).
template <typename T>
void RowMaxSum(const T* row, int64_t vocab, Stat<T>* max_out, Stat<T>* sum_out) {
  using S = Stat<T>;
  S m = std::numeric_limits<S>::lowest();
  for (int64_t c = 0; c < vocab; ++c) {
    const S v = Load(row, c);
    m = v > m ? v : m;  // NaN never wins the max; it makes the sum NaN below
  }
  constexpr int kLanes = 8;
  S part[kLanes] = {};
  int64_t c = 0;
  for (; c + kLanes <= vocab; c += kLanes)
    for (int k = 0; k < kLanes; ++k) part[k] += std::exp(Load(row, c + k) - m);
  for (; c < vocab; ++c) part[0] += std::exp(Load(row, c) - m);
  S s = 0;
  for (int k = 0; k < kLanes; ++k) s += part[k];
  *max_out = m;
  *sum_out = s;
}

template <typename T>
void CrossEntropyFwdRows(const T* logits, const int32_t* targets, Stat<T>* loss, Stat<T>* lse,
                         CrossEntropyShape shape, int64_t ignore_index, int64_t num_classes,
                         int64_t r0, int64_t r1) {
  using S = Stat<T>;
  const S nan = std::numeric_limits<S>::quiet_NaN();
  const int64_t cols = ValidColumns(num_classes, 0, shape.vocab);
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t t = targets[r];
    if (t == ignore_index) {  // no gradient either, so the row is not even read
      loss[r] = 0;
      lse[r] = 0;
      continue;
    }
    if (t < 0 || t >= cols) {
      loss[r] = nan;
      lse[r] = nan;
      continue;
    }
    const T* row = logits + r * shape.vocab;
    S m, s;
    RowMaxSum(row, cols, &m, &s);
    lse[r] = m + std::log(s);
    loss[r] = lse[r] - Load(row, t);
  }
}

template <typename T>
void CrossEntropyStatsRows(const T* logits, const int32_t* targets, const int32_t* vocab_start,
                           int64_t rows_per_start,
                           Stat<T>* row_max, Stat<T>* sum_exp, Stat<T>* target_logit,
                           CrossEntropyShape shape, int64_t num_classes, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* row = logits + r * shape.vocab;
    const int64_t start = vocab_start[r / rows_per_start];
    const int64_t cols = ValidColumns(num_classes, start, shape.vocab);
    RowMaxSum(row, cols, &row_max[r], &sum_exp[r]);
    const int64_t local = int64_t{targets[r]} - start;
    target_logit[r] = local >= 0 && local < cols ? Load(row, local) : Stat<T>(0);
  }
}

// logits and dlogits may be the same buffer.
template <typename T>
void CrossEntropyBwdRows(const T* logits, const int32_t* targets, const Stat<T>* lse,
                         const Stat<T>* g, const int32_t* vocab_start, int64_t rows_per_start,
                         T* dlogits, CrossEntropyShape shape, int64_t ignore_index,
                         int64_t num_classes, int64_t r0, int64_t r1) {
  using S = Stat<T>;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t off = r * shape.vocab;
    if (targets[r] == ignore_index) {
      for (int64_t c = 0; c < shape.vocab; ++c) Store(dlogits, off + c, S(0));
      continue;
    }
    // May be outside [0, cols): then no class of this row is the target.
    const int64_t start = vocab_start[r / rows_per_start];
    const int64_t local = int64_t{targets[r]} - start;
    const int64_t cols = ValidColumns(num_classes, start, shape.vocab);
    const S l = lse[r], gr = g[r];
    for (int64_t c = 0; c < cols; ++c) {
      const S p = std::exp(Load(logits, off + c) - l);
      Store(dlogits, off + c, (p - (c == local ? S(1) : S(0))) * gr);
    }
    for (int64_t c = cols; c < shape.vocab; ++c) Store(dlogits, off + c, S(0));
  }
}

// logits and dlogits may be the same buffer.
template <typename T>
void CrossEntropyLossGradRows(const T* logits, const int32_t* targets, const Stat<T>* scale,
                              int64_t rows_per_scale, Stat<T>* loss, T* dlogits,
                              CrossEntropyShape shape, int64_t ignore_index, int64_t num_classes,
                              int64_t r0, int64_t r1) {
  using S = Stat<T>;
  const S nan = std::numeric_limits<S>::quiet_NaN();
  const int64_t cols = ValidColumns(num_classes, 0, shape.vocab);
  for (int64_t r = r0; r < r1; ++r) {
    const T* row = logits + r * shape.vocab;
    T* out = dlogits + r * shape.vocab;
    const int64_t t = targets[r];
    if (t == ignore_index || t < 0 || t >= cols) {
      // Ignored: no loss, no gradient. Unknown target: NaN loss and NaN over the classes. The
      // row is not read.
      const bool ignored = t == ignore_index;
      loss[r] = ignored ? S(0) : nan;
      for (int64_t c = 0; c < cols; ++c) Store(out, c, ignored ? S(0) : nan);
      for (int64_t c = cols; c < shape.vocab; ++c) Store(out, c, S(0));
      continue;
    }
    S m, s;
    RowMaxSum(row, cols, &m, &s);
    const S lse = m + std::log(s);
    loss[r] = lse - Load(row, t);  // before the gradient overwrites the target's logit
    const S k = scale[r / rows_per_scale];
    for (int64_t c = 0; c < cols; ++c) {
      const S p = std::exp(Load(row, c) - lse);
      Store(out, c, (p - (c == t ? S(1) : S(0))) * k);
    }
    for (int64_t c = cols; c < shape.vocab; ++c) Store(out, c, S(0));
  }
}

ffi::Error CrossEntropyFwd(ffi::ThreadPool pool, ffi::AnyBuffer logits, ffi::AnyBuffer targets,
                           ffi::Result<ffi::AnyBuffer> loss, ffi::Result<ffi::AnyBuffer> lse,
                           int64_t ignore_index, int64_t num_classes) {
  const char* op = "blujax_cross_entropy_fwd";
  CrossEntropyShape shape;
  BLUJAX_RETURN_IF_ERROR(CheckCrossEntropyFwd(op, /*allow_f64=*/true, logits, targets, *loss, *lse,
                                              num_classes, &shape));
  return DispatchFloat(logits.element_type(), [&](auto tag) {
    using T = decltype(tag);
    ParallelFor(pool, shape.rows, RowGrain(shape.vocab), [&](int64_t r0, int64_t r1) {
      CrossEntropyFwdRows<T>(In<T>(logits), In<int32_t>(targets), Out<Stat<T>>(loss),
                             Out<Stat<T>>(lse), shape, ignore_index, num_classes, r0, r1);
    });
  });
}

ffi::Error CrossEntropyStats(ffi::ThreadPool pool, ffi::AnyBuffer logits, ffi::AnyBuffer targets,
                             ffi::AnyBuffer vocab_start, ffi::Result<ffi::AnyBuffer> row_max,
                             ffi::Result<ffi::AnyBuffer> sum_exp,
                             ffi::Result<ffi::AnyBuffer> target_logit, int64_t num_classes) {
  const char* op = "blujax_cross_entropy_stats";
  CrossEntropyShape shape;
  int64_t rows_per_start = 1;
  BLUJAX_RETURN_IF_ERROR(CheckCrossEntropyStats(op, /*allow_f64=*/true, logits, targets,
                                                vocab_start, *row_max, *sum_exp, *target_logit,
                                                num_classes, &shape, &rows_per_start));
  return DispatchFloat(logits.element_type(), [&](auto tag) {
    using T = decltype(tag);
    ParallelFor(pool, shape.rows, RowGrain(shape.vocab), [&](int64_t r0, int64_t r1) {
      CrossEntropyStatsRows<T>(In<T>(logits), In<int32_t>(targets), In<int32_t>(vocab_start),
                               rows_per_start, Out<Stat<T>>(row_max), Out<Stat<T>>(sum_exp),
                               Out<Stat<T>>(target_logit), shape, num_classes, r0, r1);
    });
  });
}

ffi::Error CrossEntropyBwd(ffi::ThreadPool pool, ffi::AnyBuffer logits, ffi::AnyBuffer targets,
                           ffi::AnyBuffer lse, ffi::AnyBuffer g, ffi::AnyBuffer vocab_start,
                           ffi::Result<ffi::AnyBuffer> dlogits, int64_t ignore_index,
                           int64_t num_classes) {
  const char* op = "blujax_cross_entropy_bwd";
  CrossEntropyShape shape;
  int64_t rows_per_start = 1;
  BLUJAX_RETURN_IF_ERROR(CheckCrossEntropyBwd(op, /*allow_f64=*/true, logits, targets, lse, g,
                                              vocab_start, *dlogits, num_classes, &shape,
                                              &rows_per_start));
  return DispatchFloat(logits.element_type(), [&](auto tag) {
    using T = decltype(tag);
    ParallelFor(pool, shape.rows, RowGrain(shape.vocab), [&](int64_t r0, int64_t r1) {
      CrossEntropyBwdRows<T>(In<T>(logits), In<int32_t>(targets), In<Stat<T>>(lse),
                             In<Stat<T>>(g), In<int32_t>(vocab_start), rows_per_start,
                             Out<T>(dlogits), shape, ignore_index, num_classes, r0, r1);
    });
  });
}

ffi::Error CrossEntropyLossGrad(ffi::ThreadPool pool, ffi::AnyBuffer logits,
                                ffi::AnyBuffer targets, ffi::AnyBuffer scale,
                                ffi::Result<ffi::AnyBuffer> loss,
                                ffi::Result<ffi::AnyBuffer> dlogits, int64_t ignore_index,
                                int64_t num_classes) {
  const char* op = "blujax_cross_entropy_loss_grad";
  CrossEntropyShape shape;
  int64_t rows_per_scale = 1;
  BLUJAX_RETURN_IF_ERROR(CheckCrossEntropyLossGrad(op, /*allow_f64=*/true, logits, targets, scale,
                                                   *loss, *dlogits, num_classes, &shape,
                                                   &rows_per_scale));
  return DispatchFloat(logits.element_type(), [&](auto tag) {
    using T = decltype(tag);
    ParallelFor(pool, shape.rows, RowGrain(shape.vocab), [&](int64_t r0, int64_t r1) {
      CrossEntropyLossGradRows<T>(In<T>(logits), In<int32_t>(targets), In<Stat<T>>(scale),
                                  rows_per_scale, Out<Stat<T>>(loss), Out<T>(dlogits), shape,
                                  ignore_index, num_classes, r0, r1);
    });
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kCrossEntropyFwd, CrossEntropyFwd,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::ThreadPool>()
                           .Arg<ffi::AnyBuffer>()   // logits [..., V]
                           .Arg<ffi::AnyBuffer>()   // targets [...] int32
                           .Ret<ffi::AnyBuffer>()   // loss [...]
                           .Ret<ffi::AnyBuffer>()   // lse [...]
                           .Attr<int64_t>("ignore_index")
                           .Attr<int64_t>("num_classes"));

XLA_FFI_DEFINE_HANDLER(kCrossEntropyStats, CrossEntropyStats,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::ThreadPool>()
                           .Arg<ffi::AnyBuffer>()   // logits [..., V]
                           .Arg<ffi::AnyBuffer>()   // targets [...] int32, global class ids
                           .Arg<ffi::AnyBuffer>()   // vocab_start [] or [K] int32
                           .Ret<ffi::AnyBuffer>()   // row_max [...]
                           .Ret<ffi::AnyBuffer>()   // sum_exp [...]
                           .Ret<ffi::AnyBuffer>()   // target_logit [...]
                           .Attr<int64_t>("num_classes"));

XLA_FFI_DEFINE_HANDLER(kCrossEntropyBwd, CrossEntropyBwd,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::ThreadPool>()
                           .Arg<ffi::AnyBuffer>()   // logits [..., V]
                           .Arg<ffi::AnyBuffer>()   // targets [...] int32, global class ids
                           .Arg<ffi::AnyBuffer>()   // lse [...]
                           .Arg<ffi::AnyBuffer>()   // g [...], the loss cotangent
                           .Arg<ffi::AnyBuffer>()   // vocab_start [] or [K] int32
                           .Ret<ffi::AnyBuffer>()   // dlogits [..., V], may alias logits
                           .Attr<int64_t>("ignore_index")
                           .Attr<int64_t>("num_classes"));

XLA_FFI_DEFINE_HANDLER(kCrossEntropyLossGrad, CrossEntropyLossGrad,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::ThreadPool>()
                           .Arg<ffi::AnyBuffer>()   // logits [..., V]
                           .Arg<ffi::AnyBuffer>()   // targets [...] int32
                           .Arg<ffi::AnyBuffer>()   // scale [] or [K], the gradient's factor
                           .Ret<ffi::AnyBuffer>()   // loss [...]
                           .Ret<ffi::AnyBuffer>()   // dlogits [..., V], may alias logits
                           .Attr<int64_t>("ignore_index")
                           .Attr<int64_t>("num_classes"));

BLUJAX_REGISTER(blujax_cross_entropy_fwd, kCrossEntropyFwd);
BLUJAX_REGISTER(blujax_cross_entropy_stats, kCrossEntropyStats);
BLUJAX_REGISTER(blujax_cross_entropy_bwd, kCrossEntropyBwd);
BLUJAX_REGISTER(blujax_cross_entropy_loss_grad, kCrossEntropyLossGrad);

}  // namespace blujax
