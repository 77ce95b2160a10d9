// The device side of the kernels that write an FP8 copy of their output (common/fp8.h has the
// contract and the host side): SwiGLU's FP8 forms (cuda/swiglu.cu) and add_rms_norm's
// (cuda/rms_norm_fp8.cuh).
//
// A block owns a tile of the output, kFp8Tile rows by kFp8Tile columns; each of its threads
// takes runs of kFp8Per consecutive columns of one row (ForEachRun), writes the run's FP8 bytes
// as they lie in q and into the block's shared tile (PutRun), and, once the tile is whole,
// the block writes it transposed into qt, 16 bytes of a qt row a thread (PutTransposed). The
// amax goes into the tensor's with one atomic max on the float's bits a block (PutAmax: for a
// float >= 0, or NaN with its sign cleared, the order of the bits is the order of the values,
// NaN above all).
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "common/cuda_util.cuh"
#include "common/fp8.h"

namespace blujax {
namespace {

constexpr int kFp8Threads = 256;  // threads of a block
constexpr int kFp8Tile = 64;      // rows and columns of a tile
constexpr int kFp8Per = 8;        // columns a thread takes at once (16 bytes of bfloat16)
constexpr int kFp8Groups = kFp8Tile / kFp8Per;  // column groups of a tile row

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

// kFp8Per elements of a row from column c on, as floats: one or two 16-byte loads where
// `packed` (the row holds them all, 16-byte aligned), else element by element up to `cols`.
template <typename T>
__device__ __forceinline__ void LoadRun(const T* p, int64_t c, int64_t cols, bool packed,
                                        float (&v)[kFp8Per]) {
  if (packed) {
    constexpr int kPack = Pack<T>::kSize;
#pragma unroll
    for (int k = 0; k < kFp8Per; k += kPack) {
      const Pack<T> a = LoadPack(p + c + k);
#pragma unroll
      for (int j = 0; j < kPack; ++j) v[k + j] = PackElem(a, j);
    }
  } else {
#pragma unroll
    for (int k = 0; k < kFp8Per; ++k) v[k] = c + k < cols ? ToFloat(p[c + k]) : 0.f;
  }
}

// One run of kFp8Per outputs v at (r, c) of q [rows, width]: rounded to T, copied to FP8 into
// q (8 bytes at once where `packed`) and into the block's tile at (tr, tc); their amax bits
// into amax_bits.
template <typename T>
__device__ __forceinline__ void PutRun(const float (&v)[kFp8Per], const Divisor& scale, Fp8Format f,
                                       uint8_t* q, int64_t r, int64_t c, int64_t cols,
                                       int64_t width, bool packed, uint8_t (*tile)[kFp8Tile + 4],
                                       int tr, int tc, unsigned* amax_bits) {
  alignas(8) uint8_t b[kFp8Per];  // stored as one uint2 where packed
#pragma unroll
  for (int k = 0; k < kFp8Per; ++k) {
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
    for (int k = 0; k < kFp8Per; ++k)
      if (c + k < cols) out[k] = b[k];
  }
}

// The tile's bytes transposed into qt [width, rows] at rows c0 + tc (tc < 64) from column r0:
// 16 bytes of one qt row a thread.
__device__ __forceinline__ void PutTransposed(const uint8_t (*tile)[kFp8Tile + 4], uint8_t* qt,
                                              int64_t r0, int64_t rows, int64_t qt_row,
                                              int64_t c, int64_t cols, bool packed_t) {
  for (int item = threadIdx.x; item < kFp8Tile * (kFp8Tile / 16); item += kFp8Threads) {
    const int tc = item / (kFp8Tile / 16), tr = (item % (kFp8Tile / 16)) * 16;
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

// The block's amax bits (every thread's, kThreads of them) into the tensor's.
template <int kThreads = kFp8Threads>
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

// fn(tr, tc, r, c, whole) for each run of kFp8Per columns of the block's tile that the thread
// takes and that lies in the output: (tr, tc) in the tile, (r, c) in the output, whole if
// all kFp8Per columns are.
template <typename Fn>
__device__ __forceinline__ void ForEachRun(int64_t r0, int64_t c0, int64_t rows, int64_t cols,
                                           Fn&& fn) {
  for (int item = threadIdx.x; item < kFp8Tile * kFp8Groups; item += kFp8Threads) {
    const int tr = item / kFp8Groups, tc = (item % kFp8Groups) * kFp8Per;
    const int64_t r = r0 + tr, c = c0 + tc;
    if (r < rows && c < cols) fn(tr, tc, r, c, c + kFp8Per <= cols);
  }
}

// Layout facts a launch decides once: whole 16-byte runs of x's rows (packed), 8-byte runs
// of q's (packed_q), 16-byte runs of qt's (packed_t).
struct Fp8Layout {
  bool packed, packed_q, packed_t;
};

}  // namespace
}  // namespace blujax
