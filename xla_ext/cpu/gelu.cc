// GELU (tanh approximation) of x + bias on the CPU: the reference twin of xla_ext/cuda/gelu.cu
// (float32, float64 and bfloat16, computed in float32 or float64). Handler contract:
// common/gelu.h.
//
// With v = x + bias, u = sqrt(2/pi) (v + 0.044715 v^3) and t = tanh(u):
//   y = 0.5 v (1 + t)
//   gelu'(v) = 0.5 (1 + t) + 0.5 v (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 v^2)
//   dx = dy * gelu'(v)        dbias = sum over rows of dx

#include <cmath>
#include <vector>

#include "common/bf16.h"
#include "common/cpu_util.h"
#include "common/ffi_util.h"
#include "common/gelu.h"
#include "common/registry.h"

namespace blujax {
namespace {

template <typename S> inline S GeluValue(S v) {
  const S u = S(kGeluSqrt2OverPi) * (v + S(kGeluCubic) * v * v * v);
  return S(0.5) * v * (S(1) + std::tanh(u));
}

template <typename S> inline S GeluGrad(S v) {
  const S u = S(kGeluSqrt2OverPi) * (v + S(kGeluCubic) * v * v * v);
  const S t = std::tanh(u);
  return S(0.5) * (S(1) + t) +
         S(0.5) * v * (S(1) - t * t) * S(kGeluSqrt2OverPi) * (S(1) + S(3 * kGeluCubic) * v * v);
}

// bias is null for the plain op.
template <typename T>
void GeluFwdRows(const T* x, const T* bias, T* y, int64_t rows, int64_t cols) {
  using S = typename Compute<T>::type;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t off = r * cols;
    for (int64_t c = 0; c < cols; ++c) {
      S v = Load(x, off + c);
      if (bias) v += Load(bias, c);
      Store(y, off + c, GeluValue(v));
    }
  }
}

// dx, and dbias (when bias is given) summed in double: the sum of the unrounded dx.
template <typename T>
void GeluBwdRows(const T* dy, const T* x, const T* bias, T* dx, T* dbias, int64_t rows,
                 int64_t cols) {
  using S = typename Compute<T>::type;
  std::vector<double> db(bias ? cols : 0, 0.0);  // per call, so calls may run concurrently
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t off = r * cols;
    for (int64_t c = 0; c < cols; ++c) {
      S v = Load(x, off + c);
      if (bias) v += Load(bias, c);
      const S d = Load(dy, off + c) * GeluGrad(v);
      Store(dx, off + c, d);
      if (bias) db[c] += d;
    }
  }
  if (bias)
    for (int64_t c = 0; c < cols; ++c) Store(dbias, c, static_cast<S>(db[c]));
}

ffi::Error GeluFwdImpl(const char* op, ffi::AnyBuffer x, const ffi::AnyBuffer* bias,
                       ffi::Result<ffi::AnyBuffer> y) {
  RowsCols s;
  BLUJAX_RETURN_IF_ERROR(CheckGeluFwd(op, /*allow_f64=*/true, x, bias, *y, &s));
  return DispatchFloat(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    GeluFwdRows<T>(In<T>(x), bias ? In<T>(*bias) : nullptr, Out<T>(y), s.rows, s.cols);
  });
}

ffi::Error GeluBwdImpl(const char* op, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                       const ffi::AnyBuffer* bias, ffi::Result<ffi::AnyBuffer> dx,
                       ffi::Result<ffi::AnyBuffer>* dbias,
                       ffi::Result<ffi::AnyBuffer>* workspace) {
  RowsCols s;
  int64_t partials = 0;  // the CPU needs no workspace, but checks it as the GPU does
  BLUJAX_RETURN_IF_ERROR(CheckGeluBwd(op, /*allow_f64=*/true, dy, x, bias, *dx,
                                      OptionalResult(dbias), OptionalResult(workspace), &s,
                                      &partials));
  return DispatchFloat(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    GeluBwdRows<T>(In<T>(dy), In<T>(x), bias ? In<T>(*bias) : nullptr, Out<T>(dx),
                   bias ? Out<T>(*dbias) : nullptr, s.rows, s.cols);
  });
}

ffi::Error GeluFwd(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  return GeluFwdImpl("blujax_gelu_fwd", x, nullptr, y);
}

ffi::Error BiasGeluFwd(ffi::AnyBuffer x, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y) {
  return GeluFwdImpl("blujax_bias_gelu_fwd", x, &bias, y);
}

ffi::Error GeluBwd(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> dx) {
  return GeluBwdImpl("blujax_gelu_bwd", dy, x, nullptr, dx, nullptr, nullptr);
}

ffi::Error BiasGeluBwd(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer bias,
                       ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dbias,
                       ffi::Result<ffi::AnyBuffer> workspace) {
  return GeluBwdImpl("blujax_bias_gelu_bwd", dy, x, &bias, dx, &dbias, &workspace);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kGeluFwd, GeluFwd,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()   // x [..., C]
                           .Ret<ffi::AnyBuffer>()); // y [..., C]

XLA_FFI_DEFINE_HANDLER(kBiasGeluFwd, BiasGeluFwd,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()   // x [..., C]
                           .Arg<ffi::AnyBuffer>()   // bias [C]
                           .Ret<ffi::AnyBuffer>()); // y [..., C]

XLA_FFI_DEFINE_HANDLER(kGeluBwd, GeluBwd,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()   // dy [..., C]
                           .Arg<ffi::AnyBuffer>()   // x [..., C]
                           .Ret<ffi::AnyBuffer>()); // dx [..., C]

XLA_FFI_DEFINE_HANDLER(kBiasGeluBwd, BiasGeluBwd,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()   // dy [..., C]
                           .Arg<ffi::AnyBuffer>()   // x [..., C]
                           .Arg<ffi::AnyBuffer>()   // bias [C]
                           .Ret<ffi::AnyBuffer>()   // dx [..., C]
                           .Ret<ffi::AnyBuffer>()   // dbias [C]
                           .Ret<ffi::AnyBuffer>()); // workspace [P, C] f32 (unused on CPU)

BLUJAX_REGISTER(blujax_gelu_fwd, kGeluFwd);
BLUJAX_REGISTER(blujax_bias_gelu_fwd, kBiasGeluFwd);
BLUJAX_REGISTER(blujax_gelu_bwd, kGeluBwd);
BLUJAX_REGISTER(blujax_bias_gelu_bwd, kBiasGeluBwd);

}  // namespace blujax
