// Fused AdamW on the GPU (float32 or bfloat16 parameters, float32 moments); the CPU twin is
// xla_ext/cpu/adamw.cc and the handler contract common/adamw.h.
//
// Memory-bound: 28 bytes per float32 element (read p, g, m, v; write u, m, v; with `apply`
// the new p in place of u, the same bytes), so the design is about streaming. One launch updates up to kMaxTensors tensors: their pointers and sizes travel
// in the kernel's parameter block (no device-side table, so nothing to allocate or copy, and the
// launch stays CUDA-graph safe). Every tensor is cut into chunks of kChunk elements; a block
// takes a chunk of any tensor and finds the tensor by binary search over the chunk offsets. A
// full, aligned chunk is the fast path: each thread loads kUnroll packs of 4 elements of each
// stream (16 bytes of float32, 8 of bfloat16) before it computes any, which keeps many loads in
// flight per thread.
// Partial chunks (a tensor's tail, or tensors smaller than a chunk, like GPT-2's biases and
// LayerNorm parameters) take packs where they can and single elements for the last few.
// So GPT-2 124M (148 leaves) costs one launch per (dtype, decay) group instead of 148.
//
// The arithmetic is the CPU twin's, operation for operation (see there), with correctly rounded
// division and sqrt (explicit intrinsics, since the build's --use_fast_math would make them
// approximate).

#include <algorithm>
#include <type_traits>

#include "common/adamw.h"
#include "common/cuda_launch.cuh"
#include "common/cuda_util.cuh"
#include "common/registry.h"

namespace blujax {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 4;  // elements per access: 16 bytes of float32 moments
constexpr int kUnroll = 2;  // 4 holds more loads per thread but needs ~115 registers (2 blocks/SM)
constexpr int kChunk = kThreads * kVec * kUnroll;  // 2048 elements
// Tensors per launch: their pointers travel in the kernel's parameter block, which since
// CUDA 12.1 may hold 32 KiB on sm_70 and newer (the classic limit was 4 KiB, 48 tensors), so
// all of GPT-2's 148 leaves of one (dtype, decay) group go in one launch.
constexpr int kMaxTensors = 256;

template <typename T>
struct AdamWBatch {
  const T* p[kMaxTensors];
  const T* g[kMaxTensors];
  const float* m[kMaxTensors];
  const float* v[kMaxTensors];
  T* u[kMaxTensors];
  float* m_out[kMaxTensors];
  float* v_out[kMaxTensors];
  int64_t n[kMaxTensors];
  int64_t chunk_start[kMaxTensors + 1];  // chunk_start[count] is the launch's chunk total
  int count;
};
static_assert(sizeof(AdamWBatch<float>) + 64 <= 32764, "kernel parameters exceed 32 KiB");

// b1, b2 and eps rounded to float on the host from the double attributes, as JAX rounds Python
// floats; 1 - b1 is formed in double first, as Python does.
struct AdamWConsts {
  float b1, one_minus_b1, b2, one_minus_b2, eps;
};

struct AdamWHyper {
  float step, wd, inv_bc1, inv_bc2, scale;  // step = -lr; 1 / bias corrections; grad_scale
};

// The step for one element; m and v are updated in place.
__device__ __forceinline__ float AdamWElement(float p, float g, float& m, float& v,
                                              const AdamWConsts& c, const AdamWHyper& h) {
  g = __fmul_rn(g, h.scale);
  m = __fmaf_rn(c.one_minus_b1, g, __fmul_rn(c.b1, m));
  v = __fmaf_rn(c.one_minus_b2, __fmul_rn(g, g), __fmul_rn(c.b2, v));
  const float denom = __fadd_rn(__fsqrt_rn(__fmul_rn(v, h.inv_bc2)), c.eps);
  float u = __fdiv_rn(__fmul_rn(m, h.inv_bc1), denom);
  if (h.wd != 0.f) u = __fmaf_rn(h.wd, p, u);
  return __fmul_rn(h.step, u);
}

// u rounded to T, as optax.apply_updates adds an update of the parameter dtype.
template <typename T>
__device__ __forceinline__ float RoundTo(float u) {
  if constexpr (std::is_same_v<T, float>) return u;
  else return __bfloat162float(__float2bfloat16_rn(u));
}

// What the kernel writes for an element: the update u, or with kApply the new parameter.
template <typename T, bool kApply>
__device__ __forceinline__ float AdamWResult(float p, float u) {
  if constexpr (kApply) return __fadd_rn(p, RoundTo<T>(u));
  else return u;
}

// Four consecutive elements in one access: 16 bytes of float, 8 bytes of bfloat16.
__device__ __forceinline__ void Load4(const float* p, float out[4], bool read_only) {
  const float4 r = read_only ? __ldg(reinterpret_cast<const float4*>(p))
                             : *reinterpret_cast<const float4*>(p);
  out[0] = r.x, out[1] = r.y, out[2] = r.z, out[3] = r.w;
}
__device__ __forceinline__ void Load4(const __nv_bfloat16* p, float out[4], bool read_only) {
  const uint2 r = read_only ? __ldg(reinterpret_cast<const uint2*>(p))
                            : *reinterpret_cast<const uint2*>(p);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&r.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&r.y));
  out[0] = a.x, out[1] = a.y, out[2] = b.x, out[3] = b.y;
}
__device__ __forceinline__ void Store4(float* p, const float in[4]) {
  *reinterpret_cast<float4*>(p) = make_float4(in[0], in[1], in[2], in[3]);
}
__device__ __forceinline__ void Store4(__nv_bfloat16* p, const float in[4]) {
  const __nv_bfloat162 a = __floats2bfloat162_rn(in[0], in[1]);
  const __nv_bfloat162 b = __floats2bfloat162_rn(in[2], in[3]);
  uint2 r;
  r.x = *reinterpret_cast<const uint32_t*>(&a);
  r.y = *reinterpret_cast<const uint32_t*>(&b);
  *reinterpret_cast<uint2*>(p) = r;
}

template <typename T>
__device__ __forceinline__ bool PackAligned(const T* p, const T* g, const T* u, const float* m,
                                            const float* v, const float* mo, const float* vo) {
  constexpr uintptr_t kParamAlign = kVec * sizeof(T) - 1, kMomentAlign = kVec * sizeof(float) - 1;
  return ((reinterpret_cast<uintptr_t>(p) | reinterpret_cast<uintptr_t>(g) |
           reinterpret_cast<uintptr_t>(u)) & kParamAlign) == 0 &&
         ((reinterpret_cast<uintptr_t>(m) | reinterpret_cast<uintptr_t>(v) |
           reinterpret_cast<uintptr_t>(mo) | reinterpret_cast<uintptr_t>(vo)) & kMomentAlign) == 0;
}

// __grid_constant__: the batch is indexed with a runtime tensor number, which would otherwise
// copy the whole parameter block into every thread's local memory. kApply: u is p + u, written
// over p (so p is read through the ordinary cache, not the read-only one).
template <typename T, bool kApply>
__global__ void __launch_bounds__(kThreads)
AdamWKernel(const __grid_constant__ AdamWBatch<T> batch, const float* __restrict__ hparams,
            const AdamWConsts c) {
  const AdamWHyper h{-__ldg(hparams), __ldg(hparams + 1), __frcp_rn(__ldg(hparams + 2)),
                     __frcp_rn(__ldg(hparams + 3)), __ldg(hparams + 4)};
  const bool read_p = kApply || h.wd != 0.f;
  const int64_t total = batch.chunk_start[batch.count];
  for (int64_t chunk = blockIdx.x; chunk < total; chunk += gridDim.x) {
    int lo = 0, hi = batch.count - 1;  // the last tensor whose first chunk is <= chunk
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (batch.chunk_start[mid] <= chunk) lo = mid;
      else hi = mid - 1;
    }
    const int64_t begin = (chunk - batch.chunk_start[lo]) * kChunk;
    const int len = static_cast<int>(min(int64_t(kChunk), batch.n[lo] - begin));
    const T* p = batch.p[lo] + begin;
    const T* g = batch.g[lo] + begin;
    const float* m = batch.m[lo] + begin;
    const float* v = batch.v[lo] + begin;
    T* u = batch.u[lo] + begin;
    float* mo = batch.m_out[lo] + begin;
    float* vo = batch.v_out[lo] + begin;
    const bool packed = PackAligned(p, g, u, m, v, mo, vo);

    if (packed && len == kChunk) {
      // Every load of the chunk first, then the arithmetic, then the stores.
      float pv[kUnroll][kVec], gv[kUnroll][kVec], mv[kUnroll][kVec], vv[kUnroll][kVec];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const int off = (k * kThreads + threadIdx.x) * kVec;
        // g, m and v are overwritten in place (u, m', v'): only p may use the read-only cache,
        // and only where the result does not overwrite it.
        Load4(g + off, gv[k], false);
        Load4(m + off, mv[k], false);
        Load4(v + off, vv[k], false);
        if (read_p) Load4(p + off, pv[k], !kApply);
        else pv[k][0] = pv[k][1] = pv[k][2] = pv[k][3] = 0.f;
      }
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        float uv[kVec];
#pragma unroll
        for (int e = 0; e < kVec; ++e)
          uv[e] = AdamWResult<T, kApply>(
              pv[k][e], AdamWElement(pv[k][e], gv[k][e], mv[k][e], vv[k][e], c, h));
        const int off = (k * kThreads + threadIdx.x) * kVec;
        Store4(u + off, uv);
        Store4(mo + off, mv[k]);
        Store4(vo + off, vv[k]);
      }
    } else {
      // A partial or unaligned chunk: packs while whole ones fit, then single elements.
      const int packs = packed ? len / kVec : 0;
      for (int q = threadIdx.x; q < packs; q += kThreads) {
        const int off = q * kVec;
        float pq[kVec] = {0.f, 0.f, 0.f, 0.f}, gq[kVec], mq[kVec], vq[kVec], uq[kVec];
        Load4(g + off, gq, false);
        Load4(m + off, mq, false);
        Load4(v + off, vq, false);
        if (read_p) Load4(p + off, pq, !kApply);
#pragma unroll
        for (int e = 0; e < kVec; ++e)
          uq[e] = AdamWResult<T, kApply>(pq[e], AdamWElement(pq[e], gq[e], mq[e], vq[e], c, h));
        Store4(u + off, uq);
        Store4(mo + off, mq);
        Store4(vo + off, vq);
      }
      for (int i = packs * kVec + threadIdx.x; i < len; i += kThreads) {
        float mi = m[i], vi = v[i];
        const float pi = read_p ? ToFloat(p[i]) : 0.f;
        const float ui = AdamWResult<T, kApply>(pi, AdamWElement(pi, ToFloat(g[i]), mi, vi, c, h));
        u[i] = FromFloat<T>(ui);
        mo[i] = mi;
        vo[i] = vi;
      }
    }
  }
}

template <typename T, bool kApply>
ffi::Error LaunchAdamW(cudaStream_t stream, int device, const std::vector<AdamWTensor>& tensors,
                       const float* hparams, const AdamWConsts& c) {
  AdamWBatch<T> batch;
  batch.count = 0;
  batch.chunk_start[0] = 0;
  auto launch = [&]() -> ffi::Error {
    if (batch.count == 0) return ffi::Error::Success();
    const int64_t chunks = batch.chunk_start[batch.count];
    // A block per chunk, each passing once: with fewer blocks striding over the chunks, a
    // block's loads found little else resident to overlap them (measured slower).
    const unsigned grid = static_cast<unsigned>(std::min<int64_t>(chunks, 0x7fffffff));
    AdamWKernel<T, kApply><<<grid, kThreads, 0, stream>>>(batch, hparams, c);
    batch.count = 0;
    return LastCudaError("blujax_adamw");
  };
  for (const AdamWTensor& t : tensors) {
    if (t.n == 0) continue;
    const int i = batch.count;
    batch.p[i] = static_cast<const T*>(t.p);
    batch.g[i] = static_cast<const T*>(t.g);
    batch.m[i] = static_cast<const float*>(t.m);
    batch.v[i] = static_cast<const float*>(t.v);
    batch.u[i] = static_cast<T*>(t.u);
    batch.m_out[i] = static_cast<float*>(t.m_out);
    batch.v_out[i] = static_cast<float*>(t.v_out);
    batch.n[i] = t.n;
    batch.chunk_start[i + 1] = batch.chunk_start[i] + (t.n + kChunk - 1) / kChunk;
    batch.count = i + 1;
    if (batch.count == kMaxTensors) BLUJAX_RETURN_IF_ERROR(launch());
  }
  return launch();
}

ffi::Error AdamW(cudaStream_t stream, int32_t device, ffi::AnyBuffer hparams,
                 ffi::RemainingArgs args, ffi::RemainingRets rets, double b1, double b2,
                 double eps, bool apply) {
  constexpr const char* op = "blujax_adamw";
  ffi::DataType param;
  std::vector<AdamWTensor> tensors;  // host memory, per call
  BLUJAX_RETURN_IF_ERROR(
      CheckAdamW(op, /*allow_f64=*/false, hparams, args, rets, b1, b2, eps, &param, &tensors));
  const AdamWConsts c{static_cast<float>(b1), static_cast<float>(1.0 - b1),
                      static_cast<float>(b2), static_cast<float>(1.0 - b2),
                      static_cast<float>(eps)};
  const float* hp = static_cast<const float*>(hparams.untyped_data());
  using B = __nv_bfloat16;
  if (param == ffi::DataType::F32)
    return apply ? LaunchAdamW<float, true>(stream, device, tensors, hp, c)
                 : LaunchAdamW<float, false>(stream, device, tensors, hp, c);
  return apply ? LaunchAdamW<B, true>(stream, device, tensors, hp, c)
               : LaunchAdamW<B, false>(stream, device, tensors, hp, c);
}


}  // namespace

XLA_FFI_DEFINE_HANDLER(kAdamW, AdamW,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Ctx<Device>()
                           .Arg<ffi::AnyBuffer>()  // hparams [5] f32: lr, wd, bc1, bc2, scale
                           .RemainingArgs()        // p[N], g[N], m[N], v[N]
                           .RemainingRets()        // u[N] (p + u[N] with apply), m'[N], v'[N]
                           .Attr<double>("b1")
                           .Attr<double>("b2")
                           .Attr<double>("eps")
                           .Attr<bool>("apply"),
                       kGraphSafe);

BLUJAX_REGISTER(blujax_adamw, kAdamW);

}  // namespace blujax
