// The fused AdamW handler contract, shared by xla_ext/cpu/adamw.cc and xla_ext/cuda/adamw.cu.
//
// blujax_adamw (hparams, p_0..p_{N-1}, g_0..g_{N-1}, m_0..m_{N-1}, v_0..v_{N-1})
//           -> (u_0..u_{N-1}, m'_0..m'_{N-1}, v'_0..v'_{N-1})
//    attributes b1, b2, eps (f64), apply (bool)
//
// One call updates N >= 1 tensors that share a parameter dtype and the five hyper-parameters
// hparams = [lr, weight_decay, bias_correction1, bias_correction2, grad_scale] (device values:
// the learning rate, the bias corrections and the clipping scale change every step, so they
// cannot be compile-time attributes). Per element, in the order optax.adamw computes it, on
// g = grad * grad_scale (global-norm clipping folded in; 1 for none):
//   m' = (1 - b1) g + b1 m          v' = (1 - b2) g^2 + b2 v
//   u  = -lr * ((m' / bc1) / (sqrt(v' / bc2) + eps) + weight_decay * p)
// and with `apply` the first results are the new parameters p + u (u rounded to the parameter
// dtype first, as optax.apply_updates adds an update of that dtype) instead of u: one pass
// where clipping, AdamW and applying the update would otherwise read and write the parameters
// and gradients three times. p, g and u have the parameter dtype (float32, bfloat16, or float64
// on the CPU); the moments and hparams are float32 (float64 for float64 parameters). With
// weight_decay == 0 and no `apply`, p is not read.
// The Python wrapper aliases g -> u (p -> p + u with apply), m -> m' and v -> v' (all in
// place); kernels read each element before they write it, so aliased and separate buffers both
// work.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "common/ffi_util.h"

namespace blujax {

constexpr int64_t kAdamWHparams = 5;  // lr, weight_decay, bias_correction1, bias_correction2,
                                      // grad_scale

inline ffi::DataType AdamWMomentType(ffi::DataType param) {
  return param == ffi::DataType::F64 ? ffi::DataType::F64 : ffi::DataType::F32;
}

// One tensor's buffers, as the kernels see them.
struct AdamWTensor {
  const void* p;
  const void* g;
  const void* m;
  const void* v;
  void* u;  // the update, or with `apply` the new parameters
  void* m_out;
  void* v_out;
  int64_t n;
};

inline ffi::Error CheckAdamWAttrs(const char* op, double b1, double b2, double eps) {
  if (!(b1 >= 0.0 && b1 < 1.0)) return InvalidArgument(op, ": b1 must be in [0, 1), got ", b1);
  if (!(b2 >= 0.0 && b2 < 1.0)) return InvalidArgument(op, ": b2 must be in [0, 1), got ", b2);
  if (!(eps >= 0.0) || !std::isfinite(eps))
    return InvalidArgument(op, ": eps must be finite and >= 0, got ", eps);
  return ffi::Error::Success();
}

// Decodes and checks every buffer; on success `tensors` holds one entry per tensor and `param`
// the parameter dtype they share.
inline ffi::Error CollectAdamWTensors(const char* op, const ffi::AnyBuffer& hparams,
                                      const ffi::RemainingArgs& args,
                                      const ffi::RemainingRets& rets, bool allow_f64,
                                      ffi::DataType* param, std::vector<AdamWTensor>* tensors) {
  const size_t n_args = args.size(), n_rets = rets.size();
  if (n_args == 0 || n_args % 4 != 0)
    return InvalidArgument(op, ": expected hparams and 4 buffers (p, g, m, v) per tensor, got ",
                           n_args, " buffers after hparams");
  const size_t count = n_args / 4;
  if (n_rets != 3 * count)
    return InvalidArgument(op, ": ", count, " tensors need ", 3 * count,
                           " results (u, m, v per tensor), got ", n_rets);

  auto first = args.get<ffi::AnyBuffer>(0);
  if (first.has_error()) return first.error();
  *param = first->element_type();
  const bool ok = *param == ffi::DataType::F32 || *param == ffi::DataType::BF16 ||
                  (allow_f64 && *param == ffi::DataType::F64);
  if (!ok)
    return InvalidArgument(op, ": unsupported parameter dtype ", DtypeName(*param),
                           " (this backend supports ",
                           allow_f64 ? "float32, float64 and bfloat16)" : "float32 and bfloat16)");
  const ffi::DataType moment = AdamWMomentType(*param);
  BLUJAX_RETURN_IF_ERROR(CheckDtype(op, "hparams", hparams, moment));
  BLUJAX_RETURN_IF_ERROR(CheckCount(op, "hparams", hparams, kAdamWHparams));

  tensors->clear();
  tensors->reserve(count);
  for (size_t i = 0; i < count; ++i) {
    auto p = args.get<ffi::AnyBuffer>(i);
    auto g = args.get<ffi::AnyBuffer>(count + i);
    auto m = args.get<ffi::AnyBuffer>(2 * count + i);
    auto v = args.get<ffi::AnyBuffer>(3 * count + i);
    auto u = rets.get<ffi::AnyBuffer>(i);
    auto m_out = rets.get<ffi::AnyBuffer>(count + i);
    auto v_out = rets.get<ffi::AnyBuffer>(2 * count + i);
    for (const auto* e : {&p, &g, &m, &v})
      if (e->has_error()) return e->error();
    for (const auto* e : {&u, &m_out, &v_out})
      if (e->has_error()) return e->error();
    if (p->element_type() != *param)
      return InvalidArgument(op, ": all parameters of one call must share a dtype; tensor 0 is ",
                             DtypeName(*param), ", tensor ", i, " is ",
                             DtypeName(p->element_type()));
    BLUJAX_RETURN_IF_ERROR(CheckLike(op, "grad", *g, "param", *p));
    BLUJAX_RETURN_IF_ERROR(CheckDtype(op, "m", *m, moment));
    BLUJAX_RETURN_IF_ERROR(CheckDtype(op, "v", *v, moment));
    const int64_t n = static_cast<int64_t>(p->element_count());
    BLUJAX_RETURN_IF_ERROR(CheckCount(op, "m", *m, n));
    BLUJAX_RETURN_IF_ERROR(CheckCount(op, "v", *v, n));
    BLUJAX_RETURN_IF_ERROR(CheckLike(op, "update", **u, "param", *p));
    BLUJAX_RETURN_IF_ERROR(CheckLike(op, "new m", **m_out, "m", *m));
    BLUJAX_RETURN_IF_ERROR(CheckLike(op, "new v", **v_out, "v", *v));
    tensors->push_back({p->untyped_data(), g->untyped_data(), m->untyped_data(),
                        v->untyped_data(), (*u)->untyped_data(), (*m_out)->untyped_data(),
                        (*v_out)->untyped_data(), n});
  }
  return ffi::Error::Success();
}

// Every operand, result and attribute of blujax_adamw, as both platforms' handlers take them.
// allow_f64: the backend runs float64 (the CPU). On success `tensors` holds one entry per
// tensor and `param` the parameter dtype they share.
inline ffi::Error CheckAdamW(const char* op, bool allow_f64, const ffi::AnyBuffer& hparams,
                             const ffi::RemainingArgs& args, const ffi::RemainingRets& rets,
                             double b1, double b2, double eps, ffi::DataType* param,
                             std::vector<AdamWTensor>* tensors) {
  BLUJAX_RETURN_IF_ERROR(CheckAdamWAttrs(op, b1, b2, eps));
  return CollectAdamWTensors(op, hparams, args, rets, allow_f64, param, tensors);
}

}  // namespace blujax
