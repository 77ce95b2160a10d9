// LayerNorm on the CPU: the reference twin of xla_ext/cuda/layernorm.cu (float32, float64 and
// bfloat16 with float32 statistics). Handler contract: common/layernorm.h.
//
// y = (x - mean) * rstd * weight + bias, with mean and var = mean((x - mean)^2) over the last axis
// (two passes, as the jnp spec computes them) and rstd = 1 / sqrt(var + eps).
// Backward, per row, with xhat = (x - mean) * rstd and g = dy * weight:
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat))      dweight += dy * xhat    dbias += dy
// The add variants normalise sum = x [+ x_bias] + residual; their dx adds dsum, and with x_bias
// dx_bias += dx (the whole gradient of the sum, column by column).

#include <cmath>
#include <vector>

#include "common/bf16.h"
#include "common/cpu_util.h"
#include "common/ffi_util.h"
#include "common/layernorm.h"
#include "common/registry.h"

namespace blujax {
namespace {

// Normalises `rows` rows; `residual`/`sum` are null for the plain op, `x_bias` is null but for
// the add-bias op.
template <typename T>
void LayerNormFwdRows(const T* x, const T* x_bias, const T* residual, const T* weight,
                      const T* bias, T* y, T* sum, typename Compute<T>::type* mean,
                      typename Compute<T>::type* rstd, int64_t rows, int64_t cols, float eps) {
  using S = typename Compute<T>::type;
  std::vector<S> v(cols);  // this row in compute precision; per call, so calls may run concurrently
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t off = r * cols;
    S total = 0;
    for (int64_t c = 0; c < cols; ++c) {
      S a = Load(x, off + c);
      if (residual) {
        if (x_bias) a += Load(x_bias, c);
        // The sum is rounded to T first, so the statistics are those of the returned sum.
        Store(sum, off + c, a + Load(residual, off + c));
        a = Load(sum, off + c);
      }
      v[c] = a;
      total += a;
    }
    const S m = total / static_cast<S>(cols);
    S var = 0;
    for (int64_t c = 0; c < cols; ++c) var += (v[c] - m) * (v[c] - m);
    var /= static_cast<S>(cols);
    const S rs = S(1) / std::sqrt(var + static_cast<S>(eps));
    for (int64_t c = 0; c < cols; ++c)
      Store(y, off + c, (v[c] - m) * rs * Load(weight, c) + Load(bias, c));
    mean[r] = m;
    rstd[r] = rs;
  }
}

// dx (plus dsum for the add variants), and dweight/dbias (and dx_bias when not null)
// accumulated in compute precision.
template <typename T>
void LayerNormBwdRows(const T* dy, const T* dsum, const T* x, const T* weight,
                      const typename Compute<T>::type* mean, const typename Compute<T>::type* rstd,
                      T* dx, T* dweight, T* dbias, T* dx_bias, int64_t rows, int64_t cols) {
  using S = typename Compute<T>::type;
  std::vector<S> dw(cols, S(0)), db(cols, S(0)), dxb(dx_bias ? cols : 0, S(0)), w(cols);
  for (int64_t c = 0; c < cols; ++c) w[c] = Load(weight, c);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t off = r * cols;
    const S m = mean[r], rs = rstd[r];
    S sum_g = 0, sum_gx = 0;
    for (int64_t c = 0; c < cols; ++c) {
      const S d = Load(dy, off + c), xhat = (Load(x, off + c) - m) * rs, g = d * w[c];
      sum_g += g;
      sum_gx += g * xhat;
      dw[c] += d * xhat;
      db[c] += d;
    }
    const S mg = sum_g / static_cast<S>(cols), mgx = sum_gx / static_cast<S>(cols);
    for (int64_t c = 0; c < cols; ++c) {
      const S xhat = (Load(x, off + c) - m) * rs;
      S d = rs * (Load(dy, off + c) * w[c] - mg - xhat * mgx);
      if (dsum) d += Load(dsum, off + c);
      if (dx_bias) dxb[c] += d;  // before rounding, as dweight/dbias
      Store(dx, off + c, d);
    }
  }
  for (int64_t c = 0; c < cols; ++c) {
    Store(dweight, c, dw[c]);
    Store(dbias, c, db[c]);
    if (dx_bias) Store(dx_bias, c, dxb[c]);
  }
}

// residual/sum are null for the plain op; x_bias is null but for the add-bias op.
ffi::Error LayerNormFwdImpl(const char* op, ffi::AnyBuffer x, const ffi::AnyBuffer* x_bias,
                            const ffi::AnyBuffer* residual, ffi::AnyBuffer weight,
                            ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y,
                            ffi::Result<ffi::AnyBuffer>* sum, ffi::Result<ffi::AnyBuffer> mean,
                            ffi::Result<ffi::AnyBuffer> rstd, float eps) {
  RowsCols rc;
  BLUJAX_RETURN_IF_ERROR(CheckLayerNormFwd(op, /*allow_f64=*/true, x, x_bias, residual, weight,
                                           bias, *y, OptionalResult(sum), *mean, *rstd, eps,
                                           &rc));
  return DispatchFloat(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    using S = typename Compute<T>::type;
    LayerNormFwdRows<T>(In<T>(x), x_bias ? In<T>(*x_bias) : nullptr,
                        residual ? In<T>(*residual) : nullptr, In<T>(weight), In<T>(bias),
                        Out<T>(y), sum ? Out<T>(*sum) : nullptr, Out<S>(mean), Out<S>(rstd),
                        rc.rows, rc.cols, eps);
  });
}

// dsum is null for the plain op; dx_bias is null but for the add-bias op.
ffi::Error LayerNormBwdImpl(const char* op, ffi::AnyBuffer dy, const ffi::AnyBuffer* dsum,
                            ffi::AnyBuffer x, ffi::AnyBuffer weight, ffi::AnyBuffer mean,
                            ffi::AnyBuffer rstd, ffi::Result<ffi::AnyBuffer> dx,
                            ffi::Result<ffi::AnyBuffer> dweight, ffi::Result<ffi::AnyBuffer> dbias,
                            ffi::Result<ffi::AnyBuffer>* dx_bias,
                            ffi::Result<ffi::AnyBuffer> workspace) {
  RowsCols rc;
  int64_t partials = 0;  // the CPU needs no workspace, but checks it as the GPU does
  BLUJAX_RETURN_IF_ERROR(CheckLayerNormBwd(op, /*allow_f64=*/true, dy, dsum, x, weight, mean,
                                           rstd, *dx, *dweight, *dbias, OptionalResult(dx_bias),
                                           *workspace, &rc, &partials));
  return DispatchFloat(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    using S = typename Compute<T>::type;
    LayerNormBwdRows<T>(In<T>(dy), dsum ? In<T>(*dsum) : nullptr, In<T>(x), In<T>(weight),
                        In<S>(mean), In<S>(rstd), Out<T>(dx), Out<T>(dweight), Out<T>(dbias),
                        dx_bias ? Out<T>(*dx_bias) : nullptr, rc.rows, rc.cols);
  });
}

ffi::Error LayerNormFwd(ffi::AnyBuffer x, ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                        ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> mean,
                        ffi::Result<ffi::AnyBuffer> rstd, float eps) {
  return LayerNormFwdImpl("blujax_layer_norm_fwd", x, nullptr, nullptr, weight, bias, y, nullptr,
                          mean, rstd, eps);
}

ffi::Error AddLayerNormFwd(ffi::AnyBuffer x, ffi::AnyBuffer residual, ffi::AnyBuffer weight,
                           ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y,
                           ffi::Result<ffi::AnyBuffer> sum, ffi::Result<ffi::AnyBuffer> mean,
                           ffi::Result<ffi::AnyBuffer> rstd, float eps) {
  return LayerNormFwdImpl("blujax_add_layer_norm_fwd", x, nullptr, &residual, weight, bias, y,
                          &sum, mean, rstd, eps);
}

ffi::Error AddBiasLayerNormFwd(ffi::AnyBuffer x, ffi::AnyBuffer x_bias, ffi::AnyBuffer residual,
                               ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                               ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> sum,
                               ffi::Result<ffi::AnyBuffer> mean, ffi::Result<ffi::AnyBuffer> rstd,
                               float eps) {
  return LayerNormFwdImpl("blujax_add_bias_layer_norm_fwd", x, &x_bias, &residual, weight, bias,
                          y, &sum, mean, rstd, eps);
}

ffi::Error LayerNormBwd(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer weight,
                        ffi::AnyBuffer mean, ffi::AnyBuffer rstd, ffi::Result<ffi::AnyBuffer> dx,
                        ffi::Result<ffi::AnyBuffer> dweight, ffi::Result<ffi::AnyBuffer> dbias,
                        ffi::Result<ffi::AnyBuffer> workspace) {
  return LayerNormBwdImpl("blujax_layer_norm_bwd", dy, nullptr, x, weight, mean, rstd, dx,
                          dweight, dbias, nullptr, workspace);
}

ffi::Error AddLayerNormBwd(ffi::AnyBuffer dy, ffi::AnyBuffer dsum, ffi::AnyBuffer sum,
                           ffi::AnyBuffer weight, ffi::AnyBuffer mean, ffi::AnyBuffer rstd,
                           ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dweight,
                           ffi::Result<ffi::AnyBuffer> dbias,
                           ffi::Result<ffi::AnyBuffer> workspace) {
  return LayerNormBwdImpl("blujax_add_layer_norm_bwd", dy, &dsum, sum, weight, mean, rstd, dx,
                          dweight, dbias, nullptr, workspace);
}

ffi::Error AddBiasLayerNormBwd(ffi::AnyBuffer dy, ffi::AnyBuffer dsum, ffi::AnyBuffer sum,
                               ffi::AnyBuffer weight, ffi::AnyBuffer mean, ffi::AnyBuffer rstd,
                               ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dweight,
                               ffi::Result<ffi::AnyBuffer> dbias,
                               ffi::Result<ffi::AnyBuffer> dx_bias,
                               ffi::Result<ffi::AnyBuffer> workspace) {
  return LayerNormBwdImpl("blujax_add_bias_layer_norm_bwd", dy, &dsum, sum, weight, mean, rstd,
                          dx, dweight, dbias, &dx_bias, workspace);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kLayerNormFwd, LayerNormFwd,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()   // x [..., C]
                           .Arg<ffi::AnyBuffer>()   // weight [C]
                           .Arg<ffi::AnyBuffer>()   // bias [C]
                           .Ret<ffi::AnyBuffer>()   // y [..., C]
                           .Ret<ffi::AnyBuffer>()   // mean [...]
                           .Ret<ffi::AnyBuffer>()   // rstd [...]
                           .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER(kAddLayerNormFwd, AddLayerNormFwd,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()   // x [..., C]
                           .Arg<ffi::AnyBuffer>()   // residual [..., C]
                           .Arg<ffi::AnyBuffer>()   // weight [C]
                           .Arg<ffi::AnyBuffer>()   // bias [C]
                           .Ret<ffi::AnyBuffer>()   // y [..., C]
                           .Ret<ffi::AnyBuffer>()   // sum = x + residual [..., C]
                           .Ret<ffi::AnyBuffer>()   // mean [...]
                           .Ret<ffi::AnyBuffer>()   // rstd [...]
                           .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER(kLayerNormBwd, LayerNormBwd,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()   // dy [..., C]
                           .Arg<ffi::AnyBuffer>()   // x [..., C]
                           .Arg<ffi::AnyBuffer>()   // weight [C]
                           .Arg<ffi::AnyBuffer>()   // mean [...]
                           .Arg<ffi::AnyBuffer>()   // rstd [...]
                           .Ret<ffi::AnyBuffer>()   // dx [..., C]
                           .Ret<ffi::AnyBuffer>()   // dweight [C]
                           .Ret<ffi::AnyBuffer>()   // dbias [C]
                           .Ret<ffi::AnyBuffer>()); // workspace [P, 2, C] f32 (unused on CPU)

XLA_FFI_DEFINE_HANDLER(kAddLayerNormBwd, AddLayerNormBwd,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()   // dy [..., C]
                           .Arg<ffi::AnyBuffer>()   // dsum [..., C], cotangent of the sum output
                           .Arg<ffi::AnyBuffer>()   // sum [..., C]
                           .Arg<ffi::AnyBuffer>()   // weight [C]
                           .Arg<ffi::AnyBuffer>()   // mean [...]
                           .Arg<ffi::AnyBuffer>()   // rstd [...]
                           .Ret<ffi::AnyBuffer>()   // dx = dresidual [..., C]
                           .Ret<ffi::AnyBuffer>()   // dweight [C]
                           .Ret<ffi::AnyBuffer>()   // dbias [C]
                           .Ret<ffi::AnyBuffer>()); // workspace [P, 2, C] f32 (unused on CPU)

XLA_FFI_DEFINE_HANDLER(kAddBiasLayerNormFwd, AddBiasLayerNormFwd,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()   // x [..., C]
                           .Arg<ffi::AnyBuffer>()   // x_bias [C], the preceding matmul's bias
                           .Arg<ffi::AnyBuffer>()   // residual [..., C]
                           .Arg<ffi::AnyBuffer>()   // weight [C]
                           .Arg<ffi::AnyBuffer>()   // bias [C]
                           .Ret<ffi::AnyBuffer>()   // y [..., C]
                           .Ret<ffi::AnyBuffer>()   // sum = x + x_bias + residual [..., C]
                           .Ret<ffi::AnyBuffer>()   // mean [...]
                           .Ret<ffi::AnyBuffer>()   // rstd [...]
                           .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER(kAddBiasLayerNormBwd, AddBiasLayerNormBwd,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()   // dy [..., C]
                           .Arg<ffi::AnyBuffer>()   // dsum [..., C], cotangent of the sum output
                           .Arg<ffi::AnyBuffer>()   // sum [..., C]
                           .Arg<ffi::AnyBuffer>()   // weight [C]
                           .Arg<ffi::AnyBuffer>()   // mean [...]
                           .Arg<ffi::AnyBuffer>()   // rstd [...]
                           .Ret<ffi::AnyBuffer>()   // dx = dresidual [..., C]
                           .Ret<ffi::AnyBuffer>()   // dweight [C]
                           .Ret<ffi::AnyBuffer>()   // dbias [C]
                           .Ret<ffi::AnyBuffer>()   // dx_bias [C] = column sums of dx
                           .Ret<ffi::AnyBuffer>()); // workspace [P, 3, C] f32 (unused on CPU)

BLUJAX_REGISTER(blujax_layer_norm_fwd, kLayerNormFwd);
BLUJAX_REGISTER(blujax_add_layer_norm_fwd, kAddLayerNormFwd);
BLUJAX_REGISTER(blujax_layer_norm_bwd, kLayerNormBwd);
BLUJAX_REGISTER(blujax_add_layer_norm_bwd, kAddLayerNormBwd);
BLUJAX_REGISTER(blujax_add_bias_layer_norm_fwd, kAddBiasLayerNormFwd);
BLUJAX_REGISTER(blujax_add_bias_layer_norm_bwd, kAddBiasLayerNormBwd);

}  // namespace blujax
