// GELU (tanh approximation) of x + bias on the GPU (float32 and bfloat16, computed in float32);
// the CPU twin is xla_ext/cpu/gelu.cc and the handler contract common/gelu.h.
//
// Memory-bound: every element is read once and written once, in 16-byte vectors where the shape
// and alignment allow, with several vectors in flight per thread (or, in the float32 forward,
// many blocks of one vector a thread). Two layouts:
// - no bias: a flat grid-stride loop over the whole tensor (the tail that does not fill a vector
//   is done by block 0);
// - bias: each thread owns one vector of columns (so its bias values, and in the backward its
//   dbias sums, stay in registers) and walks rows. A block is a tile of `width` column vectors by
//   256 / width rows; the grid is column tiles by P row groups. The backward leaves one partial
//   dbias row per row group in the workspace, and a second, small kernel sums those.
// Columns that do not fill whole vectors, or unaligned buffers, take the same code with 1-element
// vectors.
//
// GELU is computed through the identity 0.5 (1 + tanh(u)) = sigmoid(2u) = 1 / (1 + exp(-2u)):
// one exp2 and one reciprocal per element, with float32 accuracy near a few ulp.

#include <algorithm>
#include <type_traits>

#include "common/cuda_launch.cuh"
#include "common/cuda_util.cuh"
#include "common/gelu.h"
#include "common/registry.h"

namespace blujax {
namespace {

constexpr int kThreads = 256;
// Blocks resident per SM, promised to the compiler through __launch_bounds__ (at most 64, or for
// the bias backward 80, registers a thread) and used to size grids of exactly one wave.
constexpr int kBlocksPerSm = 4;
constexpr int kBiasBwdBlocksPerSm = 3;
constexpr int kMaxWidth = 32;    // column vectors in a tile row: one warp
// Vectors of each input a thread loads before using them: 64 bytes (float32) or 32 bytes
// (bfloat16, whose 8-element vectors need twice the registers once converted) per input, which
// with 1024 threads an SM keeps well over the ~20 KiB per SM that HBM3's latency asks for.
template <int kVec> __host__ __device__ constexpr int UnrollFor() { return kVec >= 8 ? 2 : 4; }
// The forward's blocks each pass once over their vectors, and for float32 vectors many small
// blocks beat fewer longer-lived ones: one vector a thread kept up with XLA's fusion where four
// fell behind; bfloat16 kept two (one measured slower).
template <int kVec> __host__ __device__ constexpr int FwdUnrollFor() {
  return kVec == 4 ? 1 : UnrollFor<kVec>();
}

// -2u log2(e) = v (kE1 + kE3 v^2), with u = sqrt(2/pi) (v + 0.044715 v^3).
constexpr double kLog2e = 1.4426950408889634;
constexpr float kE1 = float(-2.0 * kGeluSqrt2OverPi * kLog2e);
constexpr float kE3 = float(-2.0 * kGeluSqrt2OverPi * kGeluCubic * kLog2e);
// gelu'(v) = s + s v (1 - s) (kD1 + kD3 v^2), s = sigmoid(2u).
constexpr float kD1 = float(2.0 * kGeluSqrt2OverPi);
constexpr float kD3 = float(6.0 * kGeluSqrt2OverPi * kGeluCubic);

// sigmoid(2u); 0 for v -> -inf (the reciprocal of inf), 1 for v -> +inf.
__device__ __forceinline__ float GeluSigmoid(float v, float v2) {
  return __fdividef(1.f, 1.f + exp2f(v * fmaf(kE3, v2, kE1)));
}

__device__ __forceinline__ float Gelu(float v) { return v * GeluSigmoid(v, v * v); }

// Grouped so that a saturated s (0 or 1) zeroes the second term without meeting an overflowed
// v^3 first, as the spec's tanh derivative does, until v^2 itself overflows.
__device__ __forceinline__ float GeluGrad(float v) {
  const float v2 = v * v, s = GeluSigmoid(v, v2);
  return fmaf(s * v, (1.f - s) * fmaf(kD3, v2, kD1), s);
}

// kVec consecutive elements: one 16-byte access for the packed paths, one element otherwise.
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Vec {
  T v[kVec];
};

// Loads stay in the storage type until used: a bfloat16 vector then takes 4 registers, not 8.
template <typename T, int kVec>
__device__ __forceinline__ Vec<T, kVec> LoadVec(const T* p) {
  return *reinterpret_cast<const Vec<T, kVec>*>(p);
}

template <typename T, int kVec>
__device__ __forceinline__ void StoreFloats(T* p, const float (&in)[kVec]) {
  Vec<T, kVec> a;
  if constexpr (std::is_same_v<T, __nv_bfloat16> && kVec % 2 == 0) {
    // Two roundings in one instruction.
#pragma unroll
    for (int k = 0; k < kVec; k += 2) {
      const __nv_bfloat162 h = __floats2bfloat162_rn(in[k], in[k + 1]);
      a.v[k] = h.x;
      a.v[k + 1] = h.y;
    }
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k) a.v[k] = FromFloat<T>(in[k]);
  }
  *reinterpret_cast<Vec<T, kVec>*>(p) = a;
}

// ----------------------------------------------------------------------------------------------
// No bias: flat over all n elements. Each block step covers kThreads * kUnroll vectors, a warp
// reading 32 consecutive vectors per load.
template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
GeluFwdFlatKernel(const T* __restrict__ x, T* __restrict__ y, int64_t n) {
  constexpr int kUnroll = FwdUnrollFor<kVec>();
  const int64_t vecs = n / kVec;
  for (int64_t first = int64_t(blockIdx.x) * kThreads * kUnroll; first < vecs;
       first += int64_t(gridDim.x) * kThreads * kUnroll) {
    Vec<T, kVec> a[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = first + u * kThreads + threadIdx.x;
      if (i < vecs) a[u] = LoadVec<T, kVec>(x + i * kVec);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = first + u * kThreads + threadIdx.x;
      if (i < vecs) {
        float out[kVec];
#pragma unroll
        for (int k = 0; k < kVec; ++k) out[k] = Gelu(ToFloat(a[u].v[k]));
        StoreFloats<T, kVec>(y + i * kVec, out);
      }
    }
  }
  const int64_t tail = vecs * kVec + threadIdx.x;
  if (blockIdx.x == 0 && tail < n) y[tail] = FromFloat<T>(Gelu(ToFloat(x[tail])));
}

template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
GeluBwdFlatKernel(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx,
                  int64_t n) {
  constexpr int kUnroll = UnrollFor<kVec>();
  const int64_t vecs = n / kVec;
  for (int64_t first = int64_t(blockIdx.x) * kThreads * kUnroll; first < vecs;
       first += int64_t(gridDim.x) * kThreads * kUnroll) {
    Vec<T, kVec> d[kUnroll], a[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = first + u * kThreads + threadIdx.x;
      if (i < vecs) {
        d[u] = LoadVec<T, kVec>(dy + i * kVec);
        a[u] = LoadVec<T, kVec>(x + i * kVec);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = first + u * kThreads + threadIdx.x;
      if (i < vecs) {
        float out[kVec];
#pragma unroll
        for (int k = 0; k < kVec; ++k) out[k] = ToFloat(d[u].v[k]) * GeluGrad(ToFloat(a[u].v[k]));
        StoreFloats<T, kVec>(dx + i * kVec, out);
      }
    }
  }
  const int64_t tail = vecs * kVec + threadIdx.x;
  if (blockIdx.x == 0 && tail < n)
    dx[tail] = FromFloat<T>(ToFloat(dy[tail]) * GeluGrad(ToFloat(x[tail])));
}

// ----------------------------------------------------------------------------------------------
// Bias: tiles of (1 << log_width) column vectors by kThreads >> log_width rows. Thread (tx, ty)
// owns column vector blockIdx.x * width + tx and rows ty, ty + step, ... of its row group
// blockIdx.y, where step = gridDim.y * rows_per_block: the whole grid sweeps the rows together.
struct Tile {
  int width, rows_per_block, tx, ty;
  __device__ Tile(int log_width)
      : width(1 << log_width), rows_per_block(kThreads >> log_width),
        tx(threadIdx.x & ((1 << log_width) - 1)), ty(threadIdx.x >> log_width) {}
};

template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
BiasGeluFwdKernel(const T* __restrict__ x, const T* __restrict__ bias, T* __restrict__ y,
                  int64_t rows, int cols, int log_width) {
  constexpr int kUnroll = FwdUnrollFor<kVec>();
  const Tile t(log_width);
  const int p = blockIdx.x * t.width + t.tx;
  if (p >= cols / kVec) return;
  const int col = p * kVec;
  float b[kVec];
  const Vec<T, kVec> braw = LoadVec<T, kVec>(bias + col);
#pragma unroll
  for (int k = 0; k < kVec; ++k) b[k] = ToFloat(braw.v[k]);
  const int64_t step = int64_t(gridDim.y) * t.rows_per_block;
  for (int64_t r = int64_t(blockIdx.y) * t.rows_per_block + t.ty; r < rows;
       r += kUnroll * step) {
    Vec<T, kVec> a[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (r + u * step < rows) a[u] = LoadVec<T, kVec>(x + (r + u * step) * cols + col);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (r + u * step < rows) {
        float out[kVec];
#pragma unroll
        for (int k = 0; k < kVec; ++k) out[k] = Gelu(ToFloat(a[u].v[k]) + b[k]);
        StoreFloats<T, kVec>(y + (r + u * step) * cols + col, out);
      }
    }
  }
}

// Also leaves this block's sums of dx over its rows in ws[blockIdx.y, its columns].
template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads, kBiasBwdBlocksPerSm)
BiasGeluBwdKernel(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ bias,
                  T* __restrict__ dx, float* __restrict__ ws, int64_t rows, int cols,
                  int log_width) {
  constexpr int kUnroll = UnrollFor<kVec>();
  __shared__ float red[kThreads * kVec];
  const Tile t(log_width);
  const int p = blockIdx.x * t.width + t.tx;
  const bool valid = p < cols / kVec;  // no early return: the block meets at a barrier below
  const int col = p * kVec;
  // bias stays in its storage type (half the registers for bfloat16); dbias sums in float32.
  Vec<T, kVec> b;
  float db[kVec];
#pragma unroll
  for (int k = 0; k < kVec; ++k) db[k] = 0.f;
  if (valid) b = LoadVec<T, kVec>(bias + col);
  const int64_t step = int64_t(gridDim.y) * t.rows_per_block;
  for (int64_t r = int64_t(blockIdx.y) * t.rows_per_block + t.ty; valid && r < rows;
       r += kUnroll * step) {
    Vec<T, kVec> d[kUnroll], a[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (r + u * step < rows) {
        const int64_t off = (r + u * step) * cols + col;
        d[u] = LoadVec<T, kVec>(dy + off);
        a[u] = LoadVec<T, kVec>(x + off);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (r + u * step < rows) {
        float out[kVec];
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          out[k] = ToFloat(d[u].v[k]) * GeluGrad(ToFloat(a[u].v[k]) + ToFloat(b.v[k]));
          db[k] += out[k];  // the unrounded dx
        }
        StoreFloats<T, kVec>(dx + (r + u * step) * cols + col, out);
      }
    }
  }
  // Sum over the block's rows: red[ty][tx * kVec + k], then one thread per tile column.
#pragma unroll
  for (int k = 0; k < kVec; ++k) red[threadIdx.x * kVec + k] = db[k];
  __syncthreads();
  const int tile_cols = t.width * kVec;  // <= kThreads
  const int c = blockIdx.x * tile_cols + threadIdx.x;
  if (threadIdx.x < tile_cols && c < cols) {
    float s = 0.f;
    for (int i = 0; i < t.rows_per_block; ++i) s += red[i * tile_cols + threadIdx.x];
    ws[int64_t(blockIdx.y) * cols + c] = s;
  }
}

// dbias[c] = sum over p of ws[p, c]: 32 columns a block, 16 threads down each column.
constexpr int kReduceCols = 32, kReduceRows = 16;
template <typename T>
__global__ void __launch_bounds__(kReduceCols * kReduceRows)
GeluReducePartials(const float* __restrict__ ws, int64_t partials, int cols,
                   T* __restrict__ dbias) {
  __shared__ float part[kReduceRows][kReduceCols + 1];
  const int c = blockIdx.x * kReduceCols + threadIdx.x;
  float s = 0.f;
  if (c < cols)
    for (int64_t p = threadIdx.y; p < partials; p += kReduceRows) s += ws[p * cols + c];
  part[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    for (int i = 1; i < kReduceRows; ++i) s += part[i][threadIdx.x];
    dbias[c] = FromFloat<T>(s);
  }
}

// ----------------------------------------------------------------------------------------------
// Launchers.

// A tile of `width` column vectors (a power of two, at most one warp's worth, no wider than the
// row needs) and the number of row groups, P, for a grid of about one wave of blocks.
struct BiasGrid {
  int log_width = 0;
  int64_t tiles = 0, groups = 0;
};

// one_pass_rows > 0: instead, enough groups that each block passes once, over that many rows
// of each thread's column (the forward, as FlatBlocks).
inline BiasGrid PlanBiasGrid(int device, int blocks_per_sm, int64_t rows, int64_t vecs,
                             int64_t max_groups, int64_t one_pass_rows = 0) {
  BiasGrid g;
  while ((int64_t{1} << g.log_width) < std::min<int64_t>(vecs, kMaxWidth)) ++g.log_width;
  const int64_t width = int64_t{1} << g.log_width, rows_per_block = kThreads / width;
  g.tiles = (vecs + width - 1) / width;
  const int64_t target = int64_t(SmCount(device)) * blocks_per_sm;
  // Whole waves only: with tiles x groups just over one wave, the few blocks left over run
  // their full share of rows alone afterwards, and the whole takes nearly two waves' time.
  g.groups = std::max<int64_t>(1, target / g.tiles);
  if (one_pass_rows > 0) {
    const int64_t per_group = rows_per_block * one_pass_rows;
    g.groups = (rows + per_group - 1) / per_group;
  }
  g.groups = std::min({g.groups, (rows + rows_per_block - 1) / rows_per_block, max_groups,
                       int64_t{65535}});
  g.groups = std::max<int64_t>(1, g.groups);
  return g;
}

// The flat kernels' grid: one wave of blocks striding over the tensor (the backward, whose
// loads are twice as many), or one block per kThreads * kUnroll vectors, each block passing
// once (the forward: with a wave of blocks each waiting on its own loads, it fell behind XLA's
// one-pass elementwise fusion in float32).
template <int kVec>
unsigned FlatBlocks(int device, int64_t vecs, bool one_pass) {
  const int64_t unroll = one_pass ? FwdUnrollFor<kVec>() : UnrollFor<kVec>();
  const int64_t per_block = int64_t(kThreads) * unroll;
  const int64_t all = (vecs + per_block - 1) / per_block;
  const int64_t cap = one_pass ? int64_t{0x7fffffff} : int64_t(SmCount(device)) * kBlocksPerSm;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(all, cap)));
}

// kVec for 16-byte access when every buffer is 16-byte aligned (and, with a bias, rows are whole
// vectors); 1 otherwise.
template <typename T, typename F>
void WithVec(bool packed, F&& f) {
  if (packed) f(std::integral_constant<int, 16 / sizeof(T)>{});
  else f(std::integral_constant<int, 1>{});
}

template <typename T>
void LaunchFwd(cudaStream_t stream, int device, const T* x, const T* bias, T* y, RowsCols s) {
  constexpr int kPack = 16 / sizeof(T);
  const int64_t n = s.rows * s.cols;
  if (!bias) {
    WithVec<T>(Aligned16(x) && Aligned16(y), [&](auto vec) {
      constexpr int kVec = decltype(vec)::value;
      GeluFwdFlatKernel<T, kVec>
          <<<FlatBlocks<kVec>(device, n / kVec, true), kThreads, 0, stream>>>(x, y, n);
    });
    return;
  }
  const bool packed = s.cols % kPack == 0 && Aligned16(x) && Aligned16(bias) && Aligned16(y);
  WithVec<T>(packed, [&](auto vec) {
    constexpr int kVec = decltype(vec)::value;
    const BiasGrid g = PlanBiasGrid(device, kBlocksPerSm, s.rows, s.cols / kVec, int64_t{65535},
                                    FwdUnrollFor<kVec>());
    BiasGeluFwdKernel<T, kVec>
        <<<dim3(static_cast<unsigned>(g.tiles), static_cast<unsigned>(g.groups)), kThreads, 0,
           stream>>>(x, bias, y, s.rows, static_cast<int>(s.cols), g.log_width);
  });
}

template <typename T>
ffi::Error LaunchBwd(const char* op, cudaStream_t stream, int device, const T* dy, const T* x,
                     const T* bias, T* dx, T* dbias, float* ws, int64_t max_groups,
                     RowsCols s) {
  constexpr int kPack = 16 / sizeof(T);
  const int64_t n = s.rows * s.cols;
  if (!bias) {
    WithVec<T>(Aligned16(dy) && Aligned16(x) && Aligned16(dx), [&](auto vec) {
      constexpr int kVec = decltype(vec)::value;
      GeluBwdFlatKernel<T, kVec>
          <<<FlatBlocks<kVec>(device, n / kVec, false), kThreads, 0, stream>>>(dy, x, dx, n);
    });
    return ffi::Error::Success();
  }
  int64_t groups = 0;  // partial rows written; none for zero rows, so dbias comes out zero
  if (s.rows > 0) {
    const bool packed = s.cols % kPack == 0 && Aligned16(dy) && Aligned16(x) &&
                        Aligned16(bias) && Aligned16(dx);
    WithVec<T>(packed, [&](auto vec) {
      constexpr int kVec = decltype(vec)::value;
      const BiasGrid g = PlanBiasGrid(device, kBiasBwdBlocksPerSm, s.rows, s.cols / kVec,
                                       max_groups);
      groups = g.groups;
      BiasGeluBwdKernel<T, kVec>
          <<<dim3(static_cast<unsigned>(g.tiles), static_cast<unsigned>(g.groups)), kThreads, 0,
             stream>>>(dy, x, bias, dx, ws, s.rows, static_cast<int>(s.cols), g.log_width);
    });
    BLUJAX_RETURN_IF_ERROR(LastCudaError(op));
  }
  const dim3 threads(kReduceCols, kReduceRows);
  GeluReducePartials<T><<<static_cast<unsigned>((s.cols + kReduceCols - 1) / kReduceCols),
                          threads, 0, stream>>>(ws, groups, static_cast<int>(s.cols), dbias);
  return ffi::Error::Success();
}

ffi::Error GeluFwdImpl(const char* op, cudaStream_t stream, int device, ffi::AnyBuffer x,
                       const ffi::AnyBuffer* bias, ffi::Result<ffi::AnyBuffer> y) {
  RowsCols s;
  BLUJAX_RETURN_IF_ERROR(CheckGeluFwd(op, /*allow_f64=*/false, x, bias, *y, &s));
  if (s.rows * s.cols == 0) return ffi::Error::Success();
  const void* b = bias ? bias->untyped_data() : nullptr;
  if (x.element_type() == ffi::DataType::F32)
    LaunchFwd<float>(stream, device, static_cast<const float*>(x.untyped_data()),
                     static_cast<const float*>(b), static_cast<float*>(y->untyped_data()), s);
  else
    LaunchFwd<__nv_bfloat16>(stream, device,
                             static_cast<const __nv_bfloat16*>(x.untyped_data()),
                             static_cast<const __nv_bfloat16*>(b),
                             static_cast<__nv_bfloat16*>(y->untyped_data()), s);
  return LastCudaError(op);
}

ffi::Error GeluBwdImpl(const char* op, cudaStream_t stream, int device, ffi::AnyBuffer dy,
                       ffi::AnyBuffer x, const ffi::AnyBuffer* bias,
                       ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer>* dbias,
                       ffi::Result<ffi::AnyBuffer>* workspace) {
  RowsCols s;
  int64_t partials = 0;
  BLUJAX_RETURN_IF_ERROR(CheckGeluBwd(op, /*allow_f64=*/false, dy, x, bias, *dx,
                                      OptionalResult(dbias), OptionalResult(workspace), &s,
                                      &partials));
  // An empty x leaves nothing to write but dbias (zeros where there are no rows).
  if (!bias && s.rows * s.cols == 0) return ffi::Error::Success();
  if (s.cols == 0) return ffi::Error::Success();  // dbias is empty too
  const void* b = bias ? bias->untyped_data() : nullptr;
  void* db = bias ? (*dbias)->untyped_data() : nullptr;
  float* ws = bias ? static_cast<float*>((*workspace)->untyped_data()) : nullptr;
  if (x.element_type() == ffi::DataType::F32) {
    BLUJAX_RETURN_IF_ERROR(LaunchBwd<float>(
        op, stream, device, static_cast<const float*>(dy.untyped_data()),
        static_cast<const float*>(x.untyped_data()), static_cast<const float*>(b),
        static_cast<float*>(dx->untyped_data()), static_cast<float*>(db), ws, partials, s));
  } else {
    using B = __nv_bfloat16;
    BLUJAX_RETURN_IF_ERROR(LaunchBwd<B>(
        op, stream, device, static_cast<const B*>(dy.untyped_data()),
        static_cast<const B*>(x.untyped_data()), static_cast<const B*>(b),
        static_cast<B*>(dx->untyped_data()), static_cast<B*>(db), ws, partials, s));
  }
  return LastCudaError(op);
}


ffi::Error GeluFwd(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                   ffi::Result<ffi::AnyBuffer> y) {
  return GeluFwdImpl("blujax_gelu_fwd", stream, device, x, nullptr, y);
}

ffi::Error BiasGeluFwd(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                       ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y) {
  return GeluFwdImpl("blujax_bias_gelu_fwd", stream, device, x, &bias, y);
}

ffi::Error GeluBwd(cudaStream_t stream, int32_t device, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                   ffi::Result<ffi::AnyBuffer> dx) {
  return GeluBwdImpl("blujax_gelu_bwd", stream, device, dy, x, nullptr, dx, nullptr, nullptr);
}

ffi::Error BiasGeluBwd(cudaStream_t stream, int32_t device, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                       ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> dx,
                       ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> workspace) {
  return GeluBwdImpl("blujax_bias_gelu_bwd", stream, device, dy, x, &bias, dx, &dbias,
                     &workspace);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kGeluFwd, GeluFwd,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Ctx<Device>()
                           .Arg<ffi::AnyBuffer>()   // x [..., C]
                           .Ret<ffi::AnyBuffer>(),  // y [..., C]
                       kGraphSafe);

XLA_FFI_DEFINE_HANDLER(kBiasGeluFwd, BiasGeluFwd,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Ctx<Device>()
                           .Arg<ffi::AnyBuffer>()   // x [..., C]
                           .Arg<ffi::AnyBuffer>()   // bias [C]
                           .Ret<ffi::AnyBuffer>(),  // y [..., C]
                       kGraphSafe);

XLA_FFI_DEFINE_HANDLER(kGeluBwd, GeluBwd,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Ctx<Device>()
                           .Arg<ffi::AnyBuffer>()   // dy [..., C]
                           .Arg<ffi::AnyBuffer>()   // x [..., C]
                           .Ret<ffi::AnyBuffer>(),  // dx [..., C]
                       kGraphSafe);

XLA_FFI_DEFINE_HANDLER(kBiasGeluBwd, BiasGeluBwd,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Ctx<Device>()
                           .Arg<ffi::AnyBuffer>()   // dy [..., C]
                           .Arg<ffi::AnyBuffer>()   // x [..., C]
                           .Arg<ffi::AnyBuffer>()   // bias [C]
                           .Ret<ffi::AnyBuffer>()   // dx [..., C]
                           .Ret<ffi::AnyBuffer>()   // dbias [C]
                           .Ret<ffi::AnyBuffer>(),  // workspace [P, C] f32
                       kGraphSafe);

BLUJAX_REGISTER(blujax_gelu_fwd, kGeluFwd);
BLUJAX_REGISTER(blujax_bias_gelu_fwd, kBiasGeluFwd);
BLUJAX_REGISTER(blujax_gelu_bwd, kGeluBwd);
BLUJAX_REGISTER(blujax_bias_gelu_bwd, kBiasGeluBwd);

}  // namespace blujax
