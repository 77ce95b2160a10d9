// Fused AdamW on the CPU: the reference twin of xla_ext/cuda/adamw.cu (float32, bfloat16 with
// float32 moments, float64 with float64 moments). Handler contract: common/adamw.h.
//
// The arithmetic is written in the order and precision optax.adamw uses (b1, 1 - b1, ... are
// rounded from double to the moment type, as JAX rounds Python floats), with the rewrites XLA
// applies to optax's update: division by a scalar becomes multiplication by its reciprocal, and
// (on a machine with FMA) a*x + b*y becomes fma(a, x, b*y). XLA picks rewrites per program (with
// several leaves it may turn (m/bc1)/d into m/(bc1*d)), so optax's own float32 result moves by
// an ulp from program to program; ours agrees with it to that ulp, and the moments exactly.

#include <cmath>
#include <vector>

#include "common/adamw.h"
#include "common/bf16.h"
#include "common/ffi_util.h"
#include "common/registry.h"

namespace blujax {
namespace {

template <typename T>
void AdamWTensorStep(const AdamWTensor& t, const typename Compute<T>::type* hparams, double b1,
                     double b2, double eps, bool apply) {
  using S = typename Compute<T>::type;
  const S step = -hparams[0], wd = hparams[1], scale = hparams[4];
  const S inv_bc1 = S(1) / hparams[2], inv_bc2 = S(1) / hparams[3];
  const S b1s = static_cast<S>(b1), b2s = static_cast<S>(b2);
  const S one_minus_b1 = static_cast<S>(1.0 - b1), one_minus_b2 = static_cast<S>(1.0 - b2);
  const S eps_s = static_cast<S>(eps);
  const T* p = static_cast<const T*>(t.p);
  const T* g = static_cast<const T*>(t.g);
  // Not restrict: u, m_out and v_out are g, m and v themselves when XLA honours the aliases.
  // Each element is read before it is written.
  const S* m = static_cast<const S*>(t.m);
  const S* v = static_cast<const S*>(t.v);
  T* u = static_cast<T*>(t.u);
  S* m_out = static_cast<S*>(t.m_out);
  S* v_out = static_cast<S*>(t.v_out);
  for (int64_t i = 0; i < t.n; ++i) {
    const S gi = Load(g, i) * scale;
    const S mi = std::fma(one_minus_b1, gi, b1s * m[i]);
    const S vi = std::fma(one_minus_b2, gi * gi, b2s * v[i]);
    S ui = (mi * inv_bc1) / (std::sqrt(vi * inv_bc2) + eps_s);
    // p is read only where it decays or takes the update; with apply it is written over.
    const S pi = wd != S(0) || apply ? static_cast<S>(Load(p, i)) : S(0);
    if (wd != S(0)) ui = std::fma(wd, pi, ui);
    m_out[i] = mi;
    v_out[i] = vi;
    Store(u, i, step * ui);
    // With apply, p + u with u rounded to the parameter dtype first (optax.apply_updates).
    if (apply) Store(u, i, pi + static_cast<S>(Load(u, i)));
  }
}

ffi::Error AdamW(ffi::AnyBuffer hparams, ffi::RemainingArgs args, ffi::RemainingRets rets,
                 double b1, double b2, double eps, bool apply) {
  constexpr const char* op = "blujax_adamw";
  ffi::DataType param;
  std::vector<AdamWTensor> tensors;  // per call: XLA:CPU may run several calls at once
  BLUJAX_RETURN_IF_ERROR(
      CheckAdamW(op, /*allow_f64=*/true, hparams, args, rets, b1, b2, eps, &param, &tensors));
  const float* hp32 = static_cast<const float*>(hparams.untyped_data());
  const double* hp64 = static_cast<const double*>(hparams.untyped_data());
  for (const AdamWTensor& t : tensors) {
    switch (param) {
      case ffi::DataType::F32:
        AdamWTensorStep<float>(t, hp32, b1, b2, eps, apply);
        break;
      case ffi::DataType::BF16:
        AdamWTensorStep<uint16_t>(t, hp32, b1, b2, eps, apply);
        break;
      case ffi::DataType::F64:
        AdamWTensorStep<double>(t, hp64, b1, b2, eps, apply);
        break;
      default:
        return InvalidArgument(op, ": unsupported parameter dtype ", DtypeName(param));
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kAdamW, AdamW,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()  // hparams [5]: lr, wd, bc1, bc2, scale
                           .RemainingArgs()        // p[N], g[N], m[N], v[N]
                           .RemainingRets()        // u[N] (p + u[N] with apply), m'[N], v'[N]
                           .Attr<double>("b1")
                           .Attr<double>("b2")
                           .Attr<double>("eps")
                           .Attr<bool>("apply"));

BLUJAX_REGISTER(blujax_adamw, kAdamW);

}  // namespace blujax
