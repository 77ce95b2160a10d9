// RMSNorm on the CPU: the reference twin of xla_ext/cuda/rms_norm.cu (float32, float64 and
// bfloat16 with float32 statistics). Handler contract: common/rms_norm.h.
//
// y = x * rstd * weight, with rstd = 1 / sqrt(mean(x^2) + eps) over the last axis.
// Backward, per row, with xhat = x * rstd and g = dy * weight:
//   dx = rstd * (g - xhat * mean(g * xhat))      dweight += dy * xhat
// The add variant normalises sum = x + residual; its dx adds dsum. Its FP8 form (float32 and
// bfloat16) runs the same rows but writes y's FP8 copy, transpose and amax instead of y.

#include <cmath>
#include <type_traits>
#include <vector>

#include "common/bf16.h"
#include "common/cpu_util.h"
#include "common/ffi_util.h"
#include "common/cpu_fp8.h"
#include "common/registry.h"
#include "common/rms_norm.h"

namespace blujax {
namespace {

// Normalises `rows` rows, handing y[r, c] in compute precision to emit(r, c, y) (one code
// path for the plain op and the FP8 form, so their sum, rstd and y agree bit for bit);
// `residual`/`sum` are null for the plain op.
template <typename T, typename Emit>
void RmsNormFwdRows(const T* x, const T* residual, const T* weight, T* sum,
                    typename Compute<T>::type* rstd, int64_t rows, int64_t cols, double eps,
                    Emit&& emit) {
  using S = typename Compute<T>::type;
  const S e = static_cast<S>(eps);  // exact for float64, rounded to float otherwise
  std::vector<S> v(cols);  // this row in compute precision; per call, so calls may run concurrently
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t off = r * cols;
    S squares = 0;
    for (int64_t c = 0; c < cols; ++c) {
      S a = Load(x, off + c);
      if (residual) {
        // The sum is rounded to T first, so the statistics are those of the returned sum.
        Store(sum, off + c, a + Load(residual, off + c));
        a = Load(sum, off + c);
      }
      v[c] = a;
      squares += a * a;
    }
    const S rs = S(1) / std::sqrt(squares / static_cast<S>(cols) + e);
    for (int64_t c = 0; c < cols; ++c) emit(r, c, v[c] * rs * Load(weight, c));
    rstd[r] = rs;
  }
}

// dx (plus dsum for the add variant), and dweight accumulated in compute precision.
template <typename T>
void RmsNormBwdRows(const T* dy, const T* dsum, const T* x, const T* weight,
                    const typename Compute<T>::type* rstd, T* dx, T* dweight, int64_t rows,
                    int64_t cols) {
  using S = typename Compute<T>::type;
  std::vector<S> dw(cols, S(0)), w(cols);
  for (int64_t c = 0; c < cols; ++c) w[c] = Load(weight, c);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t off = r * cols;
    const S rs = rstd[r];
    S sum_gx = 0;
    for (int64_t c = 0; c < cols; ++c) {
      const S d = Load(dy, off + c), xhat = Load(x, off + c) * rs;
      sum_gx += d * w[c] * xhat;
      dw[c] += d * xhat;
    }
    const S mgx = sum_gx / static_cast<S>(cols);
    for (int64_t c = 0; c < cols; ++c) {
      const S xhat = Load(x, off + c) * rs;
      S d = rs * (Load(dy, off + c) * w[c] - xhat * mgx);
      if (dsum) d += Load(dsum, off + c);
      Store(dx, off + c, d);
    }
  }
  for (int64_t c = 0; c < cols; ++c) Store(dweight, c, dw[c]);
}

// residual/sum are null for the plain op.
ffi::Error RmsNormFwdImpl(const char* op, ffi::AnyBuffer x, const ffi::AnyBuffer* residual,
                          ffi::AnyBuffer weight, ffi::Result<ffi::AnyBuffer> y,
                          ffi::Result<ffi::AnyBuffer>* sum, ffi::Result<ffi::AnyBuffer> rstd,
                          double eps) {
  RowsCols rc;
  BLUJAX_RETURN_IF_ERROR(CheckRmsNormFwd(op, /*allow_f64=*/true, x, residual, weight, *y,
                                         OptionalResult(sum), *rstd, eps, &rc));
  return DispatchFloat(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    using S = typename Compute<T>::type;
    T* out = Out<T>(y);
    RmsNormFwdRows<T>(In<T>(x), residual ? In<T>(*residual) : nullptr, In<T>(weight),
                      sum ? Out<T>(*sum) : nullptr, Out<S>(rstd), rc.rows, rc.cols, eps,
                      [&](int64_t r, int64_t c, S v) { Store(out, r * rc.cols + c, v); });
  });
}

// y's FP8 copy into q [rows, cols] and qt [cols, rows], and its amax, as swiglu.cc's FP8
// forms write theirs: y rounded to T first, so the copy is the cast of the plain op's y.
template <typename T>
float AddRmsNormFwdFp8Rows(const T* x, const T* residual, const T* weight, T* sum, float* rstd,
                           int64_t rows, int64_t cols, double eps, float scale, Fp8Format f,
                           uint8_t* q, uint8_t* qt) {
  float amax = 0.f;  // also the amax of no rows at all
  RmsNormFwdRows<T>(x, residual, weight, sum, rstd, rows, cols, eps,
                    [&](int64_t r, int64_t c, float v) {
                      StoreFp8<T>(v, scale, f, q, qt, r, c, rows, cols, &amax);
                    });
  return amax;
}

// dsum is null for the plain op.
ffi::Error RmsNormBwdImpl(const char* op, ffi::AnyBuffer dy, const ffi::AnyBuffer* dsum,
                          ffi::AnyBuffer x, ffi::AnyBuffer weight, ffi::AnyBuffer rstd,
                          ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dweight,
                          ffi::Result<ffi::AnyBuffer> workspace) {
  RowsCols rc;
  int64_t partials = 0;  // the CPU needs no workspace, but checks it as the GPU does
  BLUJAX_RETURN_IF_ERROR(CheckRmsNormBwd(op, /*allow_f64=*/true, dy, dsum, x, weight, rstd, *dx,
                                         *dweight, *workspace, &rc, &partials));
  return DispatchFloat(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    using S = typename Compute<T>::type;
    RmsNormBwdRows<T>(In<T>(dy), dsum ? In<T>(*dsum) : nullptr, In<T>(x), In<T>(weight),
                      In<S>(rstd), Out<T>(dx), Out<T>(dweight), rc.rows, rc.cols);
  });
}

ffi::Error RmsNormFwd(ffi::AnyBuffer x, ffi::AnyBuffer weight, ffi::Result<ffi::AnyBuffer> y,
                      ffi::Result<ffi::AnyBuffer> rstd, double eps) {
  return RmsNormFwdImpl("blujax_rms_norm_fwd", x, nullptr, weight, y, nullptr, rstd, eps);
}

ffi::Error AddRmsNormFwd(ffi::AnyBuffer x, ffi::AnyBuffer residual, ffi::AnyBuffer weight,
                         ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> sum,
                         ffi::Result<ffi::AnyBuffer> rstd, double eps) {
  return RmsNormFwdImpl("blujax_add_rms_norm_fwd", x, &residual, weight, y, &sum, rstd, eps);
}

ffi::Error AddRmsNormFwdFp8(ffi::AnyBuffer x, ffi::AnyBuffer residual, ffi::AnyBuffer weight,
                            ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer> q,
                            ffi::Result<ffi::AnyBuffer> qt, ffi::Result<ffi::AnyBuffer> amax,
                            ffi::Result<ffi::AnyBuffer> sum, ffi::Result<ffi::AnyBuffer> rstd,
                            double eps) {
  constexpr const char* op = "blujax_add_rms_norm_fwd_fp8";
  RowsCols rc;
  Fp8Format f;
  BLUJAX_RETURN_IF_ERROR(CheckAddRmsNormFwdFp8(op, x, residual, weight, scale, *q, *qt, *amax,
                                               *sum, *rstd, eps, &rc, &f));
  const float s = *In<float>(scale);
  return DispatchFloat(x.element_type(), [&](auto tag) {  // float64: refused by the check
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, double>)
      *Out<float>(amax) = AddRmsNormFwdFp8Rows<T>(
          In<T>(x), In<T>(residual), In<T>(weight), Out<T>(sum), Out<float>(rstd), rc.rows,
          rc.cols, eps, s, f, Out<uint8_t>(q), Out<uint8_t>(qt));
  });
}

ffi::Error RmsNormBwd(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer weight,
                      ffi::AnyBuffer rstd, ffi::Result<ffi::AnyBuffer> dx,
                      ffi::Result<ffi::AnyBuffer> dweight, ffi::Result<ffi::AnyBuffer> workspace) {
  return RmsNormBwdImpl("blujax_rms_norm_bwd", dy, nullptr, x, weight, rstd, dx, dweight,
                        workspace);
}

ffi::Error AddRmsNormBwd(ffi::AnyBuffer dy, ffi::AnyBuffer dsum, ffi::AnyBuffer sum,
                         ffi::AnyBuffer weight, ffi::AnyBuffer rstd,
                         ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dweight,
                         ffi::Result<ffi::AnyBuffer> workspace) {
  return RmsNormBwdImpl("blujax_add_rms_norm_bwd", dy, &dsum, sum, weight, rstd, dx, dweight,
                        workspace);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kRmsNormFwd, RmsNormFwd,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()   // x [..., C]
                           .Arg<ffi::AnyBuffer>()   // weight [C]
                           .Ret<ffi::AnyBuffer>()   // y [..., C]
                           .Ret<ffi::AnyBuffer>()   // rstd [...]
                           .Attr<double>("eps"));   // f64: exact for f64 x, a float otherwise

XLA_FFI_DEFINE_HANDLER(kAddRmsNormFwd, AddRmsNormFwd,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()   // x [..., C]
                           .Arg<ffi::AnyBuffer>()   // residual [..., C]
                           .Arg<ffi::AnyBuffer>()   // weight [C]
                           .Ret<ffi::AnyBuffer>()   // y [..., C]
                           .Ret<ffi::AnyBuffer>()   // sum = x + residual [..., C]
                           .Ret<ffi::AnyBuffer>()   // rstd [...]
                           .Attr<double>("eps"));   // f64: exact for f64 x, a float otherwise

XLA_FFI_DEFINE_HANDLER(kAddRmsNormFwdFp8, AddRmsNormFwdFp8,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()   // x [..., C]
                           .Arg<ffi::AnyBuffer>()   // residual [..., C]
                           .Arg<ffi::AnyBuffer>()   // weight [C]
                           .Arg<ffi::AnyBuffer>()   // scale: float32 []
                           .Ret<ffi::AnyBuffer>()   // q [N, C]: y's FP8 copy
                           .Ret<ffi::AnyBuffer>()   // qt [C, N]
                           .Ret<ffi::AnyBuffer>()   // amax: float32 []
                           .Ret<ffi::AnyBuffer>()   // sum = x + residual [..., C]
                           .Ret<ffi::AnyBuffer>()   // rstd [...] float32
                           .Attr<double>("eps"));   // f64, rounded to a float

XLA_FFI_DEFINE_HANDLER(kRmsNormBwd, RmsNormBwd,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()   // dy [..., C]
                           .Arg<ffi::AnyBuffer>()   // x [..., C]
                           .Arg<ffi::AnyBuffer>()   // weight [C]
                           .Arg<ffi::AnyBuffer>()   // rstd [...]
                           .Ret<ffi::AnyBuffer>()   // dx [..., C]
                           .Ret<ffi::AnyBuffer>()   // dweight [C]
                           .Ret<ffi::AnyBuffer>()); // workspace [P, C] f32 (unused on CPU)

XLA_FFI_DEFINE_HANDLER(kAddRmsNormBwd, AddRmsNormBwd,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()   // dy [..., C]
                           .Arg<ffi::AnyBuffer>()   // dsum [..., C], cotangent of the sum output
                           .Arg<ffi::AnyBuffer>()   // sum [..., C]
                           .Arg<ffi::AnyBuffer>()   // weight [C]
                           .Arg<ffi::AnyBuffer>()   // rstd [...]
                           .Ret<ffi::AnyBuffer>()   // dx = dresidual [..., C]
                           .Ret<ffi::AnyBuffer>()   // dweight [C]
                           .Ret<ffi::AnyBuffer>()); // workspace [P, C] f32 (unused on CPU)

BLUJAX_REGISTER(blujax_rms_norm_fwd, kRmsNormFwd);
BLUJAX_REGISTER(blujax_add_rms_norm_fwd, kAddRmsNormFwd);
BLUJAX_REGISTER(blujax_add_rms_norm_fwd_fp8, kAddRmsNormFwdFp8);
BLUJAX_REGISTER(blujax_rms_norm_bwd, kRmsNormBwd);
BLUJAX_REGISTER(blujax_add_rms_norm_bwd, kAddRmsNormBwd);

}  // namespace blujax
