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
// copy's transpose and its amax. A block takes a tile of 64 rows by 64 of the F columns (in
// the backward, those columns of d gate and of d up): it writes the tile's bytes as they lie
// and, through shared memory, transposed, 16 bytes of a column at a time; its amax goes into
// the tensor's with one atomic max on the float's bits (for a float >= 0, or NaN with its
// sign cleared, the order of the bits is the order of the values, NaN above all).

#include <cuda_fp8.h>

#include <algorithm>
#include <initializer_list>
#include <type_traits>

#include "common/cuda_launch.cuh"
#include "common/cuda_util.cuh"
#include "common/cuda_vec.cuh"
#include "common/fp8.h"
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

constexpr int kTile = 64;  // rows and columns of a tile
constexpr int kPer = 8;    // consecutive columns a thread takes at once (16 bytes of bfloat16)
constexpr int kGroups = kTile / kPer;  // column groups of a tile row

// Division by the scale: by a multiply where the scale is a power of two with a normal
// reciprocal (blujax.fp8's always are), which gives the quotient exactly; else the IEEE
// division (under fast math a plain / would be approximate).
struct Divisor {
  float scale, inverse;
  bool power_of_two;
};

__device__ __forceinline__ Divisor DivisorOf(float s) {
  const unsigned b = __float_as_uint(s), e = (b >> 23) & 0xffu;
  const bool p2 = (b & 0x807fffffu) == 0 && e > 1 && e < 253;
  return {s, p2 ? __uint_as_float((254u - e) << 23) : 0.f, p2};
}

// The copy of v (already rounded to the output's dtype): v / scale, saturated, nearest even.
__device__ __forceinline__ uint8_t ToFp8(float v, const Divisor& s, Fp8Format f) {
  const float x = s.power_of_two ? v * s.inverse : __fdiv_rn(v, s.scale);
  return f == Fp8Format::kE4M3 ? __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)
                               : __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2);
}

// kPer elements of a row from column c on, as floats: one or two 16-byte loads where `packed`
// (the row holds them all, 16-byte aligned), else element by element up to `cols`.
template <typename T>
__device__ __forceinline__ void LoadRun(const T* p, int64_t c, int64_t cols, bool packed,
                                        float (&v)[kPer]) {
  if (packed) {
    constexpr int kPack = Pack<T>::kSize;
#pragma unroll
    for (int k = 0; k < kPer; k += kPack) {
      const Pack<T> a = LoadPack(p + c + k);
#pragma unroll
      for (int j = 0; j < kPack; ++j) v[k + j] = PackElem(a, j);
    }
  } else {
#pragma unroll
    for (int k = 0; k < kPer; ++k) v[k] = c + k < cols ? ToFloat(p[c + k]) : 0.f;
  }
}

// One run of kPer outputs v at (r, c) of q [rows, width]: rounded to T, copied to FP8 into
// q (8 bytes at once where `packed`) and into the block's tile at (tr, tc); their amax bits
// into amax_bits.
template <typename T>
__device__ __forceinline__ void PutRun(const float (&v)[kPer], const Divisor& scale, Fp8Format f,
                                       uint8_t* q, int64_t r, int64_t c, int64_t cols,
                                       int64_t width, bool packed, uint8_t (*tile)[kTile + 4],
                                       int tr, int tc, unsigned* amax_bits) {
  alignas(8) uint8_t b[kPer];  // stored as one uint2 where packed
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const float w = ToFloat(FromFloat<T>(v[k]));
    b[k] = ToFp8(w, scale, f);
    if (c + k < cols) *amax_bits = max(*amax_bits, __float_as_uint(fabsf(w)));
    tile[tr][tc + k] = b[k];
  }
  uint8_t* out = q + r * width;
  if (packed) {
    *reinterpret_cast<uint2*>(out) = *reinterpret_cast<const uint2*>(b);
  } else {
#pragma unroll
    for (int k = 0; k < kPer; ++k)
      if (c + k < cols) out[k] = b[k];
  }
}

// The tile's bytes transposed into qt [width, rows] at rows c0 + tc (tc < 64) from column r0:
// 16 bytes of one qt row a thread.
__device__ __forceinline__ void PutTransposed(const uint8_t (*tile)[kTile + 4], uint8_t* qt,
                                              int64_t r0, int64_t rows, int64_t qt_row,
                                              int64_t c, int64_t cols, bool packed_t) {
  for (int item = threadIdx.x; item < kTile * (kTile / 16); item += kThreads) {
    const int tc = item / (kTile / 16), tr = (item % (kTile / 16)) * 16;
    if (c + tc >= cols || r0 + tr >= rows) continue;
    alignas(16) uint8_t b[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) b[j] = tile[tr + j][tc];
    uint8_t* out = qt + (qt_row + tc) * rows + r0 + tr;
    if (packed_t && r0 + tr + 16 <= rows) {
      *reinterpret_cast<uint4*>(out) = *reinterpret_cast<const uint4*>(b);
    } else {
      for (int j = 0; j < 16 && r0 + tr + j < rows; ++j) out[j] = b[j];
    }
  }
}

// The block's amax bits (every thread's) into the tensor's.
__device__ __forceinline__ void PutAmax(unsigned bits, unsigned* amax) {
  __shared__ unsigned warps[kThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o /= 2) bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, o));
  if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = bits;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) bits = max(bits, warps[w]);
    atomicMax(amax, bits);
  }
}

// fn(tr, tc, r, c, whole) for each run of kPer columns of the block's tile that the thread
// takes and that lies in the output: (tr, tc) in the tile, (r, c) in the output, whole if
// all kPer columns are.
template <typename Fn>
__device__ __forceinline__ void ForEachRun(int64_t r0, int64_t c0, int64_t rows, int64_t cols,
                                           Fn&& fn) {
  for (int item = threadIdx.x; item < kTile * kGroups; item += kThreads) {
    const int tr = item / kGroups, tc = (item % kGroups) * kPer;
    const int64_t r = r0 + tr, c = c0 + tc;
    if (r < rows && c < cols) fn(tr, tc, r, c, c + kPer <= cols);
  }
}

// Layout facts a launch decides once: whole 16-byte runs of x's rows (packed), 8-byte runs
// of q's (packed_q), 16-byte runs of qt's (packed_t).
struct Fp8Layout {
  bool packed, packed_q, packed_t;
};

template <typename T>
__global__ void __launch_bounds__(kThreads)
SwigluFwdFp8Kernel(const T* __restrict__ x, const float* __restrict__ scale, Fp8Format f,
                   uint8_t* __restrict__ q, uint8_t* __restrict__ qt,
                   unsigned* __restrict__ amax, int64_t rows, int64_t cols, Fp8Layout lay) {
  __shared__ uint8_t tile[kTile][kTile + 4];
  const int64_t r0 = int64_t(blockIdx.x) * kTile, c0 = int64_t(blockIdx.y) * kTile;
  const Divisor s = DivisorOf(*scale);
  unsigned bits = 0;
  ForEachRun(r0, c0, rows, cols, [&](int tr, int tc, int64_t r, int64_t c, bool whole) {
    const T* gate = x + 2 * cols * r;
    float g[kPer], u[kPer], y[kPer];
    LoadRun(gate, c, cols, lay.packed && whole, g);
    LoadRun(gate + cols, c, cols, lay.packed && whole, u);
#pragma unroll
    for (int k = 0; k < kPer; ++k) y[k] = g[k] * Sigmoid(g[k]) * u[k];
    PutRun<T>(y, s, f, q + c, r, c, cols, cols, lay.packed_q && whole, tile, tr, tc, &bits);
  });
  __syncthreads();
  PutTransposed(tile, qt, r0, rows, c0, c0, cols, lay.packed_t);
  PutAmax(bits, amax);
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
SwigluBwdFp8Kernel(const T* __restrict__ dy, const T* __restrict__ x,
                   const float* __restrict__ scale, Fp8Format f, uint8_t* __restrict__ q,
                   uint8_t* __restrict__ qt, unsigned* __restrict__ amax, int64_t rows,
                   int64_t cols, Fp8Layout lay) {
  __shared__ uint8_t tile_g[kTile][kTile + 4], tile_u[kTile][kTile + 4];
  const int64_t r0 = int64_t(blockIdx.x) * kTile, c0 = int64_t(blockIdx.y) * kTile;
  const int64_t width = 2 * cols;
  const Divisor s = DivisorOf(*scale);
  unsigned bits = 0;
  ForEachRun(r0, c0, rows, cols, [&](int tr, int tc, int64_t r, int64_t c, bool whole) {
    const T* gate = x + width * r;
    float g[kPer], u[kPer], d[kPer], dg[kPer], du[kPer];
    LoadRun(gate, c, cols, lay.packed && whole, g);
    LoadRun(gate + cols, c, cols, lay.packed && whole, u);
    LoadRun(dy + cols * r, c, cols, lay.packed && whole, d);
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
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
  return dim3(static_cast<unsigned>((d.rows + kTile - 1) / kTile),
              static_cast<unsigned>((d.cols + kTile - 1) / kTile));
}

inline ffi::Error CheckFp8Grid(const char* op, const SwigluDims& d) {
  if ((d.cols + kTile - 1) / kTile > 65535 || (d.rows + kTile - 1) / kTile > (int64_t{1} << 31) - 1)
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
      SwigluFwdFp8Kernel<T><<<Fp8Grid(d), kThreads, 0, stream>>>(
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
      SwigluBwdFp8Kernel<T><<<Fp8Grid(d), kThreads, 0, stream>>>(
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
