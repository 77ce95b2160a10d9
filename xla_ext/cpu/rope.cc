// Rotary position embedding on the CPU: the reference twin of xla_ext/cuda/rope.cu (float32,
// float64 and bfloat16 x, computed in float32 or float64; cos and sin float32, or float64 with
// float64 x). Handler contract: common/rope.h.
//
// Each pair (x[d], x[d + H]) of a head turns by the angle whose cosine and sine are
// cos[t, d], sin[t, d]; the backward turns dy back (sin negated). rope_qkv runs the same loop
// over the parts of a fused QKV row (common/rope.h's RopeLayout): q and k turned, v copied.

#include "common/bf16.h"
#include "common/cpu_util.h"
#include "common/ffi_util.h"
#include "common/registry.h"
#include "common/rope.h"

namespace blujax {
namespace {

template <typename T, typename C>
void TurnPart(const T* src, const C* cos, const C* sin, T* dst, const RopeDims& d,
               const RopePart& part, bool inverse) {
  using S = typename Compute<T>::type;
  const int64_t h = d.half, width = 2 * d.half;
  for (int64_t p = 0; p < d.positions; ++p) {
    const C* cp = cos + (p % d.seq) * h;
    const C* sp = sin + (p % d.seq) * h;
    for (int64_t n = 0; n < part.heads; ++n) {
      const int64_t in = (p * part.src_row + part.src_head + n) * width;
      const int64_t out = (p * part.dst_row + part.dst_head + n) * width;
      for (int64_t k = 0; k < h; ++k) {
        const S x1 = Load(src, in + k), x2 = Load(src, in + h + k);
        if (!part.rotate) {
          Store(dst, out + k, x1);
          Store(dst, out + h + k, x2);
          continue;
        }
        const S c = static_cast<S>(cp[k]);
        const S s = inverse ? -static_cast<S>(sp[k]) : static_cast<S>(sp[k]);
        Store(dst, out + k, x1 * c - x2 * s);
        Store(dst, out + h + k, x2 * c + x1 * s);
      }
    }
  }
}

// Every part of `layout` from src[s] to dst[s], in x's dtype and the tables'.
ffi::Error RopeParts(ffi::DataType type, const RopeLayout& layout, const void* const* src,
                     void* const* dst, const ffi::AnyBuffer& cos, const ffi::AnyBuffer& sin,
                     bool inverse) {
  const bool f64_table = cos.element_type() == ffi::DataType::F64;
  return DispatchFloat(type, [&](auto tag) {
    using T = decltype(tag);
    for (int s = 0; s < layout.count; ++s) {
      const T* in = static_cast<const T*>(src[s]);
      T* out = static_cast<T*>(dst[s]);
      if (f64_table)
        TurnPart<T, double>(in, In<double>(cos), In<double>(sin), out, layout.dims,
                             layout.part[s], inverse);
      else
        TurnPart<T, float>(in, In<float>(cos), In<float>(sin), out, layout.dims,
                            layout.part[s], inverse);
    }
  });
}

ffi::Error RopeImpl(const char* op, bool inverse, ffi::AnyBuffer x, ffi::AnyBuffer cos,
                    ffi::AnyBuffer sin, ffi::Result<ffi::AnyBuffer> y) {
  RopeDims d;
  BLUJAX_RETURN_IF_ERROR(CheckRope(op, /*allow_f64=*/true, inverse, x, cos, sin, *y, &d));
  const void* src[1] = {x.untyped_data()};
  void* dst[1] = {y->untyped_data()};
  return RopeParts(x.element_type(), WholeRope(d), src, dst, cos, sin, inverse);
}

ffi::Error RopeFwd(ffi::AnyBuffer x, ffi::AnyBuffer cos, ffi::AnyBuffer sin,
                   ffi::Result<ffi::AnyBuffer> y) {
  return RopeImpl("blujax_rope_fwd", /*inverse=*/false, x, cos, sin, y);
}

ffi::Error RopeBwd(ffi::AnyBuffer dy, ffi::AnyBuffer cos, ffi::AnyBuffer sin,
                   ffi::Result<ffi::AnyBuffer> dx) {
  return RopeImpl("blujax_rope_bwd", /*inverse=*/true, dy, cos, sin, dx);
}

ffi::Error RopeQkvFwd(ffi::AnyBuffer qkv, ffi::AnyBuffer cos, ffi::AnyBuffer sin,
                      ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> k,
                      ffi::Result<ffi::AnyBuffer> v) {
  RopeLayout layout;
  BLUJAX_RETURN_IF_ERROR(CheckRopeQkv("blujax_rope_qkv_fwd", /*allow_f64=*/true, /*split=*/true,
                                      qkv, *q, *k, *v, cos, sin, &layout));
  const void* src[3] = {qkv.untyped_data(), qkv.untyped_data(), qkv.untyped_data()};
  void* dst[3] = {q->untyped_data(), k->untyped_data(), v->untyped_data()};
  return RopeParts(qkv.element_type(), layout, src, dst, cos, sin, /*inverse=*/false);
}

ffi::Error RopeQkvBwd(ffi::AnyBuffer dq, ffi::AnyBuffer dk, ffi::AnyBuffer dv,
                      ffi::AnyBuffer cos, ffi::AnyBuffer sin, ffi::Result<ffi::AnyBuffer> dqkv) {
  RopeLayout layout;
  BLUJAX_RETURN_IF_ERROR(CheckRopeQkv("blujax_rope_qkv_bwd", /*allow_f64=*/true,
                                      /*split=*/false, *dqkv, dq, dk, dv, cos, sin, &layout));
  const void* src[3] = {dq.untyped_data(), dk.untyped_data(), dv.untyped_data()};
  void* dst[3] = {dqkv->untyped_data(), dqkv->untyped_data(), dqkv->untyped_data()};
  return RopeParts(dq.element_type(), layout, src, dst, cos, sin, /*inverse=*/true);
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

XLA_FFI_DEFINE_HANDLER(kRopeQkvFwd, RopeQkvFwd,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()   // qkv [..., T, H + 2 KV, D]
                           .Arg<ffi::AnyBuffer>()   // cos [T, D/2]
                           .Arg<ffi::AnyBuffer>()   // sin [T, D/2]
                           .Ret<ffi::AnyBuffer>()   // q [..., T, H, D], turned
                           .Ret<ffi::AnyBuffer>()   // k [..., T, KV, D], turned
                           .Ret<ffi::AnyBuffer>()); // v [..., T, KV, D]

XLA_FFI_DEFINE_HANDLER(kRopeQkvBwd, RopeQkvBwd,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()   // dq [..., T, H, D]
                           .Arg<ffi::AnyBuffer>()   // dk [..., T, KV, D]
                           .Arg<ffi::AnyBuffer>()   // dv [..., T, KV, D]
                           .Arg<ffi::AnyBuffer>()   // cos [T, D/2]
                           .Arg<ffi::AnyBuffer>()   // sin [T, D/2]
                           .Ret<ffi::AnyBuffer>()); // dqkv [..., T, H + 2 KV, D]

BLUJAX_REGISTER(blujax_rope_fwd, kRopeFwd);
BLUJAX_REGISTER(blujax_rope_bwd, kRopeBwd);
BLUJAX_REGISTER(blujax_rope_qkv_fwd, kRopeQkvFwd);
BLUJAX_REGISTER(blujax_rope_qkv_bwd, kRopeQkvBwd);

}  // namespace blujax
