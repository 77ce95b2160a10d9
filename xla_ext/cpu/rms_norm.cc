// RMSNorm on the CPU: the reference twin of xla_ext/cuda/rms_norm.cu (float32, float64 and
// bfloat16 with float32 statistics). Handler contract: common/rms_norm.h.
//
// y = x * rstd * weight, with rstd = 1 / sqrt(mean(x^2) + eps) over the last axis.
// Backward, per row, with xhat = x * rstd and g = dy * weight:
//   dx = rstd * (g - xhat * mean(g * xhat))      dweight += dy * xhat
// The add variant normalises sum = x + residual; its dx adds dsum.

#include <cmath>
#include <vector>

#include "common/bf16.h"
#include "common/cpu_util.h"
#include "common/ffi_util.h"
#include "common/registry.h"
#include "common/rms_norm.h"

namespace blujax {
namespace {

// Normalises `rows` rows; `residual`/`sum` are null for the plain op.
template <typename T>
void RmsNormFwdRows(const T* x, const T* residual, const T* weight, T* y, T* sum,
                    typename Compute<T>::type* rstd, int64_t rows, int64_t cols, double eps) {
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
    for (int64_t c = 0; c < cols; ++c) Store(y, off + c, v[c] * rs * Load(weight, c));
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
    RmsNormFwdRows<T>(In<T>(x), residual ? In<T>(*residual) : nullptr, In<T>(weight), Out<T>(y),
                      sum ? Out<T>(*sum) : nullptr, Out<S>(rstd), rc.rows, rc.cols, eps);
  });
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
BLUJAX_REGISTER(blujax_rms_norm_bwd, kRmsNormBwd);
BLUJAX_REGISTER(blujax_add_rms_norm_bwd, kAddRmsNormBwd);

}  // namespace blujax
