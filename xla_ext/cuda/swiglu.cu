// SwiGLU, silu(gate) * up, on the GPU (float32 and bfloat16, computed in float32); the CPU twin
// is xla_ext/cpu/swiglu.cc and the handler contract common/swiglu.h.
//
// Memory-bound: the forward reads gate and up once and writes y once, the backward reads dy,
// gate and up once and writes d gate and d up once (one [..., 2, F] tensor). A thread takes one
// 16-byte vector of F columns (where F is a whole number of vectors and the buffers are
// 16-byte aligned; one element otherwise) of one row: its gate vector, the up vector F elements
// further on, and the matching vector of y or dy. The grid covers every vector once (striding
// only past about 2^28 of them).
//
// sigmoid(g) = 1 / (1 + exp(-g)): one exp and one fast reciprocal; 0 for g -> -inf (the
// reciprocal of inf), 1 for g -> +inf.

#include <algorithm>
#include <type_traits>

#include "common/cuda_launch.cuh"
#include "common/cuda_util.cuh"
#include "common/cuda_vec.cuh"
#include "common/registry.h"
#include "common/swiglu.h"

namespace blujax {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = int64_t{1} << 20;

__device__ __forceinline__ float Sigmoid(float g) { return __fdividef(1.f, 1.f + __expf(-g)); }

// ----------------------------------------------------------------------------------------------
// Kernels. Item i is vector c = i % vecs of row r = i / vecs, vecs = F / kVec.

template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads)
SwigluFwdKernel(const T* __restrict__ x, T* __restrict__ y, int64_t rows, int64_t cols) {
  const int64_t vecs = cols / kVec, items = rows * vecs;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < items;
       i += int64_t(gridDim.x) * kThreads) {
    int64_t c;
    const int64_t r = DivMod(i, vecs, &c);
    const T* gate = x + 2 * cols * r + c * kVec;
    const Vec<T, kVec> g = LoadVec<T, kVec>(gate), u = LoadVec<T, kVec>(gate + cols);
    float out[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float gk = VecElem<T, kVec>(g, k);
      out[k] = gk * Sigmoid(gk) * VecElem<T, kVec>(u, k);
    }
    StoreVec<T, kVec>(y + cols * r + c * kVec, out);
  }
}

template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads)
SwigluBwdKernel(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx,
                int64_t rows, int64_t cols) {
  const int64_t vecs = cols / kVec, items = rows * vecs;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < items;
       i += int64_t(gridDim.x) * kThreads) {
    int64_t c;
    const int64_t r = DivMod(i, vecs, &c);
    const int64_t in = 2 * cols * r + c * kVec;
    const Vec<T, kVec> d = LoadVec<T, kVec>(dy + cols * r + c * kVec);
    const Vec<T, kVec> g = LoadVec<T, kVec>(x + in), u = LoadVec<T, kVec>(x + in + cols);
    float dgate[kVec], dup[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float gk = VecElem<T, kVec>(g, k), uk = VecElem<T, kVec>(u, k);
      const float dk = VecElem<T, kVec>(d, k), s = Sigmoid(gk);
      const float ds = dk * s;  // dy s: shared by both
      dgate[k] = ds * uk * fmaf(gk, 1.f - s, 1.f);
      dup[k] = ds * gk;
    }
    StoreVec<T, kVec>(dx + in, dgate);
    StoreVec<T, kVec>(dx + in + cols, dup);
  }
}

// ----------------------------------------------------------------------------------------------
// Launchers.

// f(kVec): 16-byte vectors when every row is a whole number of them and the buffers are
// 16-byte aligned (XLA's always are), else single elements.
template <typename T, typename F>
void WithVec(bool packed, F&& f) {
  if (packed) f(std::integral_constant<int, Pack<T>::kSize>{});
  else f(std::integral_constant<int, 1>{});
}

inline unsigned Blocks(int64_t items) {
  return static_cast<unsigned>(std::min((items + kThreads - 1) / kThreads, kMaxBlocks));
}

template <typename T>
void LaunchFwd(cudaStream_t stream, const T* x, T* y, const SwigluDims& d) {
  const bool packed = d.cols % Pack<T>::kSize == 0 && Aligned16(x) && Aligned16(y);
  WithVec<T>(packed, [&](auto vec) {
    constexpr int kVec = decltype(vec)::value;
    SwigluFwdKernel<T, kVec>
        <<<Blocks(d.rows * (d.cols / kVec)), kThreads, 0, stream>>>(x, y, d.rows, d.cols);
  });
}

template <typename T>
void LaunchBwd(cudaStream_t stream, const T* dy, const T* x, T* dx, const SwigluDims& d) {
  const bool packed =
      d.cols % Pack<T>::kSize == 0 && Aligned16(dy) && Aligned16(x) && Aligned16(dx);
  WithVec<T>(packed, [&](auto vec) {
    constexpr int kVec = decltype(vec)::value;
    SwigluBwdKernel<T, kVec>
        <<<Blocks(d.rows * (d.cols / kVec)), kThreads, 0, stream>>>(dy, x, dx, d.rows, d.cols);
  });
}

ffi::Error SwigluFwd(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  constexpr const char* op = "blujax_swiglu_fwd";
  SwigluDims d;
  BLUJAX_RETURN_IF_ERROR(CheckSwigluFwd(op, /*allow_f64=*/false, x, *y, &d));
  if (d.rows * d.cols == 0) return ffi::Error::Success();
  if (x.element_type() == ffi::DataType::F32) {
    LaunchFwd<float>(stream, static_cast<const float*>(x.untyped_data()),
                     static_cast<float*>(y->untyped_data()), d);
  } else {
    using B = __nv_bfloat16;
    LaunchFwd<B>(stream, static_cast<const B*>(x.untyped_data()),
                 static_cast<B*>(y->untyped_data()), d);
  }
  return LastCudaError(op);
}

ffi::Error SwigluBwd(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                     ffi::Result<ffi::AnyBuffer> dx) {
  constexpr const char* op = "blujax_swiglu_bwd";
  SwigluDims d;
  BLUJAX_RETURN_IF_ERROR(CheckSwigluBwd(op, /*allow_f64=*/false, dy, x, *dx, &d));
  if (d.rows * d.cols == 0) return ffi::Error::Success();
  if (x.element_type() == ffi::DataType::F32) {
    LaunchBwd<float>(stream, static_cast<const float*>(dy.untyped_data()),
                     static_cast<const float*>(x.untyped_data()),
                     static_cast<float*>(dx->untyped_data()), d);
  } else {
    using B = __nv_bfloat16;
    LaunchBwd<B>(stream, static_cast<const B*>(dy.untyped_data()),
                 static_cast<const B*>(x.untyped_data()), static_cast<B*>(dx->untyped_data()),
                 d);
  }
  return LastCudaError(op);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kSwigluFwd, SwigluFwd,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Arg<ffi::AnyBuffer>()   // x [..., 2, F]: (gate, up)
                           .Ret<ffi::AnyBuffer>(),  // y [..., F]
                       kGraphSafe);

XLA_FFI_DEFINE_HANDLER(kSwigluBwd, SwigluBwd,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Arg<ffi::AnyBuffer>()   // dy [..., F]
                           .Arg<ffi::AnyBuffer>()   // x [..., 2, F]
                           .Ret<ffi::AnyBuffer>(),  // dx [..., 2, F]: (d gate, d up)
                       kGraphSafe);

BLUJAX_REGISTER(blujax_swiglu_fwd, kSwigluFwd);
BLUJAX_REGISTER(blujax_swiglu_bwd, kSwigluBwd);

}  // namespace blujax
