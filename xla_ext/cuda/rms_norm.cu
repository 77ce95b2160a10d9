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
// The forward kernels are in rms_norm_fwd.cuh, the backward kernels in rms_norm_bwd.cuh (the
// register path and the sums of the partial rows are LayerNorm's, templated on the mean term:
// common/row_norm.cuh, as are the launch shapes); this file has the launchers and the handlers.
//
// The add variant's FP8 form (its kernel and its design: rms_norm_fp8.cuh) writes the sum and
// rstd as the plain forward does, and instead of y, y's FP8 copy, transposed too, and its amax.
//
// Not carried over from LayerNorm (yet): its pipelined forward (cp.async staging of the next
// rows) and its bfloat16 pack-a-thread backward, both measured faster there at some widths;
// they are worth an A/B here on a GPU.

#include "common/cuda_launch.cuh"
#include "common/cuda_util.cuh"
#include "common/registry.h"
#include "common/rms_norm.h"
#include "common/row_norm.cuh"
#include "cuda/rms_norm_bwd.cuh"
#include "cuda/rms_norm_fp8.cuh"
#include "cuda/rms_norm_fwd.cuh"

namespace blujax {
namespace {

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
  LaunchFwdRows(stream, device, packed ? GroupFor(cols / kPack, kVecs) : 0, rc.rows,
                [](auto g) { return RmsNormFwdKernel<T, decltype(g)::value, kVecs, kAdd>; },
                RmsNormFwdAnyKernel<T, kAdd>, static_cast<const T*>(x),
                static_cast<const T*>(residual), static_cast<const T*>(weight),
                static_cast<T*>(y), static_cast<T*>(sum), rstd, rc.rows, cols, eps);
}

// kAdd: dsum is not null. ws holds [partials, C].
template <typename T, bool kAdd>
ffi::Error LaunchBwd(const char* op, cudaStream_t stream, int device, const void* dy,
                     const void* dsum, const void* x, const void* weight, const float* rstd,
                     void* dx, void* dweight, float* ws, int64_t partials, RowsCols rc) {
  using Kernels = RmsNormBwdKernels<T, kAdd>;
  constexpr int kPack = Pack<T>::kSize;
  const int cols = static_cast<int>(rc.cols);
  const bool packed = cols % kPack == 0 && Aligned16(dy) && Aligned16(x) && Aligned16(dx) &&
                      Aligned16(weight) && (!kAdd || Aligned16(dsum));
  int64_t blocks = 0;  // launched, each leaving one partial row
  auto run = [&](auto kernel, int64_t rows_per_block, int threads, size_t smem) {
    blocks = LaunchBwdBlocks(stream, device, kernel, rows_per_block, threads, smem, rc.rows,
                             partials, static_cast<const T*>(dy), static_cast<const T*>(dsum),
                             static_cast<const T*>(x), static_cast<const T*>(weight), rstd,
                             static_cast<T*>(dx), ws, rc.rows, cols);
  };
  LaunchBwdRows<Kernels>(device, packed ? GroupFor(cols / kPack, BwdVecs<T>()) : 0, cols, run);
  BLUJAX_RETURN_IF_ERROR(LastCudaError(op));
  LaunchReducePartials(stream, RmsNormReducePartials<T>, Kernels::kPlanes, cols, ws,
                       static_cast<int>(blocks), cols, static_cast<T*>(dweight));
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

// add_rms_norm's FP8 form: the register path where the rows are packed, a group fits a row
// and the block's tile fits in shared memory, else the any-shape kernel.
template <typename T>
ffi::Error LaunchFwdFp8(const char* op, cudaStream_t stream, int device, const T* x,
                        const T* residual, const T* weight, const float* scale, Fp8Format f,
                        uint8_t* q, uint8_t* qt, unsigned* amax, T* sum, float* rstd,
                        RowsCols rc, float eps) {
  constexpr int kPack = Pack<T>::kSize, kVecs = kFwdFloats / kPack;
  const int cols = static_cast<int>(rc.cols);
  const bool packed = cols % kPack == 0 && Aligned16(x) && Aligned16(residual) &&
                      Aligned16(sum) && Aligned16(weight) &&
                      reinterpret_cast<uintptr_t>(q) % 8 == 0;
  const bool packed_t = rc.rows % 16 == 0 && Aligned16(qt);
  const int group = packed ? GroupFor(cols / kPack, kVecs) : 0;
  const size_t smem = size_t(kFp8NormRows) * (cols + kFp8NormPad);
  bool launched = false;
  ffi::Error err = ffi::Error::Success();
  if (group) {
    WithGroup(group, [&](auto g) {
      constexpr int kGroup = decltype(g)::value, kThreads = BlockFor<kGroup>();
      constexpr auto kKernel = AddRmsNormFwdFp8Kernel<T, kGroup, kVecs>;
      if (smem > kMaxSharedBytes && smem > SharedMemoryLimit<kKernel>(device)) return;
      const int64_t blocks = std::min((rc.rows + kFp8NormRows - 1) / kFp8NormRows,
                                      ResidentBlocks(device, kKernel, kThreads, smem));
      err = LaunchKernel<kKernel>(op, blocks, kThreads, smem, stream, device, x, residual,
                                  weight, scale, f, q, qt, amax, sum, rstd, rc.rows, cols, eps,
                                  packed_t);
      launched = true;
    });
  }
  if (launched) return err;
  const Fp8Layout lay{packed, cols % 8 == 0 && reinterpret_cast<uintptr_t>(q) % 8 == 0,
                      packed_t};
  constexpr auto kAny = AddRmsNormFwdFp8AnyKernel<T>;
  const int64_t blocks = std::min((rc.rows + kFp8Tile - 1) / kFp8Tile,
                                  ResidentBlocks(device, kAny, kFp8Threads, 0));
  return LaunchKernel<kAny>(op, blocks, kFp8Threads, 0, stream, device, x, residual, weight,
                            scale, f, q, qt, amax, sum, rstd, rc.rows, cols, eps, lay);
}

ffi::Error AddRmsNormFwdFp8(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                            ffi::AnyBuffer residual, ffi::AnyBuffer weight, ffi::AnyBuffer scale,
                            ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> qt,
                            ffi::Result<ffi::AnyBuffer> amax, ffi::Result<ffi::AnyBuffer> sum,
                            ffi::Result<ffi::AnyBuffer> rstd, double eps) {
  constexpr const char* op = "blujax_add_rms_norm_fwd_fp8";
  RowsCols rc;
  Fp8Format f;
  BLUJAX_RETURN_IF_ERROR(CheckAddRmsNormFwdFp8(op, x, residual, weight, scale, *q, *qt, *amax,
                                               *sum, *rstd, eps, &rc, &f));
  auto* bits = static_cast<unsigned*>(amax->untyped_data());
  cudaMemsetAsync(bits, 0, sizeof(unsigned), stream);  // +0.0: the amax of nothing
  if (rc.rows == 0) return LastCudaError(op);
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    return LaunchFwdFp8<T>(op, stream, device, static_cast<const T*>(x.untyped_data()),
                           static_cast<const T*>(residual.untyped_data()),
                           static_cast<const T*>(weight.untyped_data()),
                           static_cast<const float*>(scale.untyped_data()), f,
                           static_cast<uint8_t*>(q->untyped_data()),
                           static_cast<uint8_t*>(qt->untyped_data()), bits,
                           static_cast<T*>(sum->untyped_data()),
                           static_cast<float*>(rstd->untyped_data()), rc, static_cast<float>(eps));
  };
  return x.element_type() == ffi::DataType::F32 ? launch(float{}) : launch(__nv_bfloat16{});
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

XLA_FFI_DEFINE_HANDLER(kAddRmsNormFwdFp8, AddRmsNormFwdFp8,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Ctx<Device>()
                           .Arg<ffi::AnyBuffer>()   // x [..., C]
                           .Arg<ffi::AnyBuffer>()   // residual [..., C]
                           .Arg<ffi::AnyBuffer>()   // weight [C]
                           .Arg<ffi::AnyBuffer>()   // scale: float32 []
                           .Ret<ffi::AnyBuffer>()   // q [rows, C]: FP8
                           .Ret<ffi::AnyBuffer>()   // qt [C, rows]
                           .Ret<ffi::AnyBuffer>()   // amax: float32 []
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
BLUJAX_REGISTER(blujax_add_rms_norm_fwd_fp8, kAddRmsNormFwdFp8);
BLUJAX_REGISTER(blujax_rms_norm_bwd, kRmsNormBwd);
BLUJAX_REGISTER(blujax_add_rms_norm_bwd, kAddRmsNormBwd);

}  // namespace blujax
