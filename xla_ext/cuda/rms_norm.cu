// RMSNorm on the GPU (float32 and bfloat16, float32 statistics); the CPU twin is
// xla_ext/cpu/rms_norm.cc and the handler contract common/rms_norm.h.
//
// The LayerNorm kernels' design (cuda/layernorm.cu) with one reduction instead of two: a row is
// read once into registers in 16-byte packs by a group of kGroup threads (a warp for C <= 1024,
// wider groups for wider rows), the sum of squares is reduced on the registers, and y is
// written once. The add variant adds the residual as it loads, rounds the sum to x's dtype and
// writes it beside y. The backward reads dy and x (the saved sum, for the add variant) once,
// writes dx (plus dsum), and adds each thread's share of dweight into its group's slice of
// shared memory across all the rows the group visits; blocks (one wave of them) leave one
// partial row each in the workspace and a second, small kernel sums those in a fixed order, so
// dweight is deterministic. Rows whose width or alignment does not allow 16-byte packs, or
// wider than the register budget (C > 32768 forward, C > 16384 backward), take a plain
// block-per-row path that re-reads the row from memory (correct for any shape, not tuned).
//
// Not carried over from LayerNorm (yet): its pipelined forward (cp.async staging of the next
// rows) and its bfloat16 pack-a-thread backward, both measured faster there at some widths;
// they are worth an A/B here on a GPU.

#include <algorithm>

#include "common/cuda_launch.cuh"
#include "common/cuda_util.cuh"
#include "common/registry.h"
#include "common/rms_norm.h"
#include "common/row_norm.cuh"

namespace blujax {
namespace {

// ----------------------------------------------------------------------------------------------
// Forward, register path: one row per group of kGroup threads, kVecs packs per thread, kept as
// packs (a bfloat16 pack in 4 registers) between the reduction and the write.
template <typename T, int kGroup, int kVecs, bool kAdd>
__global__ void __launch_bounds__(BlockFor<kGroup>())
RmsNormFwdKernel(const T* __restrict__ x, const T* __restrict__ residual,
                 const T* __restrict__ weight, T* __restrict__ y, T* __restrict__ sum,
                 float* __restrict__ rstd, int64_t rows, int cols, float eps) {
  constexpr int kPack = Pack<T>::kSize;
  constexpr int kThreads = BlockFor<kGroup>(), kGroups = kThreads / kGroup;
  __shared__ float red[2 * kThreads / 32];
  const int lane = threadIdx.x % kGroup, group = threadIdx.x / kGroup;
  const int packs = cols / kPack;
  const float inv_cols = 1.f / cols;

  // The loop bound is the same for the whole block, so the group reductions may synchronise it.
  for (int64_t base = int64_t(blockIdx.x) * kGroups; base < rows;
       base += int64_t(gridDim.x) * kGroups) {
    const int64_t row = base + group;
    const bool valid = row < rows;
    Pack<T> a[kVecs];
    float squares = 0.f, unused = 0.f;
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int p = lane + i * kGroup;
      if (valid && p < packs) {
        const int64_t off = row * cols + int64_t(p) * kPack;
        a[i] = LoadPackNoL1(x + off);
        if constexpr (kAdd) {
          const Pack<T> r = LoadPackNoL1(residual + off);
          float s[kPack];
#pragma unroll
          for (int k = 0; k < kPack; ++k) s[k] = PackElem(a[i], k) + PackElem(r, k);
          // Rounded to T: the statistics are those of the sum returned.
          a[i] = PackFromFloats<T>(s);
          StorePackNoL1(sum + off, a[i]);
        }
#pragma unroll
        for (int k = 0; k < kPack; ++k) {
          const float v = PackElem(a[i], k);
          squares = fmaf(v, v, squares);
        }
      }
    }
    GroupSum2<kGroup, kThreads>(squares, unused, red);
    const float rs = rsqrtf(squares * inv_cols + eps);
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int p = lane + i * kGroup;
      if (valid && p < packs) {
        const Pack<T> w = LoadPack(weight + p * kPack);
        float o[kPack];
#pragma unroll
        for (int k = 0; k < kPack; ++k) o[k] = PackElem(a[i], k) * rs * PackElem(w, k);
        StorePackNoL1(y + row * cols + int64_t(p) * kPack, PackFromFloats<T>(o));
      }
    }
    if (valid && lane == 0) rstd[row] = rs;
  }
}

// Forward, any shape: a block per row, two passes over the row in memory.
template <typename T, bool kAdd>
__global__ void __launch_bounds__(kBlock)
RmsNormFwdAnyKernel(const T* x, const T* __restrict__ residual, const T* __restrict__ weight,
                    T* __restrict__ y, T* sum, float* __restrict__ rstd, int64_t rows, int cols,
                    float eps) {
  __shared__ float red[2 * kBlock / 32];
  const float inv_cols = 1.f / cols;
  // The second pass reads the row from `sum` for the add variant: each thread reads back only
  // the elements it wrote itself, so no barrier is needed for them.
  const T* src = kAdd ? sum : x;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t off = row * cols;
    float squares = 0.f, unused = 0.f;
    for (int c = threadIdx.x; c < cols; c += kBlock) {
      T a = x[off + c];
      if constexpr (kAdd) {
        a = FromFloat<T>(ToFloat(a) + ToFloat(residual[off + c]));
        sum[off + c] = a;
      }
      const float v = ToFloat(a);
      squares = fmaf(v, v, squares);
    }
    GroupSum2<kBlock>(squares, unused, red);
    const float rs = rsqrtf(squares * inv_cols + eps);
    for (int c = threadIdx.x; c < cols; c += kBlock)
      y[off + c] = FromFloat<T>(ToFloat(src[off + c]) * rs * ToFloat(weight[c]));
    if (threadIdx.x == 0) rstd[row] = rs;
  }
}

// ----------------------------------------------------------------------------------------------
// Backward, shaped as LayerNorm's (common/row_norm.cuh: BwdBlockFor, kBwdFloats).
// Backward, register path: a group of kGroup threads takes a row at a time, holding its dy and
// x packs in registers. A thread's columns are the same for every row, so it adds its share of
// dweight into its group's own slice of shared memory without atomics; at the end the block
// sums its groups' slices into its partial row ws[blockIdx.x].
// With xhat = x * rstd and g = dy * weight:
//   dx = rstd * (g - xhat * mean(g * xhat)) = g * rstd + xhat * c1,  c1 = -rstd * mean(g * xhat)
// and mean(g * xhat) = rstd * mean(g * x): one sum a row.
template <typename T, int kGroup, int kVecs, int kThreads, bool kAdd>
__global__ void __launch_bounds__(kThreads, BwdMinBlocks<kThreads>())
RmsNormBwdKernel(const T* __restrict__ dy, const T* __restrict__ dsum, const T* __restrict__ x,
                 const T* __restrict__ weight, const float* __restrict__ rstd,
                 T* __restrict__ dx, float* __restrict__ ws, int64_t rows, int cols) {
  constexpr int kPack = Pack<T>::kSize;
  constexpr int kGroups = kThreads / kGroup;
  __shared__ float red[2 * kThreads / 32];
  // Per group: dweight stored as [chunk][pack][4] with chunk = a float4 of a pack (bfloat16
  // packs hold two), so the float4s a warp updates together are consecutive and free of bank
  // conflicts.
  extern __shared__ float4 acc4[];
  constexpr int kChunks = kPack / 4;
  const int lane = threadIdx.x % kGroup, group = threadIdx.x / kGroup;
  const int packs = cols / kPack;
  const float inv_cols = 1.f / cols;
  float4* dw_acc = acc4 + int64_t(group) * (cols / 4);
  // Each thread zeroes exactly the float4s it accumulates, so no barrier is needed yet.
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int p = lane + i * kGroup;
    if (p < packs) {
#pragma unroll
      for (int c = 0; c < kChunks; ++c) dw_acc[c * packs + p] = float4{};
    }
  }

  // The weight is read again for every row, through the read-only cache: holding bfloat16's in
  // registers, as LayerNorm's backward does, made these kernels spill.
  // Several groups a block read through the read-only path, a row a block without L1
  // allocation (LayerNorm's measured choice).
  auto load_row = [](const T* p) {
    if constexpr (kGroups > 1) return LoadPack(p);
    else return LoadPackNoL1(p);
  };

  for (int64_t base = int64_t(blockIdx.x) * kGroups; base < rows;
       base += int64_t(gridDim.x) * kGroups) {
    const int64_t row = base + group;
    const bool valid = row < rows;
    const float rs = valid ? rstd[row] : 0.f;
    Pack<T> d[kVecs], a[kVecs];
    float sum_gx = 0.f, unused = 0.f;
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int p = lane + i * kGroup;
      if (valid && p < packs) {
        const int64_t off = row * cols + int64_t(p) * kPack;
        d[i] = load_row(dy + off);
        a[i] = load_row(x + off);
      }
    }
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int p = lane + i * kGroup;
      if (valid && p < packs) {
        const Pack<T> w = LoadPack(weight + p * kPack);
#pragma unroll
        for (int k = 0; k < kPack; ++k)
          sum_gx = fmaf(PackElem(d[i], k) * PackElem(w, k), PackElem(a[i], k), sum_gx);
      }
    }
    GroupSum2<kGroup, kThreads>(sum_gx, unused, red);
    const float c1 = -rs * (rs * sum_gx * inv_cols);
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int p = lane + i * kGroup;
      if (valid && p < packs) {
        const int64_t off = row * cols + int64_t(p) * kPack;
        const Pack<T> w = LoadPack(weight + p * kPack);
        Pack<T> ds;
        if constexpr (kAdd) ds = LoadPackNoL1(dsum + off);
        float o[kPack], dwv[kPack];
#pragma unroll
        for (int k = 0; k < kPack; ++k) {
          const float dd = PackElem(d[i], k), xhat = PackElem(a[i], k) * rs;
          o[k] = fmaf(dd * PackElem(w, k), rs, xhat * c1);
          if constexpr (kAdd) o[k] += PackElem(ds, k);
          dwv[k] = dd * xhat;
        }
        StorePackNoL1(dx + off, PackFromFloats<T>(o));
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
          float4& w4 = dw_acc[c * packs + p];
          w4 = float4{w4.x + dwv[4 * c], w4.y + dwv[4 * c + 1], w4.z + dwv[4 * c + 2],
                      w4.w + dwv[4 * c + 3]};
        }
      }
    }
  }

  __syncthreads();
  const float* acc = reinterpret_cast<const float*>(acc4);
  float* part = ws + int64_t(blockIdx.x) * cols;
  for (int col = threadIdx.x; col < cols; col += kThreads) {
    // Column col sits at [chunk][pack][lane of float4].
    const int p = col / kPack, r = col % kPack;
    const int at = ((r / 4) * packs + p) * 4 + r % 4;
    float total = 0.f;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) total += acc[int64_t(g) * cols + at];
    part[col] = total;
  }
}

// Backward, any shape: a block per row, two passes; column c of the block's partial row is
// owned by thread c % kBlock, which zeroes it and accumulates it in place.
template <typename T, bool kAdd>
__global__ void __launch_bounds__(kBlock)
RmsNormBwdAnyKernel(const T* __restrict__ dy, const T* __restrict__ dsum,
                    const T* __restrict__ x, const T* __restrict__ weight,
                    const float* __restrict__ rstd, T* __restrict__ dx, float* __restrict__ ws,
                    int64_t rows, int cols) {
  __shared__ float red[2 * kBlock / 32];
  const float inv_cols = 1.f / cols;
  float* part = ws + int64_t(blockIdx.x) * cols;
  for (int c = threadIdx.x; c < cols; c += kBlock) part[c] = 0.f;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t off = row * cols;
    const float rs = rstd[row];
    float sum_gx = 0.f, unused = 0.f;
    for (int c = threadIdx.x; c < cols; c += kBlock)
      sum_gx = fmaf(ToFloat(dy[off + c]) * ToFloat(weight[c]), ToFloat(x[off + c]), sum_gx);
    GroupSum2<kBlock>(sum_gx, unused, red);
    const float c1 = -rs * (rs * sum_gx * inv_cols);
    for (int c = threadIdx.x; c < cols; c += kBlock) {
      const float d = ToFloat(dy[off + c]), xhat = ToFloat(x[off + c]) * rs;
      float out = fmaf(d * ToFloat(weight[c]), rs, xhat * c1);
      if constexpr (kAdd) out += ToFloat(dsum[off + c]);
      dx[off + c] = FromFloat<T>(out);
      part[c] += d * xhat;
    }
  }
}

// dweight[c] = the sum over blocks of ws[b, c], in a fixed order. There are only C / 32 blocks,
// so each thread keeps several independent loads in flight rather than waiting on one partial
// row at a time.
constexpr int kReduceX = 32, kReduceY = 32, kReduceUnroll = 8;
template <typename T>
__global__ void __launch_bounds__(kReduceX * kReduceY)
RmsNormReducePartials(const float* __restrict__ ws, int partials, int cols,
                      T* __restrict__ dweight) {
  __shared__ float tile[kReduceY][kReduceX + 1];
  const int j = blockIdx.x * kReduceX + threadIdx.x;
  float acc[kReduceUnroll] = {};
  if (j < cols) {
    int p = threadIdx.y;
    for (; p + (kReduceUnroll - 1) * kReduceY < partials; p += kReduceUnroll * kReduceY) {
#pragma unroll
      for (int u = 0; u < kReduceUnroll; ++u)
        acc[u] += ws[int64_t(p + u * kReduceY) * cols + j];
    }
    for (; p < partials; p += kReduceY) acc[0] += ws[int64_t(p) * cols + j];
  }
  float s = 0.f;
#pragma unroll
  for (int u = 0; u < kReduceUnroll; ++u) s += acc[u];
  tile[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && j < cols) {
    for (int r = 1; r < kReduceY; ++r) s += tile[r][threadIdx.x];
    dweight[j] = FromFloat<T>(s);
  }
}

// ----------------------------------------------------------------------------------------------
// Launchers.

// kAdd: residual and sum are not null.
template <typename T, bool kAdd>
void LaunchFwd(cudaStream_t stream, int device, const void* x, const void* residual,
               const void* weight, void* y, void* sum, float* rstd, RowsCols rc, float eps) {
  constexpr int kPack = Pack<T>::kSize, kVecs = kFwdFloats / kPack;
  const int cols = static_cast<int>(rc.cols);
  const bool packed = cols % kPack == 0 && Aligned16(x) && Aligned16(y) && Aligned16(weight) &&
                      (!kAdd || (Aligned16(residual) && Aligned16(sum)));
  const int group = packed ? GroupFor(cols / kPack, kVecs) : 0;
  auto launch = [&](auto kernel, int64_t blocks, int threads) {
    // As many blocks as fit on the device at once; each loops over its share of the rows.
    const int64_t resident = int64_t(SmCount(device)) * BlocksPerSm(kernel, threads, 0);
    kernel<<<static_cast<unsigned>(std::min(blocks, resident)), threads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(residual), static_cast<const T*>(weight),
        static_cast<T*>(y), static_cast<T*>(sum), rstd, rc.rows, cols, eps);
  };
  if (group) {
    WithGroup(group, [&](auto g) {
      constexpr int kGroup = decltype(g)::value, kThreads = BlockFor<kGroup>();
      constexpr int kGroups = kThreads / kGroup;
      launch(RmsNormFwdKernel<T, kGroup, kVecs, kAdd>, (rc.rows + kGroups - 1) / kGroups,
             kThreads);
    });
  } else {
    launch(RmsNormFwdAnyKernel<T, kAdd>, rc.rows, kBlock);
  }
}

// kAdd: dsum is not null. ws holds [partials, C].
template <typename T, bool kAdd>
ffi::Error LaunchBwd(const char* op, cudaStream_t stream, int device, const void* dy,
                     const void* dsum, const void* x, const void* weight, const float* rstd,
                     void* dx, void* dweight, float* ws, int64_t partials, RowsCols rc) {
  constexpr int kPack = Pack<T>::kSize, kVecs = BwdVecs<T>();
  const int cols = static_cast<int>(rc.cols);
  const bool packed = cols % kPack == 0 && Aligned16(dy) && Aligned16(x) && Aligned16(dx) &&
                      Aligned16(weight) && (!kAdd || Aligned16(dsum));
  int64_t blocks = 0;
  auto run = [&](auto kernel, int64_t rows_per_block, int threads, size_t smem) {
    // As many blocks as fit on the device at once (each leaves one partial row to reduce), no
    // more than the workspace holds or the rows need.
    const int64_t resident = int64_t(SmCount(device)) * BlocksPerSm(kernel, threads, smem);
    blocks = std::max<int64_t>(1, std::min({partials, resident,
                                            (rc.rows + rows_per_block - 1) / rows_per_block}));
    kernel<<<static_cast<unsigned>(blocks), threads, smem, stream>>>(
        static_cast<const T*>(dy), static_cast<const T*>(dsum), static_cast<const T*>(x),
        static_cast<const T*>(weight), rstd, static_cast<T*>(dx), ws, rc.rows, cols);
  };
  bool launched = false;
  const int group = packed ? GroupFor(cols / kPack, kVecs) : 0;
  if (group) {
    WithGroup(group, [&](auto g) {
      constexpr int kGroup = decltype(g)::value, kThreads = BwdBlockFor<kGroup>();
      constexpr int kGroups = kThreads / kGroup;
      const size_t smem = size_t(kGroups) * cols * sizeof(float);  // per-group dweight
      constexpr auto kKernel = RmsNormBwdKernel<T, kGroup, kVecs, kThreads, kAdd>;
      if (smem <= kMaxSharedBytes || smem <= SharedMemoryLimit<kKernel>(device)) {
        run(kKernel, kGroups, kThreads, smem);
        launched = true;
      }
    });
  }
  if (!launched) run(RmsNormBwdAnyKernel<T, kAdd>, 1, kBlock, 0);
  BLUJAX_RETURN_IF_ERROR(LastCudaError(op));
  const dim3 threads(kReduceX, kReduceY);
  const unsigned grid = static_cast<unsigned>((cols + kReduceX - 1) / kReduceX);
  RmsNormReducePartials<T><<<grid, threads, 0, stream>>>(ws, static_cast<int>(blocks), cols,
                                                         static_cast<T*>(dweight));
  return ffi::Error::Success();
}

// residual/sum are null for the plain op.
ffi::Error RmsNormFwdImpl(const char* op, cudaStream_t stream, int device, ffi::AnyBuffer x,
                          const ffi::AnyBuffer* residual, ffi::AnyBuffer weight,
                          ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer>* sum,
                          ffi::Result<ffi::AnyBuffer> rstd, double eps) {
  RowsCols rc;
  BLUJAX_RETURN_IF_ERROR(CheckRmsNormFwd(op, /*allow_f64=*/false, x, residual, weight, *y,
                                         OptionalResult(sum), *rstd, eps, &rc));
  if (rc.rows == 0) return ffi::Error::Success();
  const bool f32 = x.element_type() == ffi::DataType::F32;
  auto launch = residual ? (f32 ? LaunchFwd<float, true> : LaunchFwd<__nv_bfloat16, true>)
                         : (f32 ? LaunchFwd<float, false> : LaunchFwd<__nv_bfloat16, false>);
  launch(stream, device, x.untyped_data(), residual ? residual->untyped_data() : nullptr,
         weight.untyped_data(), y->untyped_data(), sum ? (*sum)->untyped_data() : nullptr,
         static_cast<float*>(rstd->untyped_data()), rc, static_cast<float>(eps));
  return LastCudaError(op);
}

// dsum is null for the plain op.
ffi::Error RmsNormBwdImpl(const char* op, cudaStream_t stream, int device, ffi::AnyBuffer dy,
                          const ffi::AnyBuffer* dsum, ffi::AnyBuffer x, ffi::AnyBuffer weight,
                          ffi::AnyBuffer rstd, ffi::Result<ffi::AnyBuffer> dx,
                          ffi::Result<ffi::AnyBuffer> dweight,
                          ffi::Result<ffi::AnyBuffer> workspace) {
  RowsCols rc;
  int64_t partials = 0;
  BLUJAX_RETURN_IF_ERROR(CheckRmsNormBwd(op, /*allow_f64=*/false, dy, dsum, x, weight, rstd, *dx,
                                         *dweight, *workspace, &rc, &partials));
  const bool f32 = x.element_type() == ffi::DataType::F32;
  auto launch = dsum ? (f32 ? LaunchBwd<float, true> : LaunchBwd<__nv_bfloat16, true>)
                     : (f32 ? LaunchBwd<float, false> : LaunchBwd<__nv_bfloat16, false>);
  BLUJAX_RETURN_IF_ERROR(launch(op, stream, device, dy.untyped_data(),
                                dsum ? dsum->untyped_data() : nullptr, x.untyped_data(),
                                weight.untyped_data(),
                                static_cast<const float*>(rstd.untyped_data()),
                                dx->untyped_data(), dweight->untyped_data(),
                                static_cast<float*>(workspace->untyped_data()), partials, rc));
  return LastCudaError(op);
}

ffi::Error RmsNormFwd(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                      ffi::AnyBuffer weight, ffi::Result<ffi::AnyBuffer> y,
                      ffi::Result<ffi::AnyBuffer> rstd, double eps) {
  return RmsNormFwdImpl("blujax_rms_norm_fwd", stream, device, x, nullptr, weight, y, nullptr,
                        rstd, eps);
}

ffi::Error AddRmsNormFwd(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                         ffi::AnyBuffer residual, ffi::AnyBuffer weight,
                         ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> sum,
                         ffi::Result<ffi::AnyBuffer> rstd, double eps) {
  return RmsNormFwdImpl("blujax_add_rms_norm_fwd", stream, device, x, &residual, weight, y, &sum,
                        rstd, eps);
}

ffi::Error RmsNormBwd(cudaStream_t stream, int32_t device, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                      ffi::AnyBuffer weight, ffi::AnyBuffer rstd, ffi::Result<ffi::AnyBuffer> dx,
                      ffi::Result<ffi::AnyBuffer> dweight,
                      ffi::Result<ffi::AnyBuffer> workspace) {
  return RmsNormBwdImpl("blujax_rms_norm_bwd", stream, device, dy, nullptr, x, weight, rstd, dx,
                        dweight, workspace);
}

ffi::Error AddRmsNormBwd(cudaStream_t stream, int32_t device, ffi::AnyBuffer dy,
                         ffi::AnyBuffer dsum, ffi::AnyBuffer sum, ffi::AnyBuffer weight,
                         ffi::AnyBuffer rstd, ffi::Result<ffi::AnyBuffer> dx,
                         ffi::Result<ffi::AnyBuffer> dweight,
                         ffi::Result<ffi::AnyBuffer> workspace) {
  return RmsNormBwdImpl("blujax_add_rms_norm_bwd", stream, device, dy, &dsum, sum, weight, rstd,
                        dx, dweight, workspace);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kRmsNormFwd, RmsNormFwd,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Ctx<Device>()
                           .Arg<ffi::AnyBuffer>()   // x [..., C]
                           .Arg<ffi::AnyBuffer>()   // weight [C]
                           .Ret<ffi::AnyBuffer>()   // y [..., C]
                           .Ret<ffi::AnyBuffer>()   // rstd [...] f32
                           .Attr<double>("eps"),    // f64, rounded to float here
                       kGraphSafe);

XLA_FFI_DEFINE_HANDLER(kAddRmsNormFwd, AddRmsNormFwd,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Ctx<Device>()
                           .Arg<ffi::AnyBuffer>()   // x [..., C]
                           .Arg<ffi::AnyBuffer>()   // residual [..., C]
                           .Arg<ffi::AnyBuffer>()   // weight [C]
                           .Ret<ffi::AnyBuffer>()   // y [..., C]
                           .Ret<ffi::AnyBuffer>()   // sum = x + residual [..., C]
                           .Ret<ffi::AnyBuffer>()   // rstd [...] f32
                           .Attr<double>("eps"),    // f64, rounded to float here
                       kGraphSafe);

XLA_FFI_DEFINE_HANDLER(kRmsNormBwd, RmsNormBwd,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Ctx<Device>()
                           .Arg<ffi::AnyBuffer>()   // dy [..., C]
                           .Arg<ffi::AnyBuffer>()   // x [..., C]
                           .Arg<ffi::AnyBuffer>()   // weight [C]
                           .Arg<ffi::AnyBuffer>()   // rstd [...]
                           .Ret<ffi::AnyBuffer>()   // dx [..., C]
                           .Ret<ffi::AnyBuffer>()   // dweight [C]
                           .Ret<ffi::AnyBuffer>(),  // workspace [P, C] f32
                       kGraphSafe);

XLA_FFI_DEFINE_HANDLER(kAddRmsNormBwd, AddRmsNormBwd,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Ctx<Device>()
                           .Arg<ffi::AnyBuffer>()   // dy [..., C]
                           .Arg<ffi::AnyBuffer>()   // dsum [..., C], cotangent of the sum output
                           .Arg<ffi::AnyBuffer>()   // sum [..., C]
                           .Arg<ffi::AnyBuffer>()   // weight [C]
                           .Arg<ffi::AnyBuffer>()   // rstd [...]
                           .Ret<ffi::AnyBuffer>()   // dx = dresidual [..., C]
                           .Ret<ffi::AnyBuffer>()   // dweight [C]
                           .Ret<ffi::AnyBuffer>(),  // workspace [P, C] f32
                       kGraphSafe);

BLUJAX_REGISTER(blujax_rms_norm_fwd, kRmsNormFwd);
BLUJAX_REGISTER(blujax_add_rms_norm_fwd, kAddRmsNormFwd);
BLUJAX_REGISTER(blujax_rms_norm_bwd, kRmsNormBwd);
BLUJAX_REGISTER(blujax_add_rms_norm_bwd, kAddRmsNormBwd);

}  // namespace blujax
