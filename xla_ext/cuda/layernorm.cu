// LayerNorm on the GPU (float32 and bfloat16, float32 statistics); the CPU twin is
// xla_ext/cpu/layernorm.cc and the handler contract common/layernorm.h.
//
// Memory-bound, so the design is about bytes: each row is read once into registers in 16-byte
// packs by a group of kGroup threads (a warp for C <= 1024 float32, wider groups for wider rows),
// the two reductions (mean, then variance around it) run on the registers, and the output is
// written once. The plain forward stages the next rows in shared memory while it works on this
// one, so loads never wait on a row's reductions. The backward reads dy and x once, writes dx,
// and adds each thread's share of dweight/dbias into its group's slice of shared memory across
// all the rows the group visits (bfloat16 rows of C <= 1024: into registers, a pack a thread,
// with the next row staged in shared memory as the forward does); blocks (one wave of them)
// leave one partial row each in the workspace and a second, small kernel sums those. Rows whose
// width or alignment does not allow 16-byte packs, or wider than the register budget, take a
// plain block-per-row path that re-reads the row from memory (correct for any shape, not tuned).
//
// The add-bias variant (kXBias) folds in the preceding matmul's bias: sum = x + x_bias + residual,
// and its backward accumulates dx_bias (the column sums of dx = dsum + the LayerNorm's own dx) as
// a third partial row beside dweight and dbias. It is a template flag, so the kernels of the other
// variants compile exactly as they would without it.
//
// The forward kernels are in layernorm_fwd.cuh, the backward kernels in layernorm_bwd.cuh (the
// register path and the sums of the partial rows shared with RMSNorm, templated on the mean
// term: common/row_norm.cuh, as are the launch shapes); this file has the launchers and the
// handlers.

#include <algorithm>

#include "common/cuda_launch.cuh"
#include "common/cuda_util.cuh"
#include "common/layernorm.h"
#include "common/registry.h"
#include "cuda/layernorm_bwd.cuh"
#include "cuda/layernorm_fwd.cuh"

namespace blujax {
namespace {

// ----------------------------------------------------------------------------------------------
// Launchers.

// kXBias: x_bias is not null (nor residual, nor sum).
template <typename T, bool kXBias>
ffi::Error LaunchFwd(cudaStream_t stream, int device, const void* x, const void* x_bias,
                     const void* residual, const void* weight, const void* bias, void* y,
                     void* sum, float* mean, float* rstd, RowsCols rc, float eps) {
  constexpr int kPack = Pack<T>::kSize, kVecs = kFwdFloats / kPack;
  const int cols = static_cast<int>(rc.cols);
  const bool packed = cols % kPack == 0 && Aligned16(x) && Aligned16(y) && Aligned16(weight) &&
                      Aligned16(bias) && (!residual || (Aligned16(residual) && Aligned16(sum))) &&
                      (!kXBias || Aligned16(x_bias));
  const int group = packed ? GroupFor(cols / kPack, kVecs) : 0;
  // The plain op takes the pipelined kernel where its stages fit in shared memory: rows
  // staged two steps ahead in bfloat16, one in float32 (the same bytes; more measured slower).
  bool launched = false;
  if (group && !residual && !kXBias) {
    WithGroup(group, [&](auto g) {
      constexpr int kGroup = decltype(g)::value, kThreads = BlockFor<kGroup>();
      constexpr int kGroups = kThreads / kGroup, kStages = sizeof(T) == 4 ? 2 : 3;
      constexpr auto kKernel = LayerNormFwdPipeKernel<T, kGroup, kVecs, kStages>;
      const int vecs = (cols / kPack + kGroup - 1) / kGroup;
      const size_t smem = size_t(kThreads) * kStages * vecs * sizeof(uint4);
      if (smem > kMaxSharedBytes && smem > SharedMemoryLimit<kKernel>(device)) return;
      const int64_t blocks = std::min<int64_t>((rc.rows + kGroups - 1) / kGroups,
                                               ResidentBlocks(device, kKernel, kThreads, smem));
      kKernel<<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(
          static_cast<const T*>(x), static_cast<const T*>(weight), static_cast<const T*>(bias),
          static_cast<T*>(y), mean, rstd, rc.rows, cols, eps);
      launched = true;
    });
  }
  if (launched) return ffi::Error::Success();
  LaunchFwdRows(
      stream, device, group, rc.rows,
      [](auto g) { return LayerNormFwdKernel<T, decltype(g)::value, kVecs, kXBias>; },
      LayerNormFwdAnyKernel<T, kXBias>, static_cast<const T*>(x), static_cast<const T*>(x_bias),
      static_cast<const T*>(residual), static_cast<const T*>(weight), static_cast<const T*>(bias),
      static_cast<T*>(y), static_cast<T*>(sum), mean, rstd, rc.rows, cols, eps);
  return ffi::Error::Success();
}

// kXBias: dsum and dx_bias are not null, and ws holds [partials, 3, C].
template <typename T, bool kXBias>
ffi::Error LaunchBwd(const char* op, cudaStream_t stream, int device, const void* dy,
                     const void* dsum, const void* x, const void* weight, const float* mean,
                     const float* rstd, void* dx, void* dweight, void* dbias, void* dx_bias,
                     float* ws, int64_t partials, RowsCols rc) {
  using Kernels = LayerNormBwdKernels<T, kXBias>;
  constexpr int kPack = Pack<T>::kSize;
  const int cols = static_cast<int>(rc.cols);
  const bool packed = cols % kPack == 0 && Aligned16(dy) && Aligned16(x) && Aligned16(dx) &&
                      Aligned16(weight) && (!dsum || Aligned16(dsum));
  int64_t blocks = 0;  // launched, each leaving one partial row
  auto run = [&](auto kernel, int64_t rows_per_block, int threads, size_t smem) {
    blocks = LaunchBwdBlocks(stream, device, kernel, rows_per_block, threads, smem, rc.rows,
                             partials, static_cast<const T*>(dy), static_cast<const T*>(dsum),
                             static_cast<const T*>(x), static_cast<const T*>(weight), mean, rstd,
                             static_cast<T*>(dx), ws, rc.rows, cols);
  };
  // bfloat16 rows of up to 4 warps' packs take the pack-a-thread kernel. The add-bias variant
  // keeps the register path: its third sum (dx_bias) would need 8 more registers in a kernel
  // already at the 64-register bound (not tried).
  if constexpr (sizeof(T) == 2 && !kXBias) {
    const int warps = packed ? (cols / kPack + 31) / 32 : 0;
    auto pack_path = [&](auto wc) {
      // 15 or 16 warps a block, two blocks a multiprocessor: up to 1024 threads at 64
      // registers, as the register path runs.
      constexpr int kWarps = decltype(wc)::value, kGroups = 16 / kWarps;
      constexpr int kThreads = kWarps * 32 * kGroups;
      const size_t sums = size_t(kGroups) * 2 * cols * sizeof(float);  // at most 32 KB
      auto launch = [&](auto sum) {
        constexpr auto kKernel = LayerNormBwdPackKernel<T, kWarps, kGroups, decltype(sum)::value>;
        const size_t stages = size_t(2) * (sum ? 3 : 2) * kThreads * sizeof(uint4);  // <= 48 KB
        const size_t smem = std::max(sums, stages);
        if (smem <= kMaxSharedBytes || smem <= SharedMemoryLimit<kKernel>(device))
          run(kKernel, kGroups, kThreads, smem);
      };
      if (dsum) launch(std::true_type{});
      else launch(std::false_type{});
    };
    switch (warps) {
      case 1: pack_path(std::integral_constant<int, 1>{}); break;
      case 2: pack_path(std::integral_constant<int, 2>{}); break;
      case 3: pack_path(std::integral_constant<int, 3>{}); break;
      case 4: pack_path(std::integral_constant<int, 4>{}); break;
      default: break;
    }
  }
  if (blocks == 0)
    LaunchBwdRows<Kernels>(device, packed ? GroupFor(cols / kPack, BwdVecs<T>()) : 0, cols, run);
  BLUJAX_RETURN_IF_ERROR(LastCudaError(op));
  LaunchReducePartials(stream, LayerNormReducePartials<T, Kernels::kPlanes>, Kernels::kPlanes,
                       cols, ws, static_cast<int>(blocks), cols, static_cast<T*>(dweight),
                       static_cast<T*>(dbias), static_cast<T*>(dx_bias));
  return ffi::Error::Success();
}

// residual/sum are null for the plain op; x_bias is null but for the add-bias op.
ffi::Error LayerNormFwdImpl(const char* op, cudaStream_t stream, int device, ffi::AnyBuffer x,
                            const ffi::AnyBuffer* x_bias, const ffi::AnyBuffer* residual,
                            ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                            ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer>* sum,
                            ffi::Result<ffi::AnyBuffer> mean, ffi::Result<ffi::AnyBuffer> rstd,
                            float eps) {
  RowsCols rc;
  BLUJAX_RETURN_IF_ERROR(CheckLayerNormFwd(op, /*allow_f64=*/false, x, x_bias, residual, weight,
                                           bias, *y, OptionalResult(sum), *mean, *rstd, eps,
                                           &rc));
  if (rc.rows == 0) return ffi::Error::Success();
  const bool f32 = x.element_type() == ffi::DataType::F32;
  auto launch = x_bias ? (f32 ? LaunchFwd<float, true> : LaunchFwd<__nv_bfloat16, true>)
                       : (f32 ? LaunchFwd<float, false> : LaunchFwd<__nv_bfloat16, false>);
  BLUJAX_RETURN_IF_ERROR(launch(stream, device, x.untyped_data(),
                                x_bias ? x_bias->untyped_data() : nullptr,
                                residual ? residual->untyped_data() : nullptr,
                                weight.untyped_data(), bias.untyped_data(), y->untyped_data(),
                                sum ? (*sum)->untyped_data() : nullptr,
                                static_cast<float*>(mean->untyped_data()),
                                static_cast<float*>(rstd->untyped_data()), rc, eps));
  return LastCudaError(op);
}

// dsum is null for the plain op; dx_bias is null but for the add-bias op.
ffi::Error LayerNormBwdImpl(const char* op, cudaStream_t stream, int device, ffi::AnyBuffer dy,
                            const ffi::AnyBuffer* dsum, ffi::AnyBuffer x, ffi::AnyBuffer weight,
                            ffi::AnyBuffer mean, ffi::AnyBuffer rstd,
                            ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dweight,
                            ffi::Result<ffi::AnyBuffer> dbias,
                            ffi::Result<ffi::AnyBuffer>* dx_bias,
                            ffi::Result<ffi::AnyBuffer> workspace) {
  RowsCols rc;
  int64_t partials = 0;
  BLUJAX_RETURN_IF_ERROR(CheckLayerNormBwd(op, /*allow_f64=*/false, dy, dsum, x, weight, mean,
                                           rstd, *dx, *dweight, *dbias, OptionalResult(dx_bias),
                                           *workspace, &rc, &partials));
  const bool f32 = x.element_type() == ffi::DataType::F32;
  auto launch = dx_bias ? (f32 ? LaunchBwd<float, true> : LaunchBwd<__nv_bfloat16, true>)
                        : (f32 ? LaunchBwd<float, false> : LaunchBwd<__nv_bfloat16, false>);
  BLUJAX_RETURN_IF_ERROR(launch(op, stream, device, dy.untyped_data(),
                                dsum ? dsum->untyped_data() : nullptr, x.untyped_data(),
                                weight.untyped_data(),
                                static_cast<const float*>(mean.untyped_data()),
                                static_cast<const float*>(rstd.untyped_data()), dx->untyped_data(),
                                dweight->untyped_data(), dbias->untyped_data(),
                                dx_bias ? (*dx_bias)->untyped_data() : nullptr,
                                static_cast<float*>(workspace->untyped_data()), partials, rc));
  return LastCudaError(op);
}


ffi::Error LayerNormFwd(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                        ffi::AnyBuffer weight, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y,
                        ffi::Result<ffi::AnyBuffer> mean, ffi::Result<ffi::AnyBuffer> rstd,
                        float eps) {
  return LayerNormFwdImpl("blujax_layer_norm_fwd", stream, device, x, nullptr, nullptr, weight,
                          bias, y, nullptr, mean, rstd, eps);
}

ffi::Error AddLayerNormFwd(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                           ffi::AnyBuffer residual, ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                           ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> sum,
                           ffi::Result<ffi::AnyBuffer> mean, ffi::Result<ffi::AnyBuffer> rstd,
                           float eps) {
  return LayerNormFwdImpl("blujax_add_layer_norm_fwd", stream, device, x, nullptr, &residual,
                          weight, bias, y, &sum, mean, rstd, eps);
}

ffi::Error AddBiasLayerNormFwd(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                               ffi::AnyBuffer x_bias, ffi::AnyBuffer residual,
                               ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                               ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> sum,
                               ffi::Result<ffi::AnyBuffer> mean, ffi::Result<ffi::AnyBuffer> rstd,
                               float eps) {
  return LayerNormFwdImpl("blujax_add_bias_layer_norm_fwd", stream, device, x, &x_bias,
                          &residual, weight, bias, y, &sum, mean, rstd, eps);
}

ffi::Error LayerNormBwd(cudaStream_t stream, int32_t device, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                        ffi::AnyBuffer weight, ffi::AnyBuffer mean, ffi::AnyBuffer rstd,
                        ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dweight,
                        ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> workspace) {
  return LayerNormBwdImpl("blujax_layer_norm_bwd", stream, device, dy, nullptr, x, weight, mean,
                          rstd, dx, dweight, dbias, nullptr, workspace);
}

ffi::Error AddLayerNormBwd(cudaStream_t stream, int32_t device, ffi::AnyBuffer dy,
                           ffi::AnyBuffer dsum, ffi::AnyBuffer sum, ffi::AnyBuffer weight,
                           ffi::AnyBuffer mean, ffi::AnyBuffer rstd,
                           ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dweight,
                           ffi::Result<ffi::AnyBuffer> dbias,
                           ffi::Result<ffi::AnyBuffer> workspace) {
  return LayerNormBwdImpl("blujax_add_layer_norm_bwd", stream, device, dy, &dsum, sum, weight,
                          mean, rstd, dx, dweight, dbias, nullptr, workspace);
}

ffi::Error AddBiasLayerNormBwd(cudaStream_t stream, int32_t device, ffi::AnyBuffer dy,
                               ffi::AnyBuffer dsum, ffi::AnyBuffer sum, ffi::AnyBuffer weight,
                               ffi::AnyBuffer mean, ffi::AnyBuffer rstd,
                               ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dweight,
                               ffi::Result<ffi::AnyBuffer> dbias,
                               ffi::Result<ffi::AnyBuffer> dx_bias,
                               ffi::Result<ffi::AnyBuffer> workspace) {
  return LayerNormBwdImpl("blujax_add_bias_layer_norm_bwd", stream, device, dy, &dsum, sum,
                          weight, mean, rstd, dx, dweight, dbias, &dx_bias, workspace);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kLayerNormFwd, LayerNormFwd,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Ctx<Device>()
                           .Arg<ffi::AnyBuffer>()   // x [..., C]
                           .Arg<ffi::AnyBuffer>()   // weight [C]
                           .Arg<ffi::AnyBuffer>()   // bias [C]
                           .Ret<ffi::AnyBuffer>()   // y [..., C]
                           .Ret<ffi::AnyBuffer>()   // mean [...] f32
                           .Ret<ffi::AnyBuffer>()   // rstd [...] f32
                           .Attr<float>("eps"),
                       kGraphSafe);

XLA_FFI_DEFINE_HANDLER(kAddLayerNormFwd, AddLayerNormFwd,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Ctx<Device>()
                           .Arg<ffi::AnyBuffer>()   // x [..., C]
                           .Arg<ffi::AnyBuffer>()   // residual [..., C]
                           .Arg<ffi::AnyBuffer>()   // weight [C]
                           .Arg<ffi::AnyBuffer>()   // bias [C]
                           .Ret<ffi::AnyBuffer>()   // y [..., C]
                           .Ret<ffi::AnyBuffer>()   // sum = x + residual [..., C]
                           .Ret<ffi::AnyBuffer>()   // mean [...] f32
                           .Ret<ffi::AnyBuffer>()   // rstd [...] f32
                           .Attr<float>("eps"),
                       kGraphSafe);

XLA_FFI_DEFINE_HANDLER(kLayerNormBwd, LayerNormBwd,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Ctx<Device>()
                           .Arg<ffi::AnyBuffer>()   // dy [..., C]
                           .Arg<ffi::AnyBuffer>()   // x [..., C]
                           .Arg<ffi::AnyBuffer>()   // weight [C]
                           .Arg<ffi::AnyBuffer>()   // mean [...]
                           .Arg<ffi::AnyBuffer>()   // rstd [...]
                           .Ret<ffi::AnyBuffer>()   // dx [..., C]
                           .Ret<ffi::AnyBuffer>()   // dweight [C]
                           .Ret<ffi::AnyBuffer>()   // dbias [C]
                           .Ret<ffi::AnyBuffer>(),  // workspace [P, 2, C] f32
                       kGraphSafe);

XLA_FFI_DEFINE_HANDLER(kAddLayerNormBwd, AddLayerNormBwd,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Ctx<Device>()
                           .Arg<ffi::AnyBuffer>()   // dy [..., C]
                           .Arg<ffi::AnyBuffer>()   // dsum [..., C]
                           .Arg<ffi::AnyBuffer>()   // sum [..., C]
                           .Arg<ffi::AnyBuffer>()   // weight [C]
                           .Arg<ffi::AnyBuffer>()   // mean [...]
                           .Arg<ffi::AnyBuffer>()   // rstd [...]
                           .Ret<ffi::AnyBuffer>()   // dx = dresidual [..., C]
                           .Ret<ffi::AnyBuffer>()   // dweight [C]
                           .Ret<ffi::AnyBuffer>()   // dbias [C]
                           .Ret<ffi::AnyBuffer>(),  // workspace [P, 2, C] f32
                       kGraphSafe);

XLA_FFI_DEFINE_HANDLER(kAddBiasLayerNormFwd, AddBiasLayerNormFwd,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Ctx<Device>()
                           .Arg<ffi::AnyBuffer>()   // x [..., C]
                           .Arg<ffi::AnyBuffer>()   // x_bias [C], the preceding matmul's bias
                           .Arg<ffi::AnyBuffer>()   // residual [..., C]
                           .Arg<ffi::AnyBuffer>()   // weight [C]
                           .Arg<ffi::AnyBuffer>()   // bias [C]
                           .Ret<ffi::AnyBuffer>()   // y [..., C]
                           .Ret<ffi::AnyBuffer>()   // sum = x + x_bias + residual [..., C]
                           .Ret<ffi::AnyBuffer>()   // mean [...] f32
                           .Ret<ffi::AnyBuffer>()   // rstd [...] f32
                           .Attr<float>("eps"),
                       kGraphSafe);

XLA_FFI_DEFINE_HANDLER(kAddBiasLayerNormBwd, AddBiasLayerNormBwd,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Ctx<Device>()
                           .Arg<ffi::AnyBuffer>()   // dy [..., C]
                           .Arg<ffi::AnyBuffer>()   // dsum [..., C]
                           .Arg<ffi::AnyBuffer>()   // sum [..., C]
                           .Arg<ffi::AnyBuffer>()   // weight [C]
                           .Arg<ffi::AnyBuffer>()   // mean [...]
                           .Arg<ffi::AnyBuffer>()   // rstd [...]
                           .Ret<ffi::AnyBuffer>()   // dx = dresidual [..., C]
                           .Ret<ffi::AnyBuffer>()   // dweight [C]
                           .Ret<ffi::AnyBuffer>()   // dbias [C]
                           .Ret<ffi::AnyBuffer>()   // dx_bias [C] = column sums of dx
                           .Ret<ffi::AnyBuffer>(),  // workspace [P, 3, C] f32
                       kGraphSafe);

BLUJAX_REGISTER(blujax_layer_norm_fwd, kLayerNormFwd);
BLUJAX_REGISTER(blujax_add_layer_norm_fwd, kAddLayerNormFwd);
BLUJAX_REGISTER(blujax_layer_norm_bwd, kLayerNormBwd);
BLUJAX_REGISTER(blujax_add_layer_norm_bwd, kAddLayerNormBwd);
BLUJAX_REGISTER(blujax_add_bias_layer_norm_fwd, kAddBiasLayerNormFwd);
BLUJAX_REGISTER(blujax_add_bias_layer_norm_bwd, kAddBiasLayerNormBwd);

}  // namespace blujax
