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
//
// rope_qkv runs the same kernel over the parts of a fused QKV projection's output (RopeParts):
// the forward reads each token's row of H + 2 KV heads once and writes q and k turned and v
// copied into three arrays; the backward reads dq, dk, dv and writes the row back, dq and dk
// turned back. One launch each way instead of two rope calls and XLA's split and concatenation.

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

// A RopePart (common/rope.h) with its buffers, and the head groups of kHeads it is cut into.
struct Part {
  const void* src;
  void* dst;
  RopePart shape;
  int64_t groups;
};

struct Parts {
  Part part[kMaxRopeParts];
  int count;
  int64_t groups;  // over all parts
};

// Part s by value, picked with selects: a dynamic index into the kernel's parameters would
// copy them to local memory.
__device__ __forceinline__ Part PickPart(const Parts& ps, int s) {
  static_assert(kMaxRopeParts == 3, "PickPart selects among three parts");
  return s == 0 ? ps.part[0] : s == 1 ? ps.part[1] : ps.part[2];
}

// ----------------------------------------------------------------------------------------------
// Kernel. Item i is vector c = i % vecs (vecs = H / kVec) of head group g = (i / vecs) % groups
// (over all parts, part after part) at position p = i / (vecs * groups), whose cos and sin row
// is t = p % T.

template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads)
RopeKernel(Parts parts, const float* __restrict__ cos, const float* __restrict__ sin,
           int64_t positions, int64_t seq, int64_t half, bool inverse) {
  const int64_t vecs = half / kVec, groups = parts.groups;
  const int64_t items = positions * groups * vecs;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < items;
       i += int64_t(gridDim.x) * kThreads) {
    int64_t c, g, t;
    const int64_t p = DivMod(DivMod(i, vecs, &c), groups, &g);
    DivMod(p, seq, &t);
    int s = 0;
    while (s + 1 < parts.count && g >= PickPart(parts, s).groups) g -= PickPart(parts, s++).groups;
    const Part part = PickPart(parts, s);
    const RopePart& ps = part.shape;
    const int64_t h0 = g * kHeads;
    const int nh = ps.heads - h0 < kHeads ? static_cast<int>(ps.heads - h0) : kHeads;
    // src[p, src_head + h0 + h, c * kVec + k] and its partner H further on.
    const T* in = static_cast<const T*>(part.src) + (p * ps.src_row + ps.src_head + h0) * 2 * half +
                  c * kVec;
    T* out = static_cast<T*>(part.dst) + (p * ps.dst_row + ps.dst_head + h0) * 2 * half + c * kVec;
    Vec<T, kVec> lo[kHeads], hi[kHeads];
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      if (h < nh) {
        lo[h] = LoadVec<T, kVec>(in + h * 2 * half);
        hi[h] = LoadVec<T, kVec>(in + h * 2 * half + half);
      }
    }
    if (!ps.rotate) {  // v: copied as it is
#pragma unroll
      for (int h = 0; h < kHeads; ++h) {
        if (h < nh) {
          *reinterpret_cast<Vec<T, kVec>*>(out + h * 2 * half) = lo[h];
          *reinterpret_cast<Vec<T, kVec>*>(out + h * 2 * half + half) = hi[h];
        }
      }
      continue;
    }
    float cs[kVec], sn[kVec];
    LoadFloats<kVec>(cos + t * half + c * kVec, cs);
    LoadFloats<kVec>(sin + t * half + c * kVec, sn);
    if (inverse) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) sn[k] = -sn[k];
    }
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
void Launch(cudaStream_t stream, Parts parts, const float* cos, const float* sin,
            const RopeDims& d, bool inverse) {
  constexpr int kPack = Pack<T>::kSize;
  // 16-byte vectors of x and y, and (two for bfloat16) of cos and sin: whole vectors in H keep
  // every row's vectors aligned.
  bool packed = d.half % kPack == 0 && Aligned16(cos) && Aligned16(sin);
  parts.groups = 0;
  for (int s = 0; s < parts.count; ++s) {
    Part& p = parts.part[s];
    packed = packed && Aligned16(p.src) && Aligned16(p.dst);
    p.groups = (p.shape.heads + kHeads - 1) / kHeads;
    parts.groups += p.groups;
  }
  for (int s = parts.count; s < kMaxRopeParts; ++s) parts.part[s] = parts.part[0];
  auto launch = [&](auto vec) {
    constexpr int kVec = decltype(vec)::value;
    const int64_t items = d.positions * parts.groups * (d.half / kVec);
    const int64_t blocks = std::min((items + kThreads - 1) / kThreads, kMaxBlocks);
    RopeKernel<T, kVec><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        parts, cos, sin, d.positions, d.seq, d.half, inverse);
  };
  if (packed) launch(std::integral_constant<int, kPack>{});
  else launch(std::integral_constant<int, 1>{});
}

// The parts' buffers given, x's dtype dispatched.
ffi::Error LaunchParts(const char* op, cudaStream_t stream, ffi::DataType type,
                       const RopeLayout& layout, const void* const* src, void* const* dst,
                       const ffi::AnyBuffer& cos, const ffi::AnyBuffer& sin, bool inverse) {
  const RopeDims& d = layout.dims;
  if (d.positions * d.half == 0) return ffi::Error::Success();
  Parts parts{};
  parts.count = 0;
  for (int s = 0; s < layout.count; ++s) {
    if (layout.part[s].heads == 0) continue;
    parts.part[parts.count++] = Part{src[s], dst[s], layout.part[s], 0};
  }
  if (parts.count == 0) return ffi::Error::Success();
  const float* c = static_cast<const float*>(cos.untyped_data());
  const float* s = static_cast<const float*>(sin.untyped_data());
  if (type == ffi::DataType::F32) Launch<float>(stream, parts, c, s, d, inverse);
  else Launch<__nv_bfloat16>(stream, parts, c, s, d, inverse);
  return LastCudaError(op);
}

ffi::Error RopeImpl(const char* op, bool inverse, cudaStream_t stream, ffi::AnyBuffer x,
                    ffi::AnyBuffer cos, ffi::AnyBuffer sin, ffi::Result<ffi::AnyBuffer> y) {
  RopeDims d;
  BLUJAX_RETURN_IF_ERROR(CheckRope(op, /*allow_f64=*/false, inverse, x, cos, sin, *y, &d));
  const RopeLayout layout = WholeRope(d);
  const void* src[1] = {x.untyped_data()};
  void* dst[1] = {y->untyped_data()};
  return LaunchParts(op, stream, x.element_type(), layout, src, dst, cos, sin, inverse);
}

ffi::Error RopeFwd(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer cos,
                   ffi::AnyBuffer sin, ffi::Result<ffi::AnyBuffer> y) {
  return RopeImpl("blujax_rope_fwd", /*inverse=*/false, stream, x, cos, sin, y);
}

ffi::Error RopeBwd(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer cos,
                   ffi::AnyBuffer sin, ffi::Result<ffi::AnyBuffer> dx) {
  return RopeImpl("blujax_rope_bwd", /*inverse=*/true, stream, dy, cos, sin, dx);
}

ffi::Error RopeQkvFwd(cudaStream_t stream, ffi::AnyBuffer qkv, ffi::AnyBuffer cos,
                      ffi::AnyBuffer sin, ffi::Result<ffi::AnyBuffer> q,
                      ffi::Result<ffi::AnyBuffer> k, ffi::Result<ffi::AnyBuffer> v) {
  const char* op = "blujax_rope_qkv_fwd";
  RopeLayout layout;
  BLUJAX_RETURN_IF_ERROR(CheckRopeQkv(op, /*allow_f64=*/false, /*split=*/true, qkv, *q, *k, *v,
                                      cos, sin, &layout));
  const void* src[3] = {qkv.untyped_data(), qkv.untyped_data(), qkv.untyped_data()};
  void* dst[3] = {q->untyped_data(), k->untyped_data(), v->untyped_data()};
  return LaunchParts(op, stream, qkv.element_type(), layout, src, dst, cos, sin, false);
}

ffi::Error RopeQkvBwd(cudaStream_t stream, ffi::AnyBuffer dq, ffi::AnyBuffer dk,
                      ffi::AnyBuffer dv, ffi::AnyBuffer cos, ffi::AnyBuffer sin,
                      ffi::Result<ffi::AnyBuffer> dqkv) {
  const char* op = "blujax_rope_qkv_bwd";
  RopeLayout layout;
  BLUJAX_RETURN_IF_ERROR(CheckRopeQkv(op, /*allow_f64=*/false, /*split=*/false, *dqkv, dq, dk,
                                      dv, cos, sin, &layout));
  const void* src[3] = {dq.untyped_data(), dk.untyped_data(), dv.untyped_data()};
  void* dst[3] = {dqkv->untyped_data(), dqkv->untyped_data(), dqkv->untyped_data()};
  return LaunchParts(op, stream, dq.element_type(), layout, src, dst, cos, sin, true);
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

XLA_FFI_DEFINE_HANDLER(kRopeQkvFwd, RopeQkvFwd,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Arg<ffi::AnyBuffer>()   // qkv [..., T, H + 2 KV, D]
                           .Arg<ffi::AnyBuffer>()   // cos [T, D/2] f32
                           .Arg<ffi::AnyBuffer>()   // sin [T, D/2] f32
                           .Ret<ffi::AnyBuffer>()   // q [..., T, H, D], turned
                           .Ret<ffi::AnyBuffer>()   // k [..., T, KV, D], turned
                           .Ret<ffi::AnyBuffer>(),  // v [..., T, KV, D]
                       kGraphSafe);

XLA_FFI_DEFINE_HANDLER(kRopeQkvBwd, RopeQkvBwd,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Arg<ffi::AnyBuffer>()   // dq [..., T, H, D]
                           .Arg<ffi::AnyBuffer>()   // dk [..., T, KV, D]
                           .Arg<ffi::AnyBuffer>()   // dv [..., T, KV, D]
                           .Arg<ffi::AnyBuffer>()   // cos [T, D/2] f32
                           .Arg<ffi::AnyBuffer>()   // sin [T, D/2] f32
                           .Ret<ffi::AnyBuffer>(),  // dqkv [..., T, H + 2 KV, D]
                       kGraphSafe);

BLUJAX_REGISTER(blujax_rope_fwd, kRopeFwd);
BLUJAX_REGISTER(blujax_rope_bwd, kRopeBwd);
BLUJAX_REGISTER(blujax_rope_qkv_fwd, kRopeQkvFwd);
BLUJAX_REGISTER(blujax_rope_qkv_bwd, kRopeQkvBwd);

}  // namespace blujax
