// Rotary position embedding on the CPU: the reference twin of xla_ext/cuda/rope.cu (float32,
// float64 and bfloat16 x, computed in float32 or float64; cos and sin float32, or float64 with
// float64 x). Handler contract: common/rope.h.
//
// Each pair (x[d], x[d + H]) of a head turns by the angle whose cosine and sine are
// cos[t, d], sin[t, d]; the backward turns dy back (sin negated).

#include "common/bf16.h"
#include "common/cpu_util.h"
#include "common/ffi_util.h"
#include "common/registry.h"
#include "common/rope.h"

namespace blujax {
namespace {

template <typename T, typename C>
void RopeRows(const T* x, const C* cos, const C* sin, T* y, const RopeDims& d, bool inverse) {
  using S = typename Compute<T>::type;
  const int64_t h = d.half, width = 2 * d.half;
  for (int64_t p = 0; p < d.positions; ++p) {
    const C* cp = cos + (p % d.seq) * h;
    const C* sp = sin + (p % d.seq) * h;
    for (int64_t n = 0; n < d.heads; ++n) {
      const int64_t off = (p * d.heads + n) * width;
      for (int64_t k = 0; k < h; ++k) {
        const S c = static_cast<S>(cp[k]);
        const S s = inverse ? -static_cast<S>(sp[k]) : static_cast<S>(sp[k]);
        const S x1 = Load(x, off + k), x2 = Load(x, off + h + k);
        Store(y, off + k, x1 * c - x2 * s);
        Store(y, off + h + k, x2 * c + x1 * s);
      }
    }
  }
}

ffi::Error RopeImpl(const char* op, bool inverse, ffi::AnyBuffer x, ffi::AnyBuffer cos,
                    ffi::AnyBuffer sin, ffi::Result<ffi::AnyBuffer> y) {
  RopeDims d;
  const char* in = inverse ? "dy" : "x";
  const char* out = inverse ? "dx" : "y";
  BLUJAX_RETURN_IF_ERROR(CheckRope(op, in, x, cos, sin, out, *y, /*allow_f64=*/true, &d));
  const bool f64_table = cos.element_type() == ffi::DataType::F64;
  return DispatchFloat(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    if (f64_table)
      RopeRows<T, double>(In<T>(x), In<double>(cos), In<double>(sin), Out<T>(y), d, inverse);
    else
      RopeRows<T, float>(In<T>(x), In<float>(cos), In<float>(sin), Out<T>(y), d, inverse);
  });
}

ffi::Error RopeFwd(ffi::AnyBuffer x, ffi::AnyBuffer cos, ffi::AnyBuffer sin,
                   ffi::Result<ffi::AnyBuffer> y) {
  return RopeImpl("blujax_rope_fwd", /*inverse=*/false, x, cos, sin, y);
}

ffi::Error RopeBwd(ffi::AnyBuffer dy, ffi::AnyBuffer cos, ffi::AnyBuffer sin,
                   ffi::Result<ffi::AnyBuffer> dx) {
  return RopeImpl("blujax_rope_bwd", /*inverse=*/true, dy, cos, sin, dx);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kRopeFwd, RopeFwd,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()   // x [..., T, N, D]
                           .Arg<ffi::AnyBuffer>()   // cos [T, D/2]
                           .Arg<ffi::AnyBuffer>()   // sin [T, D/2]
                           .Ret<ffi::AnyBuffer>()); // y [..., T, N, D]

XLA_FFI_DEFINE_HANDLER(kRopeBwd, RopeBwd,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()   // dy [..., T, N, D]
                           .Arg<ffi::AnyBuffer>()   // cos [T, D/2]
                           .Arg<ffi::AnyBuffer>()   // sin [T, D/2]
                           .Ret<ffi::AnyBuffer>()); // dx [..., T, N, D]

BLUJAX_REGISTER(blujax_rope_fwd, kRopeFwd);
BLUJAX_REGISTER(blujax_rope_bwd, kRopeBwd);

}  // namespace blujax
