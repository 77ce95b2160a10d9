// Scaled dot-product attention on the GPU, flash style (FlashAttention-2's schedule); the CPU
// twin is xla_ext/cpu/attention.cc and the handler contract common/attention.h. This file has
// the delta kernel, the launchers and the handlers. The kernels are split by architecture:
// attention_sm80_bf16.cuh and attention_sm80_f32.cuh are the portable kernels (sm_80 and
// later; the float32 one runs everywhere), attention_sm90_fwd.cuh and attention_sm90_bwd.cuh
// the Hopper ones (sm_90a) for bfloat16; what all share is in attention_common.cuh, what the
// Hopper ones share in attention_sm90_common.cuh, and the PTX wrappers in common/sm80.cuh and
// common/sm90.cuh.
//
// bfloat16 runs on tensor cores (mma.sync m16n8k16, float32 accumulators), head sizes 64 and
// 128. Every kernel has 4 warps; a warp owns 32 rows (16 in the dK/dV kernel) of the tile it
// keeps in registers (queries in the forward and dQ kernels, keys in the dK/dV kernel) and
// streams the other operand through shared memory in tiles, loaded with cp.async into two
// buffers so the next tile arrives while the current one is used (one barrier per tile). Rows
// past the end of a sequence are zero-filled by the copy and masked out of the softmax, so
// any T works.
//   forward   one CTA per 128 query rows: S = Q K^T, online softmax in registers (exp2f, the
//             scale folded into log2 units), O += P V with P taken straight from the S
//             registers (the accumulator layout of one mma is the operand layout of the next).
//   backward  (1) delta_i = sum_d dout_id out_id - dlse_i into the `delta` output;
//             (2) one CTA per 64 keys loops over query tiles: S^T = K Q^T, P^T, dV += P^T dO,
//                 dP^T = V dO^T, dS^T = P^T (dP^T - delta), dK += dS^T Q;
//             (3) one CTA per 128 query rows loops over key tiles: dQ += dS K.
//             Each output element is written by one CTA: deterministic, no atomics.
//             blujax_attention_qkv_bwd writes dq, dk, dv as the thirds of one [B, T, 3, H, D]
//             tensor (rows 3 * H * D apart, Geometry::grad_stride): the gradient of a fused
//             QKV projection, with no concatenation left for XLA to do.
// On Hopper (compute capability 9.0, the module built for sm_90a) the bfloat16 kernels are
// instead attention_sm90_fwd.cuh's forward and attention_sm90_bwd.cuh's dK/dV and dQ kernels:
// warpgroup MMAs fed by TMA copies from a producer warpgroup, with mbarriers between them
// (FlashAttention-3's schedule). Where the call asks for it (the backward's sum_dq attribute,
// with room for the sums in the workspace: the Python side asks unless XLA's deterministic mode
// is on or the call is causal with few keys, where too few key blocks share a query tile to
// pay), the dK/dV kernel also computes dQ's share of its keys and adds it into float32 tiles
// in the workspace (TMA bulk reductions), and a small kernel scales them into dq: 5 products
// per (query, key) tile pair instead of 7, but the order of the float32 sums varies from run
// to run. Otherwise the two-kernel, atomic-free split above.
// BLUJAX_NO_WGMMA=1 in the environment keeps the portable kernels there, to compare the two or
// to test them on a Hopper GPU.
// Causal attention skips key tiles above the diagonal and masks only tiles that cross it;
// query blocks are issued longest first (the Hopper forward pairs the longest with the
// shortest in one unit of a persistent CTA's work). Blocks are numbered tile-fastest within
// one (batch, head), so the CTAs resident together read the same K and V from L2.
//
// float32 must match a float32 reference (no TF32), so it runs on plain FMAs: a SIMT kernel
// of the same three-kernel shape where D/16 threads share a row, 16 columns each.
//
// Grouped-query attention (k, v with KV heads, G = H / KV > 1 query heads each) runs on the
// same kernels compiled a second time (their kGqa template argument), chosen per call by G:
// multi-head calls (G = 1) take the kernels as they were before there were groups, compiled
// without a line of the grouped code. Every architecture runs the grouped form of the kernels
// it runs for multi-head calls: on Hopper the sm90 forward and backward (both the two-kernel
// and the dQ-summing form), elsewhere (and with BLUJAX_NO_WGMMA=1) the portable ones; float32
// everywhere on the SIMT kernels. No kernel copies K or V per query head:
//   forward, dQ   per (batch, query head) as before, reading K and V of key/value head h / G;
//   dK/dV         one CTA per key tile of one (batch, key/value head), which streams the query
//                 tiles of the G query heads of its group one head after the other through
//                 its pipeline and sums dK and dV over them in its accumulators, then writes
//                 them once. Each element of dk, dv is still written by one CTA in a fixed
//                 order: deterministic wherever the multi-head backward is, with no scratch
//                 and no atomics. (The alternatives: G partial dK, dV per key/value head
//                 summed by another pass, G times the memory and traffic; or atomics, in a
//                 varying order.) The grid has G times fewer, G times longer CTAs.
//
// Shared-memory tiles of bfloat16 are rows of D/8 16-byte chunks with the chunk index XORed
// by row % 8, so the 8 rows an ldmatrix phase reads at one logical chunk fall in 8 different
// bank groups (a row is 128 or 256 bytes, so unswizzled they would all share one).

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "common/attention.h"
#include "common/cuda_launch.cuh"
#include "common/cuda_util.cuh"
#include "common/registry.h"
#include "common/sm90.cuh"
#include "cuda/attention_sm80_bf16.cuh"
#include "cuda/attention_sm80_f32.cuh"
#include "cuda/attention_sm90_fwd.cuh"
#include "cuda/attention_sm90_bwd.cuh"

namespace blujax {
namespace {

// ---------------------------------------------------------------------------------------------
// delta_i = sum_d dout_id out_id - dlse_i for the rows of [B, Tq, H, D] tensors, written to
// [B, H, Tq]. A row is D / kPack threads reading one 16-byte pack each of dout and out; rows
// are numbered (b, h, t) with t fastest, so the delta stores are contiguous too.

constexpr int kDeltaThreads = 256;

template <typename T, int D>
__global__ void __launch_bounds__(kDeltaThreads)
AttentionDeltaKernel(const T* __restrict__ out, const T* __restrict__ dout,
                     const float* __restrict__ dlse, float* __restrict__ delta, int64_t rows,
                     int tq, int heads) {
  constexpr int kPack = 16 / sizeof(T), kLanes = D / kPack;  // 8 to 32 threads a row
  static_assert(kLanes <= 32 && 32 % kLanes == 0, "a row's threads in one warp");
  const int64_t at = (int64_t(blockIdx.x) * kDeltaThreads + threadIdx.x) / kLanes;
  const int c = threadIdx.x % kLanes;
  float s = 0.f;
  if (at < rows) {
    const int64_t t = at % tq, h = (at / tq) % heads, b = at / (int64_t(tq) * heads);
    const int64_t off = ((b * tq + t) * heads + h) * D + c * kPack;
    const uint4 o4 = *reinterpret_cast<const uint4*>(out + off);
    const uint4 d4 = *reinterpret_cast<const uint4*>(dout + off);
    const T* ov = reinterpret_cast<const T*>(&o4);
    const T* dv = reinterpret_cast<const T*>(&d4);
#pragma unroll
    for (int e = 0; e < kPack; ++e) s = fmaf(ToFloat(dv[e]), ToFloat(ov[e]), s);
  }
#pragma unroll
  for (int w = kLanes / 2; w > 0; w /= 2) s += __shfl_xor_sync(kFull, s, w);
  if (at < rows && c == 0) delta[at] = s - dlse[at];
}

// ---------------------------------------------------------------------------------------------
// Launchers.

// Head sizes the GPU kernels are compiled for; python's blujax.kernels.attention says the same.
constexpr const char* kSupportedHeadDims = "64 and 128";

template <typename F>
bool WithHeadDim(int64_t d, F&& f) {
  switch (d) {
    case 64: f(std::integral_constant<int, 64>{}); return true;
    case 128: f(std::integral_constant<int, 128>{}); return true;
    default: return false;
  }
}

// f(std::true_type) for grouped-query attention (G = H / KV > 1), else f(std::false_type): the
// kernels' kGqa.
template <typename F>
void WithGroups(const AttentionDims& d, F&& f) {
  if (d.group > 1) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

// LaunchKernel with kThreads, the block size of every kernel but the Hopper ones.
template <auto kKernel, typename... Args>
ffi::Error Launch(const char* op, int64_t blocks, size_t smem, cudaStream_t stream, int device,
                  Args... args) {
  return LaunchKernel<kKernel>(op, blocks, kThreads, smem, stream, device, args...);
}

// TMA descriptor of a [B, T, H, D] bfloat16 tensor read in boxes of `rows` rows x 64 columns
// of one (batch, head), 128-byte swizzled as the Hopper kernel's tiles are.
ffi::Error TileMap(const char* op, CUtensorMap* map, const void* data, int64_t batch, int t,
                   int heads, int d, int rows) {
  EncodeTiledFn encode = TensorMapEncoder();
  if (!encode)
    return ffi::Error::Internal(StrCat(op, ": the CUDA driver lacks cuTensorMapEncodeTiled"));
  constexpr cuuint64_t kBytes = sizeof(bf16);
  const cuuint64_t dims[4] = {cuuint64_t(d), cuuint64_t(heads), cuuint64_t(t), cuuint64_t(batch)};
  const cuuint64_t strides[3] = {d * kBytes, heads * d * kBytes, t * heads * d * kBytes};
  const cuuint32_t box[4] = {64, 1, cuuint32_t(rows), 1}, unit[4] = {1, 1, 1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, const_cast<void*>(data), dims,
                            strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return ffi::Error::Internal(StrCat(op, ": cuTensorMapEncodeTiled failed (CUresult ", int(r),
                                       ") for B = ", batch, ", T = ", t, ", H = ", heads));
  return ffi::Error::Success();
}

// The Hopper forward (AttentionFwdSm90Kernel): one CTA per multiprocessor, or one per unit of
// work where there are fewer units.
template <int D, bool kGqa>
ffi::Error LaunchFwdSm90(const char* op, cudaStream_t stream, int device, int64_t bh,
                         const void* q, const void* k, const void* v, void* out, float* lse,
                         int* unit_counter, const Geometry& g) {
  using C = FwdSm90<D>;
  const int64_t batch = bh / g.heads;
  FwdSm90Maps maps;
  BLUJAX_RETURN_IF_ERROR(TileMap(op, &maps.q, q, batch, g.tq, g.heads, D, 64));
  BLUJAX_RETURN_IF_ERROR(TileMap(op, &maps.k, k, batch, g.tk, g.kv_heads, D, C::kBN));
  BLUJAX_RETURN_IF_ERROR(TileMap(op, &maps.v, v, batch, g.tk, g.kv_heads, D, C::kBN));
  BLUJAX_RETURN_IF_ERROR(TileMap(op, &maps.out, out, batch, g.tq, g.heads, D, 16));
  // Causal: the blocks of query rows start `lead` rows before row 0 (whole warpgroups of 64,
  // less than a block), so the one block only partly inside the sequence is the first, whose
  // rows need the fewest key tiles, not the last, whose rows need them all (at T = 1024 a
  // 192-row block's 64-row remainder would otherwise run 8 tiles on one warpgroup).
  const int lead = g.causal ? (C::kBM - g.tq % C::kBM) % C::kBM / 64 * 64 : 0;
  const int n_qt = (g.tq + lead + C::kBM - 1) / C::kBM;
  if (n_qt == 0) return ffi::Error::Success();
  // Units of work (see UnitBlocks): fewer than 2^31, as CheckGpuLimits bounds the blocks.
  const int64_t units = bh * (g.causal ? (n_qt + 1) / 2 : n_qt);
  const int64_t ctas = std::min<int64_t>(units, SmCount(device));
  auto launch = [&](auto counted) {
    return LaunchKernel<AttentionFwdSm90Kernel<C, decltype(counted)::value, kGqa>>(
        op, ctas, C::kThreads, C::kSmem, stream, device, maps, lse, g, static_cast<int>(units),
        n_qt, lead, unit_counter);
  };
  // Units cost the same unless a non-causal call's last block is only partly inside the
  // sequence or a causal call's middle block has no partner; then CTAs count off the units
  // as they go, so that none is left with more than its share. Where units cost the same,
  // every gridDim.x-th unit is cheaper than counting (measured; the experiment log,
  // benchmarks/LOG.md, has the figures).
  if (g.causal ? n_qt % 2 == 0 : g.tq % C::kBM == 0) return launch(std::false_type{});
  if (cudaMemsetAsync(unit_counter, 0, sizeof(int), stream) != cudaSuccess)
    return LastCudaError(op);
  return launch(std::true_type{});
}

template <int D, bool kGqa>
ffi::Error LaunchFwdBf16(const char* op, cudaStream_t stream, int device, int64_t bh,
                         const void* q, const void* k, const void* v, void* out, float* lse,
                         int* unit_counter, const Geometry& g) {
  // Hopper: persistent CTAs (measured faster than a CTA per block, benchmarks/LOG.md).
  if (Sm90Runs(AttentionFwdSm90Kernel<FwdSm90<D>, false, false>, device))
    return LaunchFwdSm90<D, kGqa>(op, stream, device, bh, q, k, v, out, lse, unit_counter, g);
  using C = FwdBf16<D>;
  const int n_qt = (g.tq + C::kBM - 1) / C::kBM;
  return Launch<AttentionFwdBf16Kernel<C, kGqa>>(
      op, n_qt * bh, C::kSmem, stream, device, static_cast<const bf16*>(q),
      static_cast<const bf16*>(k), static_cast<const bf16*>(v), static_cast<bf16*>(out), lse, g,
      n_qt);
}

template <int D, bool kGqa>
ffi::Error LaunchFwdF32(const char* op, cudaStream_t stream, int device, int64_t bh,
                        const void* q, const void* k, const void* v, void* out, float* lse,
                        int* /*unit_counter*/, const Geometry& g) {
  const int n_qt = (g.tq + F32Tile<D>::kRows - 1) / F32Tile<D>::kRows;
  return Launch<AttentionFwdF32Kernel<D, kGqa>>(
      op, n_qt * bh, F32Tile<D>::kSmem, stream, device, static_cast<const float*>(q),
      static_cast<const float*>(k), static_cast<const float*>(v), static_cast<float*>(out), lse,
      g, n_qt);
}

struct BwdBuffers {
  const void *q, *k, *v, *out, *dout;
  const float *lse, *dlse;
  void *dq, *dk, *dv;
  float* delta;
  // The workspace's room for BwdKvDqSm90's dQ tiles when the call sums dQ (sum_dq), else null.
  float* dq_sum = nullptr;
};

template <typename T, int D>
ffi::Error LaunchDelta(const char* op, cudaStream_t stream, const BwdBuffers& b,
                       const AttentionDims& d) {
  const int64_t rows = d.batch * d.q_len * d.heads;
  if (rows == 0) return ffi::Error::Success();
  const int64_t per_block = kDeltaThreads / (D * sizeof(T) / 16);
  AttentionDeltaKernel<T, D><<<static_cast<unsigned>((rows + per_block - 1) / per_block),
                               kDeltaThreads, 0, stream>>>(
      static_cast<const T*>(b.out), static_cast<const T*>(b.dout), b.dlse, b.delta, rows,
      static_cast<int>(d.q_len), static_cast<int>(d.heads));
  return LastCudaError(op);
}

// bh: (batch, query head) pairs; the dK/dV kernels have a CTA per key tile of each (batch,
// key/value head) pair, B * KV of them (B * H multi-head).
template <typename KV, typename Q, bool kGqa>
ffi::Error LaunchBwdSm90(const char* op, cudaStream_t stream, int device, int64_t bh,
                         const BwdBuffers& b, const Geometry& g) {
  constexpr int D = KV::kD;
  static_assert(Q::kD == D, "one head size");
  const int64_t batch = bh / g.heads, bkv = batch * g.kv_heads;
  // Each kernel's maps: q and dout in boxes of its query tile, k and v of its key tile.
  auto make_maps = [&](BwdSm90Maps* m, int q_rows, int k_rows) {
    ffi::Error e = TileMap(op, &m->q, b.q, batch, g.tq, g.heads, D, q_rows);
    if (!e.failure()) e = TileMap(op, &m->dout, b.dout, batch, g.tq, g.heads, D, q_rows);
    if (!e.failure()) e = TileMap(op, &m->k, b.k, batch, g.tk, g.kv_heads, D, k_rows);
    if (!e.failure()) e = TileMap(op, &m->v, b.v, batch, g.tk, g.kv_heads, D, k_rows);
    return e;
  };
  BwdSm90Maps kv_maps, q_maps;
  BLUJAX_RETURN_IF_ERROR(make_maps(&kv_maps, KV::kBM, KV::kBN));
  const int n_kt = (g.tk + KV::kBN - 1) / KV::kBN;
  if (b.dq_sum) {
    // dQ summed by the dK/dV kernel into the zeroed workspace, then scaled into dq.
    using F = BwdKvDqSm90<D>;
    const int n_q64 = (g.tq + 63) / 64;
    if (cudaMemsetAsync(b.dq_sum, 0, size_t(bh) * n_q64 * 64 * D * sizeof(float), stream) !=
        cudaSuccess)
      return LastCudaError(op);
    BLUJAX_RETURN_IF_ERROR((LaunchKernel<AttentionBwdKvSm90Kernel<F, kGqa>>(
        op, n_kt * bkv, F::kThreads, F::kSmem, stream, device, kv_maps, b.lse, b.delta,
        static_cast<bf16*>(b.dk), static_cast<bf16*>(b.dv), b.dq_sum, g, n_kt)));
    DqFromSums<D><<<static_cast<unsigned>(bh * n_q64), 4 * D, 0, stream>>>(
        b.dq_sum, static_cast<bf16*>(b.dq), g, n_q64);
    return LastCudaError(op);
  }
  BLUJAX_RETURN_IF_ERROR(make_maps(&q_maps, Q::kBM, Q::kBN));
  const int n_qt = (g.tq + Q::kBM - 1) / Q::kBM;
  BLUJAX_RETURN_IF_ERROR((LaunchKernel<AttentionBwdKvSm90Kernel<KV, kGqa>>(
      op, n_kt * bkv, KV::kThreads, KV::kSmem, stream, device, kv_maps, b.lse, b.delta,
      static_cast<bf16*>(b.dk), static_cast<bf16*>(b.dv), nullptr, g, n_kt)));
  return LaunchKernel<AttentionBwdQSm90Kernel<Q, kGqa>>(op, n_qt * bh, Q::kThreads, Q::kSmem,
                                                        stream, device, q_maps, b.lse, b.delta,
                                                        static_cast<bf16*>(b.dq), g, n_qt);
}

template <int D, bool kGqa>
ffi::Error LaunchBwdBf16(const char* op, cudaStream_t stream, int device, int64_t bh,
                         const BwdBuffers& b, const Geometry& g) {
  if (Sm90Runs(AttentionBwdKvSm90Kernel<BwdKvSm90<D>, false>, device)) {
    return LaunchBwdSm90<BwdKvSm90<D>, BwdQSm90<D>, kGqa>(op, stream, device, bh, b, g);
  }
  using KV = BwdKvBf16<D>;
  using Q = BwdQBf16<D>;
  const int n_kt = (g.tk + KV::kBN - 1) / KV::kBN, n_qt = (g.tq + Q::kBM - 1) / Q::kBM;
  const int64_t bkv = bh / g.heads * g.kv_heads;  // the dK/dV kernel's (batch, KV head) pairs
  auto q = static_cast<const bf16*>(b.q), k = static_cast<const bf16*>(b.k);
  auto v = static_cast<const bf16*>(b.v), dout = static_cast<const bf16*>(b.dout);
  BLUJAX_RETURN_IF_ERROR((Launch<AttentionBwdKvBf16Kernel<D, kGqa>>(
      op, n_kt * bkv, KV::kSmem, stream, device, q, k, v, dout, b.lse, b.delta,
      static_cast<bf16*>(b.dk), static_cast<bf16*>(b.dv), g, n_kt)));
  return Launch<AttentionBwdQBf16Kernel<Q, kGqa>>(op, n_qt * bh, Q::kSmem, stream, device, q, k,
                                                  v, dout, b.lse, b.delta,
                                                  static_cast<bf16*>(b.dq), g, n_qt);
}

template <int D, bool kGqa>
ffi::Error LaunchBwdF32(const char* op, cudaStream_t stream, int device, int64_t bh,
                        const BwdBuffers& b, const Geometry& g) {
  using C = F32Tile<D>;
  const int n_kt = (g.tk + C::kRows - 1) / C::kRows, n_qt = (g.tq + C::kRows - 1) / C::kRows;
  const int64_t bkv = bh / g.heads * g.kv_heads;  // the dK/dV kernel's (batch, KV head) pairs
  auto q = static_cast<const float*>(b.q), k = static_cast<const float*>(b.k);
  auto v = static_cast<const float*>(b.v), dout = static_cast<const float*>(b.dout);
  BLUJAX_RETURN_IF_ERROR((Launch<AttentionBwdKvF32Kernel<D, kGqa>>(
      op, n_kt * bkv, C::kSmem, stream, device, q, k, v, dout, b.lse, b.delta,
      static_cast<float*>(b.dk), static_cast<float*>(b.dv), g, n_kt)));
  return Launch<AttentionBwdQF32Kernel<D, kGqa>>(op, n_qt * bh, C::kSmem, stream, device, q, k,
                                                 v, dout, b.lse, b.delta,
                                                 static_cast<float*>(b.dq), g, n_qt);
}

// ---------------------------------------------------------------------------------------------
// Handlers.

// What the GPU kernels add to CheckAttentionInputs: a compiled head size, 32-bit sequence
// indexing and grid, and 16-byte aligned buffers (XLA's always are).
ffi::Error CheckGpuLimits(const char* op, const AttentionDims& d,
                          std::initializer_list<const void*> buffers) {
  if (d.head_dim != 64 && d.head_dim != 128)
    return InvalidArgument(op, ": head size D = ", d.head_dim,
                           " has no GPU kernel (supported: ", kSupportedHeadDims, ")");
  constexpr int64_t kMaxLen = int64_t{1} << 30;
  if (d.q_len > kMaxLen || d.kv_len > kMaxLen)
    return InvalidArgument(op, ": sequence length above 2^30 (Tq = ", d.q_len, ", Tk = ",
                           d.kv_len, ")");
  // The largest grid: one CTA per 16 rows (float32, D = 128) of each (batch, head).
  const int64_t tiles = (std::max(d.q_len, d.kv_len) + 15) / 16;
  if (tiles * d.batch * d.heads > int64_t{0x7fffffff})
    return InvalidArgument(op, ": too many (batch, head, block) triples for one grid: B = ",
                           d.batch, ", H = ", d.heads, ", T = ", std::max(d.q_len, d.kv_len));
  for (const void* p : buffers)
    if (!Aligned16(p)) return InvalidArgument(op, ": buffers must be 16-byte aligned");
  return ffi::Error::Success();
}

Geometry MakeGeometry(const AttentionDims& d, bool causal, double scale) {
  Geometry g;
  g.heads = static_cast<int>(d.heads);
  g.tq = static_cast<int>(d.q_len);
  g.tk = static_cast<int>(d.kv_len);
  g.causal = causal;
  g.scale = static_cast<float>(scale);  // the attribute is float64 for the CPU's float64 kernel
  g.scale_log2 = g.scale * kLog2e;
  g.grad_stride = d.heads * d.head_dim;
  g.kv_heads = static_cast<int>(d.kv_heads);
  g.group = static_cast<int>(d.group);
  return g;
}

ffi::Error AttentionFwd(cudaStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                        ffi::AnyBuffer v, ffi::Result<ffi::AnyBuffer> out,
                        ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> counter,
                        bool causal, double scale) {
  const char* op = "blujax_attention_fwd";
  AttentionDims d;
  BLUJAX_RETURN_IF_ERROR(CheckAttentionFwd(op, /*allow_f64=*/false, q, k, v, *out, *lse, *counter,
                                           causal, scale, &d));
  BLUJAX_RETURN_IF_ERROR(CheckGpuLimits(
      op, d, {q.untyped_data(), k.untyped_data(), v.untyped_data(), out->untyped_data()}));
  if (d.batch * d.heads == 0) return ffi::Error::Success();
  const Geometry g = MakeGeometry(d, causal, scale);
  const bool is_bf16 = q.element_type() == ffi::DataType::BF16;
  float* lse_ptr = static_cast<float*>(lse->untyped_data());
  ffi::Error result = ffi::Error::Success();
  WithHeadDim(d.head_dim, [&](auto dim) {
    WithGroups(d, [&](auto gqa) {
      constexpr int D = decltype(dim)::value;
      constexpr bool kGqa = decltype(gqa)::value;
      auto launch = is_bf16 ? &LaunchFwdBf16<D, kGqa> : &LaunchFwdF32<D, kGqa>;
      result = launch(op, stream, device, d.batch * d.heads, q.untyped_data(), k.untyped_data(),
                      v.untyped_data(), out->untyped_data(), lse_ptr,
                      static_cast<int*>(counter->untyped_data()), g);
    });
  });
  return result;
}

// With sum_dq, the room for BwdKvDqSm90's dQ tiles (B * H * ceil(Tq / 64) tiles of 64 x D,
// float32) after delta's B * H * Tq values, rounded up to 16 bytes; the workspace holds it
// (CheckAttentionDelta: B * H * AttentionDqRoom values more than delta). Null without sum_dq.
float* DqSumRoom(ffi::AnyBuffer& delta, const AttentionDims& d, bool sum_dq) {
  if (!sum_dq) return nullptr;
  const int64_t rows = (d.batch * d.heads * d.q_len + 3) / 4 * 4;
  return static_cast<float*>(delta.untyped_data()) + rows;
}

// Launches the backward once its buffers are checked; dq, dk, dv rows are g.grad_stride apart.
ffi::Error AttentionBwdImpl(const char* op, cudaStream_t stream, int32_t device,
                            const AttentionDims& d, const Geometry& g, ffi::DataType type,
                            const BwdBuffers& b) {
  BLUJAX_RETURN_IF_ERROR(
      CheckGpuLimits(op, d, {b.q, b.k, b.v, b.out, b.dout, b.dq, b.dk, b.dv}));
  if (d.batch * d.heads == 0) return ffi::Error::Success();
  const bool is_bf16 = type == ffi::DataType::BF16;
  ffi::Error result = ffi::Error::Success();
  WithHeadDim(d.head_dim, [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    result = is_bf16 ? LaunchDelta<bf16, D>(op, stream, b, d)
                     : LaunchDelta<float, D>(op, stream, b, d);
    if (!result.failure()) {
      WithGroups(d, [&](auto gqa) {
        constexpr bool kGqa = decltype(gqa)::value;
        auto launch = is_bf16 ? &LaunchBwdBf16<D, kGqa> : &LaunchBwdF32<D, kGqa>;
        result = launch(op, stream, device, d.batch * d.heads, b, g);
      });
    }
  });
  return result;
}

ffi::Error AttentionBwd(cudaStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                        ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer lse,
                        ffi::AnyBuffer dout, ffi::AnyBuffer dlse, ffi::Result<ffi::AnyBuffer> dq,
                        ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                        ffi::Result<ffi::AnyBuffer> delta, bool causal, double scale,
                        bool sum_dq) {
  const char* op = "blujax_attention_bwd";
  AttentionDims d;
  BLUJAX_RETURN_IF_ERROR(CheckAttentionBwd(op, /*allow_f64=*/false, q, k, v, out, lse, dout, dlse,
                                           *dq, *dk, *dv, *delta, causal, scale, sum_dq, &d));
  BwdBuffers b{q.untyped_data(), k.untyped_data(), v.untyped_data(), out.untyped_data(),
               dout.untyped_data(), static_cast<const float*>(lse.untyped_data()),
               static_cast<const float*>(dlse.untyped_data()), dq->untyped_data(),
               dk->untyped_data(), dv->untyped_data(), static_cast<float*>(delta->untyped_data())};
  b.dq_sum = DqSumRoom(*delta, d, sum_dq);
  return AttentionBwdImpl(op, stream, device, d, MakeGeometry(d, causal, scale),
                          q.element_type(), b);
}

ffi::Error AttentionQkvBwd(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                           ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out,
                           ffi::AnyBuffer lse, ffi::AnyBuffer dout, ffi::AnyBuffer dlse,
                           ffi::Result<ffi::AnyBuffer> dqkv, ffi::Result<ffi::AnyBuffer> delta,
                           bool causal, double scale, bool sum_dq) {
  const char* op = "blujax_attention_qkv_bwd";
  AttentionDims d;
  BLUJAX_RETURN_IF_ERROR(CheckAttentionQkvBwd(op, /*allow_f64=*/false, q, k, v, out, lse, dout,
                                              dlse, *dqkv, *delta, causal, scale, sum_dq, &d));
  // dq, dk, dv are the thirds of each token's row of 3 * H * D elements.
  Geometry g = MakeGeometry(d, causal, scale);
  g.grad_stride = 3 * d.heads * d.head_dim;
  const int64_t third = d.heads * d.head_dim * ffi::ByteWidth(q.element_type());
  char* base = static_cast<char*>(dqkv->untyped_data());
  BwdBuffers b{q.untyped_data(), k.untyped_data(), v.untyped_data(), out.untyped_data(),
               dout.untyped_data(), static_cast<const float*>(lse.untyped_data()),
               static_cast<const float*>(dlse.untyped_data()), base, base + third,
               base + 2 * third, static_cast<float*>(delta->untyped_data())};
  b.dq_sum = DqSumRoom(*delta, d, sum_dq);
  return AttentionBwdImpl(op, stream, device, d, g, q.element_type(), b);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kAttentionFwd, AttentionFwd,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Ctx<Device>()
                           .Arg<ffi::AnyBuffer>()   // q [B, Tq, H, D]
                           .Arg<ffi::AnyBuffer>()   // k [B, Tk, KV, D], KV dividing H
                           .Arg<ffi::AnyBuffer>()   // v [B, Tk, KV, D]
                           .Ret<ffi::AnyBuffer>()   // out [B, Tq, H, D]
                           .Ret<ffi::AnyBuffer>()   // lse [B, H, Tq] f32
                           .Ret<ffi::AnyBuffer>()   // counter [1] s32, scratch
                           .Attr<bool>("causal")
                           .Attr<double>("scale"),  // f64 as on the CPU; the kernels use a float
                       kGraphSafe);

XLA_FFI_DEFINE_HANDLER(kAttentionBwd, AttentionBwd,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Ctx<Device>()
                           .Arg<ffi::AnyBuffer>()   // q [B, Tq, H, D]
                           .Arg<ffi::AnyBuffer>()   // k [B, Tk, KV, D], KV dividing H
                           .Arg<ffi::AnyBuffer>()   // v [B, Tk, KV, D]
                           .Arg<ffi::AnyBuffer>()   // out [B, Tq, H, D]
                           .Arg<ffi::AnyBuffer>()   // lse [B, H, Tq]
                           .Arg<ffi::AnyBuffer>()   // dout [B, Tq, H, D]
                           .Arg<ffi::AnyBuffer>()   // dlse [B, H, Tq], cotangent of lse
                           .Ret<ffi::AnyBuffer>()   // dq [B, Tq, H, D]
                           .Ret<ffi::AnyBuffer>()   // dk [B, Tk, KV, D], summed over each group
                           .Ret<ffi::AnyBuffer>()   // dv [B, Tk, KV, D]
                           .Ret<ffi::AnyBuffer>()   // delta [B, H, Tq (+ dQ room)] f32, scratch
                           .Attr<bool>("causal")
                           .Attr<double>("scale")   // f64 as on the CPU; the kernels use a float
                           .Attr<bool>("sum_dq"),   // sum dQ in the dK/dV kernel (Hopper bf16)
                       kGraphSafe);

XLA_FFI_DEFINE_HANDLER(kAttentionQkvBwd, AttentionQkvBwd,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Ctx<Device>()
                           .Arg<ffi::AnyBuffer>()   // q [B, T, H, D]
                           .Arg<ffi::AnyBuffer>()   // k [B, T, H, D]
                           .Arg<ffi::AnyBuffer>()   // v [B, T, H, D]
                           .Arg<ffi::AnyBuffer>()   // out [B, T, H, D]
                           .Arg<ffi::AnyBuffer>()   // lse [B, H, T]
                           .Arg<ffi::AnyBuffer>()   // dout [B, T, H, D]
                           .Arg<ffi::AnyBuffer>()   // dlse [B, H, T], cotangent of lse
                           .Ret<ffi::AnyBuffer>()   // dqkv [B, T, 3, H, D]: dq, dk, dv
                           .Ret<ffi::AnyBuffer>()   // delta [B, H, T (+ dQ room)] f32, scratch
                           .Attr<bool>("causal")
                           .Attr<double>("scale")   // f64 as on the CPU; the kernels use a float
                           .Attr<bool>("sum_dq"),   // sum dQ in the dK/dV kernel (Hopper bf16)
                       kGraphSafe);

BLUJAX_REGISTER(blujax_attention_fwd, kAttentionFwd);
BLUJAX_REGISTER(blujax_attention_bwd, kAttentionBwd);
BLUJAX_REGISTER(blujax_attention_qkv_bwd, kAttentionQkvBwd);

}  // namespace blujax
