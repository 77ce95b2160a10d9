// What every attention kernel on the GPU shares (xla_ext/cuda/attention.cu says how they fit
// together): the problem geometry, block coordinates, and the shared-memory tile layout and
// loads of the sm80 kernels. The PTX wrappers they use are in common/sm80.cuh (ldmatrix,
// mma.sync) and common/cuda_util.cuh (cp.async).

#pragma once

#include <cmath>
#include <cstdint>

#include "common/cuda_util.cuh"
#include "common/sm80.cuh"

namespace blujax {
namespace {

constexpr int kThreads = 128;  // 4 warps, in every attention kernel
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr unsigned kFull = 0xffffffffu;

// What every kernel knows about the problem. [B, T, H, D] tensors: one (batch, head) slice is
// T rows of D elements, H * D apart. k, v, dk and dv have KV heads: H for multi-head attention,
// a divisor of H for grouped-query attention.
struct Geometry {
  int heads = 0;
  int tq = 0, tk = 0;
  bool causal = false;
  float scale = 0.f;       // applied to dQ and dK at the end
  float scale_log2 = 0.f;  // scale * log2(e): scores in log2 units for exp2f
  // Elements from one token's row of dq, dk, dv to the next: H * D, or 3 * H * D when the
  // three are written into one [B, T, 3, H, D] gradient of a fused QKV projection.
  int64_t grad_stride = 0;
  // Grouped-query attention: the heads of k, v, dk, dv (KV), and the query heads per key/value
  // head (G = H / KV): query head h reads key/value head h / G. Read only by the kernels
  // compiled for it (kGqa), which the launchers take when G > 1; the multi-head kernels take
  // H and grad_stride for both sides, as they did before there were groups.
  int kv_heads = 0;
  int group = 1;
};

// The heads of k and v: KV for grouped-query attention, else H.
template <bool kGqa>
__device__ __forceinline__ int KvHeads(const Geometry& g) {
  return kGqa ? g.kv_heads : g.heads;
}

// Offset of row 0 of (batch, head) bh in a [B, T, H, D] tensor.
template <int D>
__device__ __forceinline__ int64_t HeadOffset(int64_t bh, int t_len, int heads) {
  const int64_t b = bh / heads, h = bh % heads;
  return (b * t_len * heads + h) * D;
}

// Offset of row 0 of (batch, head) bh in a gradient output (dq, dk or dv): rows are
// g.grad_stride apart.
template <int D>
__device__ __forceinline__ int64_t GradOffset(int64_t bh, int t_len, const Geometry& g) {
  const int64_t b = bh / g.heads, h = bh % g.heads;
  return b * t_len * g.grad_stride + h * D;
}

// Offset of row 0 of the key/value head that (batch, query head) bh reads, in k or v.
template <int D, bool kGqa>
__device__ __forceinline__ int64_t KvHeadOffset(int64_t bh, const Geometry& g) {
  if constexpr (kGqa) {
    const int64_t b = bh / g.heads;
    const int h = static_cast<int>(bh % g.heads);  // a 32-bit division below
    return (b * g.tk * g.kv_heads + h / g.group) * D;
  } else {
    return HeadOffset<D>(bh, g.tk, g.heads);
  }
}

// dk and dv of (batch, key/value head) bkv: the offset of row 0, and the elements from one row
// to the next. Multi-head, as GradOffset (they may be thirds of a fused QKV gradient); grouped,
// plain [B, Tk, KV, D] tensors.
template <int D, bool kGqa>
__device__ __forceinline__ int64_t KvGradOffset(int64_t bkv, const Geometry& g) {
  if constexpr (kGqa) {
    return HeadOffset<D>(bkv, g.tk, g.kv_heads);
  } else {
    return GradOffset<D>(bkv, g.tk, g);
  }
}
template <int D, bool kGqa>
__device__ __forceinline__ int64_t KvGradStride(const Geometry& g) {
  return kGqa ? int64_t(g.kv_heads) * D : g.grad_stride;
}

// The query steps of a grouped-query dK/dV kernel, which holds the keys of one (batch,
// key/value head) bkv and streams the query tiles past them: tiles first .. n_qt - 1 of each of
// the G query heads of its group, head after head, as one sequence of steps first, first + 1,
// ..., Last() - 1 (so that the loads of the next head's first tile overlap the last tile of
// this one). The multi-head kernels' step i is tile i of head bkv; they do not call these (the
// kernels write `kGqa ? steps.Tile(i) : i`: calls, even inlined ones that return i, changed the
// multi-head kernels' code).
struct QuerySteps {
  int64_t bkv;
  int first, per_head;  // per_head = n_qt - first tiles in each query head
  int group;

  __device__ __forceinline__ QuerySteps(int64_t bkv_, int first_, int n_qt, const Geometry& g)
      : bkv(bkv_), first(first_), per_head(n_qt - first_), group(g.group) {}
  __device__ __forceinline__ int Last() const { return first + per_head * group; }
  // Which of the group's query heads step i is in (0 .. G - 1), its query tile, and the
  // (batch, query head) its rows belong to.
  __device__ __forceinline__ int Member(int i) const { return (i - first) / per_head; }
  __device__ __forceinline__ int Tile(int i) const { return i - Member(i) * per_head; }
  __device__ __forceinline__ int64_t Head(int i) const { return bkv * group + Member(i); }
};

// This CTA's (tile, batch*head). Tiles vary fastest; `reverse` issues the last tile first.
__device__ __forceinline__ void BlockCoords(int n_tiles, bool reverse, int* tile, int64_t* bh) {
  const int64_t id = blockIdx.x;
  *bh = id / n_tiles;
  const int t = static_cast<int>(id % n_tiles);
  *tile = reverse ? n_tiles - 1 - t : t;
}

// Key tiles a query block [q0, q0 + rows) needs: causal stops at the block's last query.
__device__ __forceinline__ int KeyTiles(const Geometry& g, int q0, int rows, int tile) {
  const int last_key = g.causal ? min(q0 + rows, g.tq) - 1 : g.tk - 1;
  return last_key / tile + 1;
}

// ---------------------------------------------------------------------------------------------
// Shared-memory tiles.

// Element offset of 16-byte chunk `chunk` of row `row` in a swizzled bfloat16 tile.
template <int kChunks>
__device__ __forceinline__ int Swz(int row, int chunk) {
  static_assert(kChunks % 8 == 0, "the swizzle permutes groups of 8 chunks");
  return (row * kChunks + (chunk ^ (row & 7))) * 8;
}

// Rows [row0, row0 + kRows) of one (batch, head) slice -> shared memory, asynchronously;
// rows >= n_rows become zeros. kSwizzle: the bfloat16 layout above, else plain [kRows][D].
template <int kRows, int D, bool kSwizzle, typename T>
__device__ __forceinline__ void LoadTile(T* smem, const T* head, int64_t stride, int row0,
                                         int n_rows) {
  constexpr int kPack = 16 / sizeof(T), kChunks = D / kPack;
  static_assert((kRows * kChunks) % kThreads == 0, "whole chunks per thread");
#pragma unroll
  for (int i = 0; i < kRows * kChunks / kThreads; ++i) {
    const int c = threadIdx.x + i * kThreads, r = c / kChunks, ch = c % kChunks;
    const bool valid = row0 + r < n_rows;
    const T* src = head + (valid ? int64_t(row0 + r) * stride : 0) + ch * kPack;
    T* dst = smem + (kSwizzle ? Swz<kChunks>(r, ch) : (r * kChunks + ch) * kPack);
    CopyAsync16OrZeros(dst, src, valid);
  }
}

// kRows per-row statistics (lse or delta of one (batch, head)) starting at row0; zeros past n.
template <int kRows>
__device__ __forceinline__ void LoadStats(float* smem, const float* row_stats, int row0, int n) {
  static_assert(kRows <= kThreads, "one value per thread");
  if (threadIdx.x < kRows) {
    const bool valid = row0 + int(threadIdx.x) < n;
    CopyAsync4OrZeros(smem + threadIdx.x, row_stats + (valid ? row0 + threadIdx.x : 0), valid);
  }
}

}  // namespace
}  // namespace blujax
