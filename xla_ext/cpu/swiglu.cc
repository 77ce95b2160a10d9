// SwiGLU, silu(gate) * up, on the CPU: the reference twin of xla_ext/cuda/swiglu.cu (float32,
// float64 and bfloat16, computed in float32 or float64; the FP8 forms float32 and bfloat16).
// Handler contract: common/swiglu.h.
//
// With g = gate, u = up and s = sigmoid(g) = 1 / (1 + exp(-g)):
//   y = g s u        d gate = dy u s (1 + g (1 - s))        d up = dy g s

#include <cmath>
#include <type_traits>

#include "common/bf16.h"
#include "common/cpu_util.h"
#include "common/ffi_util.h"
#include "common/cpu_fp8.h"
#include "common/registry.h"
#include "common/swiglu.h"

namespace blujax {
namespace {

// 0 for g -> -inf (the reciprocal of inf), 1 for g -> +inf.
template <typename S> inline S Sigmoid(S g) { return S(1) / (S(1) + std::exp(-g)); }

// x rows are [2, F]: gate at [0, F), up at [F, 2F).
template <typename T>
void SwigluFwdRows(const T* x, T* y, int64_t rows, int64_t f) {
  using S = typename Compute<T>::type;
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = x + 2 * f * r;
    const T* up = gate + f;
    T* out = y + f * r;
    for (int64_t c = 0; c < f; ++c) {
      const S g = Load(gate, c);
      Store(out, c, g * Sigmoid(g) * Load(up, c));
    }
  }
}

template <typename T>
void SwigluBwdRows(const T* dy, const T* x, T* dx, int64_t rows, int64_t f) {
  using S = typename Compute<T>::type;
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = x + 2 * f * r;
    const T* up = gate + f;
    const T* d = dy + f * r;
    T* dgate = dx + 2 * f * r;
    T* dup = dgate + f;
    for (int64_t c = 0; c < f; ++c) {
      const S g = Load(gate, c), u = Load(up, c), dv = Load(d, c), s = Sigmoid(g);
      Store(dgate, c, dv * u * s * (S(1) + g * (S(1) - s)));
      Store(dup, c, dv * g * s);
    }
  }
}

template <typename T>
float SwigluFwdFp8Rows(const T* x, float scale, Fp8Format f, uint8_t* q, uint8_t* qt,
                       int64_t rows, int64_t cols) {
  float amax = 0.f;
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = x + 2 * cols * r;
    const T* up = gate + cols;
    for (int64_t c = 0; c < cols; ++c) {
      const float g = Load(gate, c);
      StoreFp8<T>(g * Sigmoid(g) * Load(up, c), scale, f, q, qt, r, c, rows, cols, &amax);
    }
  }
  return amax;
}

template <typename T>
float SwigluBwdFp8Rows(const T* dy, const T* x, float scale, Fp8Format f, uint8_t* q,
                       uint8_t* qt, int64_t rows, int64_t cols) {
  float amax = 0.f;
  const int64_t width = 2 * cols;
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = x + width * r;
    const T* up = gate + cols;
    const T* d = dy + cols * r;
    for (int64_t c = 0; c < cols; ++c) {
      const float g = Load(gate, c), u = Load(up, c), dv = Load(d, c), s = Sigmoid(g);
      StoreFp8<T>(dv * u * s * (1.f + g * (1.f - s)), scale, f, q, qt, r, c, rows, width,
                  &amax);
      StoreFp8<T>(dv * g * s, scale, f, q, qt, r, cols + c, rows, width, &amax);
    }
  }
  return amax;
}

ffi::Error SwigluFwd(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  constexpr const char* op = "blujax_swiglu_fwd";
  SwigluDims d;
  BLUJAX_RETURN_IF_ERROR(CheckSwigluFwd(op, /*allow_f64=*/true, x, *y, &d));
  return DispatchFloat(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    SwigluFwdRows<T>(In<T>(x), Out<T>(y), d.rows, d.cols);
  });
}

ffi::Error SwigluBwd(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> dx) {
  constexpr const char* op = "blujax_swiglu_bwd";
  SwigluDims d;
  BLUJAX_RETURN_IF_ERROR(CheckSwigluBwd(op, /*allow_f64=*/true, dy, x, *dx, &d));
  return DispatchFloat(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    SwigluBwdRows<T>(In<T>(dy), In<T>(x), Out<T>(dx), d.rows, d.cols);
  });
}

ffi::Error SwigluFwdFp8(ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer> q,
                        ffi::Result<ffi::AnyBuffer> qt, ffi::Result<ffi::AnyBuffer> amax) {
  constexpr const char* op = "blujax_swiglu_fwd_fp8";
  SwigluDims d;
  Fp8Format f;
  BLUJAX_RETURN_IF_ERROR(CheckSwigluFwdFp8(op, x, scale, *q, *qt, *amax, &d, &f));
  const float s = *In<float>(scale);
  return DispatchFloat(x.element_type(), [&](auto tag) {  // float64: refused by the check
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, double>)
      *Out<float>(amax) = SwigluFwdFp8Rows<T>(In<T>(x), s, f, Out<uint8_t>(q),
                                              Out<uint8_t>(qt), d.rows, d.cols);
  });
}

ffi::Error SwigluBwdFp8(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer scale,
                        ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> qt,
                        ffi::Result<ffi::AnyBuffer> amax) {
  constexpr const char* op = "blujax_swiglu_bwd_fp8";
  SwigluDims d;
  Fp8Format f;
  BLUJAX_RETURN_IF_ERROR(CheckSwigluBwdFp8(op, dy, x, scale, *q, *qt, *amax, &d, &f));
  const float s = *In<float>(scale);
  return DispatchFloat(x.element_type(), [&](auto tag) {  // float64: refused by the check
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, double>)
      *Out<float>(amax) = SwigluBwdFp8Rows<T>(In<T>(dy), In<T>(x), s, f, Out<uint8_t>(q),
                                              Out<uint8_t>(qt), d.rows, d.cols);
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kSwigluFwd, SwigluFwd,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()   // x [..., 2, F]: (gate, up)
                           .Ret<ffi::AnyBuffer>()); // y [..., F]

XLA_FFI_DEFINE_HANDLER(kSwigluBwd, SwigluBwd,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()   // dy [..., F]
                           .Arg<ffi::AnyBuffer>()   // x [..., 2, F]
                           .Ret<ffi::AnyBuffer>()); // dx [..., 2, F]: (d gate, d up)

XLA_FFI_DEFINE_HANDLER(kSwigluFwdFp8, SwigluFwdFp8,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()   // x [..., 2, F]: (gate, up)
                           .Arg<ffi::AnyBuffer>()   // scale: float32 []
                           .Ret<ffi::AnyBuffer>()   // q [rows, F]: FP8
                           .Ret<ffi::AnyBuffer>()   // qt [F, rows]
                           .Ret<ffi::AnyBuffer>()); // amax: float32 []

XLA_FFI_DEFINE_HANDLER(kSwigluBwdFp8, SwigluBwdFp8,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()   // dy [..., F]
                           .Arg<ffi::AnyBuffer>()   // x [..., 2, F]
                           .Arg<ffi::AnyBuffer>()   // scale: float32 []
                           .Ret<ffi::AnyBuffer>()   // q [rows, 2F]: (d gate, d up), FP8
                           .Ret<ffi::AnyBuffer>()   // qt [2F, rows]
                           .Ret<ffi::AnyBuffer>()); // amax: float32 []

BLUJAX_REGISTER(blujax_swiglu_fwd, kSwigluFwd);
BLUJAX_REGISTER(blujax_swiglu_bwd, kSwigluBwd);
BLUJAX_REGISTER(blujax_swiglu_fwd_fp8, kSwigluFwdFp8);
BLUJAX_REGISTER(blujax_swiglu_bwd_fp8, kSwigluBwdFp8);

}  // namespace blujax
