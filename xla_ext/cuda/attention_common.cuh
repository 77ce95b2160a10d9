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
// T rows of D elements, H * D apart.
struct Geometry {
  int heads = 0;
  int tq = 0, tk = 0;
  bool causal = false;
  float scale = 0.f;       // applied to dQ and dK at the end
  float scale_log2 = 0.f;  // scale * log2(e): scores in log2 units for exp2f
  // Elements from one token's row of dq, dk, dv to the next: H * D, or 3 * H * D when the
  // three are written into one [B, T, 3, H, D] gradient of a fused QKV projection.
  int64_t grad_stride = 0;
};

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
