// Rotary position embedding on the GPU (float32 and bfloat16 x, float32 cos and sin, computed
// in float32); the CPU twin is xla_ext/cpu/rope.cc and the handler contract common/rope.h.
//
// Memory-bound: x is read once and y written once; cos and sin, [T, D/2], are small and shared
// by every head and batch member, so they are read through the read-only cache. A thread takes
// one 16-byte vector of the half head size H (where H is a whole number of vectors and the
// buffers are 16-byte aligned; one element otherwise) at one position, loads its cos and sin
// once, and turns that vector pair (x[d], x[d + H]) in up to kHeads heads, all loads issued
// before the first use. The grid covers every (position, head group, vector) once (striding
// only past about 2^28 of them). The backward is the same kernel turning the other way.

#include <algorithm>
#include <type_traits>

#include "common/cuda_launch.cuh"
#include "common/cuda_util.cuh"
#include "common/cuda_vec.cuh"
#include "common/registry.h"
#include "common/rope.h"

namespace blujax {
namespace {

constexpr int kThreads = 256;
constexpr int kHeads = 4;  // heads a thread turns with one load of its cos and sin
constexpr int64_t kMaxBlocks = int64_t{1} << 20;

// ----------------------------------------------------------------------------------------------
// Kernel. Item i is vector c = i % vecs (vecs = H / kVec) of head group g = (i / vecs) % groups
// at position p = i / (vecs * groups), whose cos and sin row is t = p % T.

template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads)
RopeKernel(const T* __restrict__ x, const float* __restrict__ cos, const float* __restrict__ sin,
           T* __restrict__ y, int64_t positions, int64_t seq, int64_t heads, int64_t half,
           bool inverse) {
  const int64_t vecs = half / kVec, groups = (heads + kHeads - 1) / kHeads;
  const int64_t items = positions * groups * vecs;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < items;
       i += int64_t(gridDim.x) * kThreads) {
    int64_t c, g, t;
    const int64_t p = DivMod(DivMod(i, vecs, &c), groups, &g);
    DivMod(p, seq, &t);
    const int64_t h0 = g * kHeads;
    const int nh = heads - h0 < kHeads ? static_cast<int>(heads - h0) : kHeads;
    // x[p, h0 + h, c * kVec + k] and its partner H further on.
    const T* in = x + (p * heads + h0) * 2 * half + c * kVec;
    Vec<T, kVec> lo[kHeads], hi[kHeads];
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      if (h < nh) {
        lo[h] = LoadVec<T, kVec>(in + h * 2 * half);
        hi[h] = LoadVec<T, kVec>(in + h * 2 * half + half);
      }
    }
    float cs[kVec], sn[kVec];
    LoadFloats<kVec>(cos + t * half + c * kVec, cs);
    LoadFloats<kVec>(sin + t * half + c * kVec, sn);
    if (inverse) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) sn[k] = -sn[k];
    }
    T* out = y + (p * heads + h0) * 2 * half + c * kVec;
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      if (h < nh) {
        float a[kVec], b[kVec];
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const float x1 = VecElem<T, kVec>(lo[h], k), x2 = VecElem<T, kVec>(hi[h], k);
          a[k] = fmaf(x1, cs[k], -x2 * sn[k]);
          b[k] = fmaf(x2, cs[k], x1 * sn[k]);
        }
        StoreVec<T, kVec>(out + h * 2 * half, a);
        StoreVec<T, kVec>(out + h * 2 * half + half, b);
      }
    }
  }
}

// ----------------------------------------------------------------------------------------------
// Launcher.

template <typename T>
void Launch(cudaStream_t stream, const T* x, const float* cos, const float* sin, T* y,
            const RopeDims& d, bool inverse) {
  constexpr int kPack = Pack<T>::kSize;
  // 16-byte vectors of x and y, and (two for bfloat16) of cos and sin: whole vectors in H keep
  // every row's vectors aligned.
  const bool packed = d.half % kPack == 0 && Aligned16(x) && Aligned16(y) && Aligned16(cos) &&
                      Aligned16(sin);
  auto launch = [&](auto vec) {
    constexpr int kVec = decltype(vec)::value;
    const int64_t items = d.positions * ((d.heads + kHeads - 1) / kHeads) * (d.half / kVec);
    const int64_t blocks = std::min((items + kThreads - 1) / kThreads, kMaxBlocks);
    RopeKernel<T, kVec><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        x, cos, sin, y, d.positions, d.seq, d.heads, d.half, inverse);
  };
  if (packed) launch(std::integral_constant<int, kPack>{});
  else launch(std::integral_constant<int, 1>{});
}

ffi::Error RopeImpl(const char* op, bool inverse, cudaStream_t stream, ffi::AnyBuffer x,
                    ffi::AnyBuffer cos, ffi::AnyBuffer sin, ffi::Result<ffi::AnyBuffer> y) {
  RopeDims d;
  const char* in = inverse ? "dy" : "x";
  const char* out = inverse ? "dx" : "y";
  BLUJAX_RETURN_IF_ERROR(CheckRope(op, in, x, cos, sin, out, *y, /*allow_f64=*/false, &d));
  if (d.positions * d.heads * d.half == 0) return ffi::Error::Success();
  const float* c = static_cast<const float*>(cos.untyped_data());
  const float* s = static_cast<const float*>(sin.untyped_data());
  if (x.element_type() == ffi::DataType::F32) {
    Launch<float>(stream, static_cast<const float*>(x.untyped_data()), c, s,
                  static_cast<float*>(y->untyped_data()), d, inverse);
  } else {
    using B = __nv_bfloat16;
    Launch<B>(stream, static_cast<const B*>(x.untyped_data()), c, s,
              static_cast<B*>(y->untyped_data()), d, inverse);
  }
  return LastCudaError(op);
}

ffi::Error RopeFwd(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer cos,
                   ffi::AnyBuffer sin, ffi::Result<ffi::AnyBuffer> y) {
  return RopeImpl("blujax_rope_fwd", /*inverse=*/false, stream, x, cos, sin, y);
}

ffi::Error RopeBwd(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer cos,
                   ffi::AnyBuffer sin, ffi::Result<ffi::AnyBuffer> dx) {
  return RopeImpl("blujax_rope_bwd", /*inverse=*/true, stream, dy, cos, sin, dx);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kRopeFwd, RopeFwd,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Arg<ffi::AnyBuffer>()   // x [..., T, N, D]
                           .Arg<ffi::AnyBuffer>()   // cos [T, D/2] f32
                           .Arg<ffi::AnyBuffer>()   // sin [T, D/2] f32
                           .Ret<ffi::AnyBuffer>(),  // y [..., T, N, D]
                       kGraphSafe);

XLA_FFI_DEFINE_HANDLER(kRopeBwd, RopeBwd,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Arg<ffi::AnyBuffer>()   // dy [..., T, N, D]
                           .Arg<ffi::AnyBuffer>()   // cos [T, D/2] f32
                           .Arg<ffi::AnyBuffer>()   // sin [T, D/2] f32
                           .Ret<ffi::AnyBuffer>(),  // dx [..., T, N, D]
                       kGraphSafe);

BLUJAX_REGISTER(blujax_rope_fwd, kRopeFwd);
BLUJAX_REGISTER(blujax_rope_bwd, kRopeBwd);

}  // namespace blujax
