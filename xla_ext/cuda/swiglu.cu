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
//
// The FP8 forms (common/fp8.h) write no y or dx, only its FP8 copy (one byte an element), the
// copy's transpose and its amax, through the tiles of common/fp8.cuh: a block takes 64 rows by
// 64 of the F columns (in the backward, those columns of d gate and of d up).

#include <algorithm>
#include <initializer_list>
#include <type_traits>

#include "common/cuda_launch.cuh"
#include "common/cuda_util.cuh"
#include "common/cuda_vec.cuh"
#include "common/fp8.cuh"
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
// The FP8 forms.

template <typename T>
__global__ void __launch_bounds__(kFp8Threads)
SwigluFwdFp8Kernel(const T* __restrict__ x, const float* __restrict__ scale, Fp8Format f,
                   uint8_t* __restrict__ q, uint8_t* __restrict__ qt,
                   unsigned* __restrict__ amax, int64_t rows, int64_t cols, Fp8Layout lay) {
  __shared__ uint8_t tile[kFp8Tile][kFp8Tile + 4];
  const int64_t r0 = int64_t(blockIdx.x) * kFp8Tile, c0 = int64_t(blockIdx.y) * kFp8Tile;
  const Divisor s = DivisorOf(*scale);
  unsigned bits = 0;
  ForEachRun(r0, c0, rows, cols, [&](int tr, int tc, int64_t r, int64_t c, bool whole) {
    const T* gate = x + 2 * cols * r;
    float g[kFp8Per], u[kFp8Per], y[kFp8Per];
    LoadRun(gate, c, cols, lay.packed && whole, g);
    LoadRun(gate + cols, c, cols, lay.packed && whole, u);
#pragma unroll
    for (int k = 0; k < kFp8Per; ++k) y[k] = g[k] * Sigmoid(g[k]) * u[k];
    PutRun<T>(y, s, f, q + c, r, c, cols, cols, lay.packed_q && whole, tile, tr, tc, &bits);
  });
  __syncthreads();
  PutTransposed(tile, qt, r0, rows, c0, c0, cols, lay.packed_t);
  PutAmax(bits, amax);
}

template <typename T>
__global__ void __launch_bounds__(kFp8Threads)
SwigluBwdFp8Kernel(const T* __restrict__ dy, const T* __restrict__ x,
                   const float* __restrict__ scale, Fp8Format f, uint8_t* __restrict__ q,
                   uint8_t* __restrict__ qt, unsigned* __restrict__ amax, int64_t rows,
                   int64_t cols, Fp8Layout lay) {
  __shared__ uint8_t tile_g[kFp8Tile][kFp8Tile + 4], tile_u[kFp8Tile][kFp8Tile + 4];
  const int64_t r0 = int64_t(blockIdx.x) * kFp8Tile, c0 = int64_t(blockIdx.y) * kFp8Tile;
  const int64_t width = 2 * cols;
  const Divisor s = DivisorOf(*scale);
  unsigned bits = 0;
  ForEachRun(r0, c0, rows, cols, [&](int tr, int tc, int64_t r, int64_t c, bool whole) {
    const T* gate = x + width * r;
    float g[kFp8Per], u[kFp8Per], d[kFp8Per], dg[kFp8Per], du[kFp8Per];
    LoadRun(gate, c, cols, lay.packed && whole, g);
    LoadRun(gate + cols, c, cols, lay.packed && whole, u);
    LoadRun(dy + cols * r, c, cols, lay.packed && whole, d);
#pragma unroll
    for (int k = 0; k < kFp8Per; ++k) {
      const float sg = Sigmoid(g[k]), ds = d[k] * sg;
      dg[k] = ds * u[k] * fmaf(g[k], 1.f - sg, 1.f);
      du[k] = ds * g[k];
    }
    const bool pq = lay.packed_q && whole;
    PutRun<T>(dg, s, f, q + c, r, c, cols, width, pq, tile_g, tr, tc, &bits);
    PutRun<T>(du, s, f, q + cols + c, r, c, cols, width, pq, tile_u, tr, tc, &bits);
  });
  __syncthreads();
  PutTransposed(tile_g, qt, r0, rows, c0, c0, cols, lay.packed_t);
  PutTransposed(tile_u, qt, r0, rows, cols + c0, c0, cols, lay.packed_t);
  PutAmax(bits, amax);
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

// The FP8 forms' grid: a block a 64 x 64 tile, rows along x (up to 2^31 tiles), columns
// along y (up to 65535 tiles: F up to about 4M, which the checks ensure).
inline dim3 Fp8Grid(const SwigluDims& d) {
  return dim3(static_cast<unsigned>((d.rows + kFp8Tile - 1) / kFp8Tile),
              static_cast<unsigned>((d.cols + kFp8Tile - 1) / kFp8Tile));
}

inline ffi::Error CheckFp8Grid(const char* op, const SwigluDims& d) {
  if ((d.cols + kFp8Tile - 1) / kFp8Tile > 65535 ||
      (d.rows + kFp8Tile - 1) / kFp8Tile > (int64_t{1} << 31) - 1)
    return InvalidArgument(op, ": x is too large for the FP8 form (", d.rows, " rows of ",
                           d.cols, ")");
  return ffi::Error::Success();
}

template <typename T>
Fp8Layout LayoutOf(const SwigluDims& d, std::initializer_list<const void*> inputs,
                   const void* q, const void* qt) {
  bool packed = d.cols % Pack<T>::kSize == 0;
  for (const void* p : inputs) packed = packed && Aligned16(p);
  return {packed, d.cols % 8 == 0 && reinterpret_cast<uintptr_t>(q) % 8 == 0,
          d.rows % 16 == 0 && Aligned16(qt)};
}

// fn(T{}) with T float or __nv_bfloat16, x's dtype.
template <typename Fn>
void WithDtype(ffi::DataType t, Fn&& fn) {
  if (t == ffi::DataType::F32) fn(float{});
  else fn(__nv_bfloat16{});
}

ffi::Error SwigluFwdFp8(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer scale,
                        ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> qt,
                        ffi::Result<ffi::AnyBuffer> amax) {
  constexpr const char* op = "blujax_swiglu_fwd_fp8";
  SwigluDims d;
  Fp8Format f;
  BLUJAX_RETURN_IF_ERROR(CheckSwigluFwdFp8(op, x, scale, *q, *qt, *amax, &d, &f));
  BLUJAX_RETURN_IF_ERROR(CheckFp8Grid(op, d));
  auto* bits = static_cast<unsigned*>(amax->untyped_data());
  cudaMemsetAsync(bits, 0, sizeof(unsigned), stream);  // +0.0: the amax of nothing
  if (d.rows * d.cols > 0) {
    WithDtype(x.element_type(), [&](auto tag) {
      using T = decltype(tag);
      const T* xp = static_cast<const T*>(x.untyped_data());
      auto* qp = static_cast<uint8_t*>(q->untyped_data());
      auto* qtp = static_cast<uint8_t*>(qt->untyped_data());
      SwigluFwdFp8Kernel<T><<<Fp8Grid(d), kFp8Threads, 0, stream>>>(
          xp, static_cast<const float*>(scale.untyped_data()), f, qp, qtp, bits, d.rows, d.cols,
          LayoutOf<T>(d, {xp}, qp, qtp));
    });
  }
  return LastCudaError(op);
}

ffi::Error SwigluBwdFp8(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                        ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer> q,
                        ffi::Result<ffi::AnyBuffer> qt, ffi::Result<ffi::AnyBuffer> amax) {
  constexpr const char* op = "blujax_swiglu_bwd_fp8";
  SwigluDims d;
  Fp8Format f;
  BLUJAX_RETURN_IF_ERROR(CheckSwigluBwdFp8(op, dy, x, scale, *q, *qt, *amax, &d, &f));
  BLUJAX_RETURN_IF_ERROR(CheckFp8Grid(op, d));
  auto* bits = static_cast<unsigned*>(amax->untyped_data());
  cudaMemsetAsync(bits, 0, sizeof(unsigned), stream);
  if (d.rows * d.cols > 0) {
    WithDtype(x.element_type(), [&](auto tag) {
      using T = decltype(tag);
      const T* xp = static_cast<const T*>(x.untyped_data());
      const T* dyp = static_cast<const T*>(dy.untyped_data());
      auto* qp = static_cast<uint8_t*>(q->untyped_data());
      auto* qtp = static_cast<uint8_t*>(qt->untyped_data());
      SwigluBwdFp8Kernel<T><<<Fp8Grid(d), kFp8Threads, 0, stream>>>(
          dyp, xp, static_cast<const float*>(scale.untyped_data()), f, qp, qtp, bits, d.rows,
          d.cols, LayoutOf<T>(d, {xp, dyp}, qp, qtp));
    });
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

XLA_FFI_DEFINE_HANDLER(kSwigluFwdFp8, SwigluFwdFp8,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Arg<ffi::AnyBuffer>()   // x [..., 2, F]: (gate, up)
                           .Arg<ffi::AnyBuffer>()   // scale: float32 []
                           .Ret<ffi::AnyBuffer>()   // q [rows, F]: FP8
                           .Ret<ffi::AnyBuffer>()   // qt [F, rows]
                           .Ret<ffi::AnyBuffer>(),  // amax: float32 []
                       kGraphSafe);

XLA_FFI_DEFINE_HANDLER(kSwigluBwdFp8, SwigluBwdFp8,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Arg<ffi::AnyBuffer>()   // dy [..., F]
                           .Arg<ffi::AnyBuffer>()   // x [..., 2, F]
                           .Arg<ffi::AnyBuffer>()   // scale: float32 []
                           .Ret<ffi::AnyBuffer>()   // q [rows, 2F]: (d gate, d up), FP8
                           .Ret<ffi::AnyBuffer>()   // qt [2F, rows]
                           .Ret<ffi::AnyBuffer>(),  // amax: float32 []
                       kGraphSafe);

BLUJAX_REGISTER(blujax_swiglu_fwd, kSwigluFwd);
BLUJAX_REGISTER(blujax_swiglu_bwd, kSwigluBwd);
BLUJAX_REGISTER(blujax_swiglu_fwd_fp8, kSwigluFwdFp8);
BLUJAX_REGISTER(blujax_swiglu_bwd_fp8, kSwigluBwdFp8);

}  // namespace blujax
