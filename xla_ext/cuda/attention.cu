// Scaled dot-product attention on the GPU, flash style (FlashAttention-2's schedule); the CPU
// twin is xla_ext/cpu/attention.cc and the handler contract common/attention.h.
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
// Causal attention skips key tiles above the diagonal and masks only tiles that cross it;
// query blocks are issued longest first. Blocks are numbered tile-fastest within one
// (batch, head), so the CTAs resident together read the same K and V from L2.
//
// float32 must match a float32 reference (no TF32), so it runs on plain FMAs: a SIMT kernel
// of the same three-kernel shape where D/16 threads share a row, 16 columns each.
//
// Shared-memory tiles of bfloat16 are rows of D/8 16-byte chunks with the chunk index XORed
// by row % 8, so the 8 rows an ldmatrix phase reads at one logical chunk fall in 8 different
// bank groups (a row is 128 or 256 bytes, so unswizzled they would all share one).

#include <algorithm>
#include <atomic>
#include <cmath>

#include "common/attention.h"
#include "common/cuda_util.cuh"
#include "common/registry.h"

namespace blujax {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 128;  // 4 warps, in every attention kernel
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr unsigned kFull = 0xffffffffu;
constexpr int kDefaultSmem = 48 << 10;  // dynamic shared memory a kernel gets without opting in

// What every kernel knows about the problem. [B, T, H, D] tensors: one (batch, head) slice is
// T rows of D elements, H * D apart.
struct Geometry {
  int heads = 0;
  int tq = 0, tk = 0;
  bool causal = false;
  float scale = 0.f;       // applied to dQ and dK at the end
  float scale_log2 = 0.f;  // scale * log2(e): scores in log2 units for exp2f
};

// Offset of row 0 of (batch, head) bh in a [B, T, H, D] tensor.
template <int D>
__device__ __forceinline__ int64_t HeadOffset(int64_t bh, int t_len, int heads) {
  const int64_t b = bh / heads, h = bh % heads;
  return (b * t_len * heads + h) * D;
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
// PTX wrappers.

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared without blocking; when !valid nothing is read and zeros are
// written (cp.async's src-size 0).
__device__ __forceinline__ void CpAsync16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SmemAddr(dst)),
               "l"(__cvta_generic_to_global(src)), "r"(valid ? 16 : 0)
               : "memory");
}

__device__ __forceinline__ void CpAsync4(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(SmemAddr(dst)),
               "l"(__cvta_generic_to_global(src)), "r"(valid ? 4 : 0)
               : "memory");
}

__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

__device__ __forceinline__ void CpAsyncWaitAll() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Four 8x8 bfloat16 matrices from shared memory; lane i gives the address of row i % 8 of
// matrix i / 8, and register r receives matrix r in the mma operand layout (.trans: transposed).
__device__ __forceinline__ void LdMatrix(uint32_t (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddr(p))
               : "memory");
}

__device__ __forceinline__ void LdMatrixTrans(uint32_t (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddr(p))
               : "memory");
}

// c += a b for a 16x16 A (row major) and a 16x8 B (column major). Per lane, with
// g = lane / 4 and t = lane % 4: c = {(g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)};
// a = {(g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..)}; b = {(2t..2t+1, g), (2t+8.., g)}.
__device__ __forceinline__ void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // lo in the low half: the lower column
  return *reinterpret_cast<uint32_t*>(&v);
}

// The A operand of a k-step over columns 16kk..16kk+15 from accumulators c[n] of columns
// 8n..8n+7: an mma's output layout is its successor's input layout, so no data moves.
template <int kN>
__device__ __forceinline__ void AccToOperand(uint32_t (&a)[4], const float (&c)[kN][4], int kk) {
  a[0] = PackBf16(c[2 * kk][0], c[2 * kk][1]);
  a[1] = PackBf16(c[2 * kk][2], c[2 * kk][3]);
  a[2] = PackBf16(c[2 * kk + 1][0], c[2 * kk + 1][1]);
  a[3] = PackBf16(c[2 * kk + 1][2], c[2 * kk + 1][3]);
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
    CpAsync16(dst, src, valid);
  }
}

// kRows per-row statistics (lse or delta of one (batch, head)) starting at row0; zeros past n.
template <int kRows>
__device__ __forceinline__ void LoadStats(float* smem, const float* row_stats, int row0, int n) {
  static_assert(kRows <= kThreads, "one value per thread");
  if (threadIdx.x < kRows) {
    const bool valid = row0 + int(threadIdx.x) < n;
    CpAsync4(smem + threadIdx.x, row_stats + (valid ? row0 + threadIdx.x : 0), valid);
  }
}

// ---------------------------------------------------------------------------------------------
// bfloat16 forward: one CTA per 64 * kMT query rows of one (batch, head); a warp owns kMT
// m-tiles of 16 rows. Every K or V fragment a warp reads from shared memory feeds kMT mmas, so
// kMT = 2 halves the shared-memory traffic per FLOP (at kMT = 1 the tile loop waits on ldmatrix,
// not on the tensor cores). kQRegs keeps Q's fragments in registers for the whole loop;
// without it they are re-read per key tile, which leaves room for the accumulators at D = 128.

template <int D, int MT, int BN, bool QRegs>
struct FwdBf16Cfg {
  static constexpr int kD = D, kMT = MT, kBN = BN;
  static constexpr bool kQRegs = QRegs;
  static constexpr int kBM = 64 * kMT, kChunks = D / 8;
  static constexpr int kSmem = (kBM + 4 * kBN) * D * int(sizeof(bf16));  // Q, 2 x (K, V)
};

// Measured on an H100 (benchmarks/RESULTS.md): kMT = 2 runs 7-21% faster than kMT = 1. At
// D = 64, 64-key tiles with Q in registers (248 registers, no spills); at D = 128, 32-key tiles
// with Q re-read (254 registers; Q in registers or 64-key tiles spill and lose 1-20%).
template <int D>
using FwdBf16 = FwdBf16Cfg<D, 2, D == 64 ? 64 : 32, D == 64>;

template <typename C>
__global__ void __launch_bounds__(kThreads)
AttentionFwdBf16Kernel(const bf16* __restrict__ q, const bf16* __restrict__ k,
                       const bf16* __restrict__ v, bf16* __restrict__ out,
                       float* __restrict__ lse, Geometry g, int n_qt) {
  constexpr int D = C::kD, BM = C::kBM, BN = C::kBN, KC = C::kChunks, MT = C::kMT;
  extern __shared__ uint4 smem_fwd_bf16[];
  bf16* sQ = reinterpret_cast<bf16*>(smem_fwd_bf16);
  bf16* sK = sQ + BM * D;      // [2][BN][D]
  bf16* sV = sK + 2 * BN * D;  // [2][BN][D]

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gr = lane / 4, t4 = lane % 4;  // accumulator row group and column pair
  int qt;
  int64_t bh;
  BlockCoords(n_qt, g.causal, &qt, &bh);
  const int q0 = qt * BM;
  const int wrow = warp * 16 * MT;  // this warp's first row in the block
  const int64_t stride = int64_t(g.heads) * D;
  const bf16* qh = q + HeadOffset<D>(bh, g.tq, g.heads);
  const bf16* kh = k + HeadOffset<D>(bh, g.tk, g.heads);
  const bf16* vh = v + HeadOffset<D>(bh, g.tk, g.heads);
  const int n_kt = KeyTiles(g, q0, BM, BN);

  LoadTile<BM, D, true>(sQ, qh, stride, q0, g.tq);
  LoadTile<BN, D, true>(sK, kh, stride, 0, g.tk);
  LoadTile<BN, D, true>(sV, vh, stride, 0, g.tk);
  CpAsyncCommit();

  uint32_t qf[C::kQRegs ? MT : 1][C::kQRegs ? D / 16 : 1][4];
  float o[MT][D / 8][4] = {};
  float m[MT][2], l[MT][2];  // running max (log2 units) and this thread's part of the sum
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) m[mt][0] = m[mt][1] = -INFINITY, l[mt][0] = l[mt][1] = 0.f;
  // Q's A fragment of m-tile mt, k-step kk.
  auto q_frag = [&](uint32_t (&a)[4], int mt, int kk) {
    LdMatrix(a, sQ + Swz<KC>(wrow + mt * 16 + (lane & 15), 2 * kk + (lane >> 4)));
  };

  for (int j = 0; j < n_kt; ++j) {
    CpAsyncWaitAll();
    __syncthreads();  // tile j is in; every warp is done with tile j - 1's buffer
    if (j + 1 < n_kt) {
      const int nb = (j + 1) & 1;
      LoadTile<BN, D, true>(sK + nb * BN * D, kh, stride, (j + 1) * BN, g.tk);
      LoadTile<BN, D, true>(sV + nb * BN * D, vh, stride, (j + 1) * BN, g.tk);
    }
    CpAsyncCommit();
    if constexpr (C::kQRegs) {
      if (j == 0) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int kk = 0; kk < D / 16; ++kk) q_frag(qf[mt][kk], mt, kk);
      }
    }
    const bf16* cK = sK + (j & 1) * BN * D;
    const bf16* cV = sV + (j & 1) * BN * D;
    const int k0 = j * BN;

    // S = Q K^T: this warp's 16 * MT rows x BN keys.
    float s[MT][BN / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if constexpr (C::kQRegs) {
#pragma unroll
          for (int i = 0; i < 4; ++i) a[mt][i] = qf[mt][kk][i];
        } else {
          q_frag(a[mt], mt, kk);
        }
      }
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        uint32_t b[4];
        LdMatrix(b, cK + Swz<KC>(np * 16 + (lane & 7) + ((lane >> 4) << 3),
                                 2 * kk + ((lane >> 3) & 1)));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          Mma(s[mt][2 * np], a[mt], b[0], b[1]);
          Mma(s[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
      }
    }
    if (k0 + BN > g.tk || (g.causal && k0 + BN - 1 > q0 + wrow)) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = k0 + n * 8 + 2 * t4 + (e & 1);
            const int row = q0 + wrow + mt * 16 + gr + (e >> 1) * 8;
            if (key >= g.tk || (g.causal && key > row)) s[mt][n][e] = -INFINITY;
          }
        }
      }
    }

    // Online softmax; rows g and g + 8 of each m-tile are shared by the 4 threads of a quad.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = -INFINITY;
#pragma unroll
        for (int n = 0; n < BN / 8; ++n)
          mx = fmaxf(mx, fmaxf(s[mt][n][2 * r], s[mt][n][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 2));
        const float m_new = fmaxf(m[mt][r], mx * g.scale_log2);
        const float base = m_new == -INFINITY ? 0.f : m_new;  // a row with no key yet
        const float alpha = exp2f(m[mt][r] - base);
        m[mt][r] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float p = exp2f(fmaf(s[mt][n][2 * r + e], g.scale_log2, -base));
            s[mt][n][2 * r + e] = p;
            sum += p;
          }
        }
        l[mt][r] = l[mt][r] * alpha + sum;
#pragma unroll
        for (int dn = 0; dn < D / 8; ++dn) {
          o[mt][dn][2 * r] *= alpha;
          o[mt][dn][2 * r + 1] *= alpha;
        }
      }
    }

    // O += P V.
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) AccToOperand(pa[mt], s[mt], kk);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t b[4];
        LdMatrixTrans(b, cV + Swz<KC>(kk * 16 + (lane & 7) + (lane & 8), 2 * dp + (lane >> 4)));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          Mma(o[mt][2 * dp], pa[mt], b[0], b[1]);
          Mma(o[mt][2 * dp + 1], pa[mt], b[2], b[3]);
        }
      }
    }
  }

  // Normalise, stage this warp's rows in its own rows of sQ (only it read them), and write
  // whole 16-byte chunks.
  __syncwarp();
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float sum = l[mt][r];
      sum += __shfl_xor_sync(kFull, sum, 1);
      sum += __shfl_xor_sync(kFull, sum, 2);
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      const int row = wrow + mt * 16 + gr + 8 * r;
#pragma unroll
      for (int dn = 0; dn < D / 8; ++dn)
        *reinterpret_cast<uint32_t*>(sQ + Swz<KC>(row, dn) + 2 * t4) =
            PackBf16(o[mt][dn][2 * r] * inv, o[mt][dn][2 * r + 1] * inv);
      if (t4 == 0 && q0 + row < g.tq)
        lse[bh * g.tq + q0 + row] = (m[mt][r] + log2f(sum)) * kLn2;
    }
  }
  __syncwarp();
  bf16* oh = out + HeadOffset<D>(bh, g.tq, g.heads);
#pragma unroll
  for (int i = 0; i < 16 * MT * KC / 32; ++i) {
    const int c = lane + 32 * i, row = wrow + c / KC, ch = c % KC;
    if (q0 + row < g.tq)
      *reinterpret_cast<uint4*>(oh + int64_t(q0 + row) * stride + ch * 8) =
          *reinterpret_cast<const uint4*>(sQ + Swz<KC>(row, ch));
  }
}

// ---------------------------------------------------------------------------------------------
// bfloat16 backward, dK and dV: one CTA per 64 keys of one (batch, head), looping over query
// tiles. A warp owns 16 keys, so P^T and dS^T (keys x queries) stay in its registers and feed
// the dV and dK products directly.

template <int D>
struct BwdKvBf16 {
  static constexpr int kBN = 64;                 // keys per CTA
  static constexpr int kBM = D == 128 ? 32 : 64;  // queries per tile: the accumulators of
                                                  // dK and dV take D/2 registers each
  static constexpr int kChunks = D / 8;
  // This warp's K and V fragments (the A operands of S^T and dP^T) held in registers rather
  // than re-read per query tile: 32 registers at D = 64; no room at D = 128.
  static constexpr bool kKvRegs = D == 64;
  static constexpr int kSmem = (2 * kBN + 4 * kBM) * D * int(sizeof(bf16)) +  // K, V, 2 x (Q, dO)
                               4 * kBM * int(sizeof(float));                   // 2 x (lse, delta)
};

template <int D>
__global__ void __launch_bounds__(kThreads)
AttentionBwdKvBf16Kernel(const bf16* __restrict__ q, const bf16* __restrict__ k,
                         const bf16* __restrict__ v, const bf16* __restrict__ dout,
                         const float* __restrict__ lse, const float* __restrict__ delta,
                         bf16* __restrict__ dk, bf16* __restrict__ dv, Geometry g, int n_kt) {
  using C = BwdKvBf16<D>;
  constexpr int BM = C::kBM, BN = C::kBN, KC = C::kChunks;
  extern __shared__ uint4 smem_kv_bf16[];
  bf16* sK = reinterpret_cast<bf16*>(smem_kv_bf16);
  bf16* sV = sK + BN * D;
  bf16* sQ = sV + BN * D;       // [2][BM][D]
  bf16* sdO = sQ + 2 * BM * D;  // [2][BM][D]
  float* sL = reinterpret_cast<float*>(sdO + 2 * BM * D);  // [2][BM]
  float* sDl = sL + 2 * BM;                                // [2][BM]

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gr = lane / 4, t4 = lane % 4;
  int kt;
  int64_t bh;
  BlockCoords(n_kt, false, &kt, &bh);  // causal: key tile 0 has the most work, so it goes first
  const int k0 = kt * BN;
  const int64_t stride = int64_t(g.heads) * D;
  const bf16* qh = q + HeadOffset<D>(bh, g.tq, g.heads);
  const bf16* doh = dout + HeadOffset<D>(bh, g.tq, g.heads);
  const float* lh = lse + bh * g.tq;
  const float* dlh = delta + bh * g.tq;
  const int n_qt = (g.tq + BM - 1) / BM;
  const int first = g.causal ? k0 / BM : 0;  // earlier queries see none of these keys
  const int key_a = k0 + warp * 16 + gr;     // the key of accumulator entries 0, 1 (+8: 2, 3)

  LoadTile<BN, D, true>(sK, k + HeadOffset<D>(bh, g.tk, g.heads), stride, k0, g.tk);
  LoadTile<BN, D, true>(sV, v + HeadOffset<D>(bh, g.tk, g.heads), stride, k0, g.tk);
  LoadTile<BM, D, true>(sQ, qh, stride, first * BM, g.tq);
  LoadTile<BM, D, true>(sdO, doh, stride, first * BM, g.tq);
  LoadStats<BM>(sL, lh, first * BM, g.tq);
  LoadStats<BM>(sDl, dlh, first * BM, g.tq);
  CpAsyncCommit();

  float dk_acc[D / 8][4] = {}, dv_acc[D / 8][4] = {};
  uint32_t kf[C::kKvRegs ? D / 16 : 1][4], vf[C::kKvRegs ? D / 16 : 1][4];
  for (int i = first; i < n_qt; ++i) {
    CpAsyncWaitAll();
    __syncthreads();
    if constexpr (C::kKvRegs) {
      if (i == first) {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          const int at = Swz<KC>(warp * 16 + (lane & 15), 2 * kk + (lane >> 4));
          LdMatrix(kf[kk], sK + at);
          LdMatrix(vf[kk], sV + at);
        }
      }
    }
    if (i + 1 < n_qt) {
      const int nb = (i + 1 - first) & 1, r0 = (i + 1) * BM;
      LoadTile<BM, D, true>(sQ + nb * BM * D, qh, stride, r0, g.tq);
      LoadTile<BM, D, true>(sdO + nb * BM * D, doh, stride, r0, g.tq);
      LoadStats<BM>(sL + nb * BM, lh, r0, g.tq);
      LoadStats<BM>(sDl + nb * BM, dlh, r0, g.tq);
    }
    CpAsyncCommit();
    const int buf = (i - first) & 1, q0 = i * BM;
    const bf16* cQ = sQ + buf * BM * D;
    const bf16* cdO = sdO + buf * BM * D;
    const float* cL = sL + buf * BM;
    const float* cDl = sDl + buf * BM;

    // S^T = K Q^T: this warp's 16 keys x BM queries.
    float st[BM / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[4];
      if constexpr (C::kKvRegs) {
#pragma unroll
        for (int r = 0; r < 4; ++r) a[r] = kf[kk][r];
      } else {
        LdMatrix(a, sK + Swz<KC>(warp * 16 + (lane & 15), 2 * kk + (lane >> 4)));
      }
#pragma unroll
      for (int np = 0; np < BM / 16; ++np) {
        uint32_t b[4];
        LdMatrix(b, cQ + Swz<KC>(np * 16 + (lane & 7) + ((lane >> 4) << 3),
                                 2 * kk + ((lane >> 3) & 1)));
        Mma(st[2 * np], a, b[0], b[1]);
        Mma(st[2 * np + 1], a, b[2], b[3]);
      }
    }
    // P^T = exp(scale S^T - lse of each column's query); masked entries are 0.
    const bool mask = q0 + BM > g.tq || k0 + BN > g.tk || (g.causal && q0 < k0 + BN - 1);
#pragma unroll
    for (int n = 0; n < BM / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = n * 8 + 2 * t4 + (e & 1), query = q0 + col, key = key_a + (e >> 1) * 8;
        float p = exp2f(fmaf(st[n][e], g.scale_log2, -cL[col] * kLog2e));
        if (mask && (query >= g.tq || key >= g.tk || (g.causal && key > query))) p = 0.f;
        st[n][e] = p;
      }
    }
    // dV += P^T dO.
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      uint32_t pa[4];
      AccToOperand(pa, st, kk);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t b[4];
        LdMatrixTrans(b, cdO + Swz<KC>(kk * 16 + (lane & 7) + (lane & 8), 2 * dp + (lane >> 4)));
        Mma(dv_acc[2 * dp], pa, b[0], b[1]);
        Mma(dv_acc[2 * dp + 1], pa, b[2], b[3]);
      }
    }
    // dP^T = V dO^T.
    float dpt[BM / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[4];
      if constexpr (C::kKvRegs) {
#pragma unroll
        for (int r = 0; r < 4; ++r) a[r] = vf[kk][r];
      } else {
        LdMatrix(a, sV + Swz<KC>(warp * 16 + (lane & 15), 2 * kk + (lane >> 4)));
      }
#pragma unroll
      for (int np = 0; np < BM / 16; ++np) {
        uint32_t b[4];
        LdMatrix(b, cdO + Swz<KC>(np * 16 + (lane & 7) + ((lane >> 4) << 3),
                                  2 * kk + ((lane >> 3) & 1)));
        Mma(dpt[2 * np], a, b[0], b[1]);
        Mma(dpt[2 * np + 1], a, b[2], b[3]);
      }
    }
    // dS^T = P^T (dP^T - delta), in place.
#pragma unroll
    for (int n = 0; n < BM / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) dpt[n][e] = st[n][e] * (dpt[n][e] - cDl[n * 8 + 2 * t4 + (e & 1)]);
    }
    // dK += dS^T Q (scaled at the end).
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      uint32_t da[4];
      AccToOperand(da, dpt, kk);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t b[4];
        LdMatrixTrans(b, cQ + Swz<KC>(kk * 16 + (lane & 7) + (lane & 8), 2 * dp + (lane >> 4)));
        Mma(dk_acc[2 * dp], da, b[0], b[1]);
        Mma(dk_acc[2 * dp + 1], da, b[2], b[3]);
      }
    }
  }

  // Stage in this warp's own rows of sK / sV (no other warp reads them) and write.
  __syncwarp();
#pragma unroll
  for (int dn = 0; dn < D / 8; ++dn) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = warp * 16 + gr + 8 * r, at = Swz<KC>(row, dn) + 2 * t4;
      *reinterpret_cast<uint32_t*>(sK + at) =
          PackBf16(dk_acc[dn][2 * r] * g.scale, dk_acc[dn][2 * r + 1] * g.scale);
      *reinterpret_cast<uint32_t*>(sV + at) = PackBf16(dv_acc[dn][2 * r], dv_acc[dn][2 * r + 1]);
    }
  }
  __syncwarp();
  const int64_t kv_off = HeadOffset<D>(bh, g.tk, g.heads);
#pragma unroll
  for (int i = 0; i < 16 * KC / 32; ++i) {
    const int c = lane + 32 * i, row = warp * 16 + c / KC, ch = c % KC;
    if (k0 + row < g.tk) {
      const int64_t at = kv_off + int64_t(k0 + row) * stride + ch * 8;
      *reinterpret_cast<uint4*>(dk + at) = *reinterpret_cast<const uint4*>(sK + Swz<KC>(row, ch));
      *reinterpret_cast<uint4*>(dv + at) = *reinterpret_cast<const uint4*>(sV + Swz<KC>(row, ch));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// bfloat16 backward, dQ: one CTA per 64 * kMT query rows, looping over key tiles; a warp owns
// kMT m-tiles of 16 rows, so each K or V fragment read from shared memory feeds kMT mmas (as
// in the forward).

template <int D, int MT, int BN>
struct BwdQBf16Cfg {
  static constexpr int kD = D, kMT = MT, kBM = 64 * MT, kBN = BN, kChunks = D / 8;
  static constexpr int kSmem = (2 * kBM + 4 * kBN) * D * int(sizeof(bf16));  // Q, dO, 2 x (K, V)
};

// kMT = 2 with 32-key tiles: 1-4% faster per forward+backward than 64 rows x 64 keys (and
// than 128 x 64, which spills at D = 128).
template <int D>
using BwdQBf16 = BwdQBf16Cfg<D, 2, 32>;

template <typename C>
__global__ void __launch_bounds__(kThreads)
AttentionBwdQBf16Kernel(const bf16* __restrict__ q, const bf16* __restrict__ k,
                        const bf16* __restrict__ v, const bf16* __restrict__ dout,
                        const float* __restrict__ lse, const float* __restrict__ delta,
                        bf16* __restrict__ dq, Geometry g, int n_qt) {
  constexpr int D = C::kD, BM = C::kBM, BN = C::kBN, KC = C::kChunks, MT = C::kMT;
  extern __shared__ uint4 smem_q_bf16[];
  bf16* sQ = reinterpret_cast<bf16*>(smem_q_bf16);
  bf16* sdO = sQ + BM * D;
  bf16* sK = sdO + BM * D;     // [2][BN][D]
  bf16* sV = sK + 2 * BN * D;  // [2][BN][D]

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gr = lane / 4, t4 = lane % 4;
  int qt;
  int64_t bh;
  BlockCoords(n_qt, g.causal, &qt, &bh);
  const int q0 = qt * BM;
  const int wrow = warp * 16 * MT;  // this warp's first row in the block
  const int64_t stride = int64_t(g.heads) * D;
  const int64_t q_off = HeadOffset<D>(bh, g.tq, g.heads);
  const bf16* kh = k + HeadOffset<D>(bh, g.tk, g.heads);
  const bf16* vh = v + HeadOffset<D>(bh, g.tk, g.heads);
  const int n_kt = KeyTiles(g, q0, BM, BN);

  LoadTile<BM, D, true>(sQ, q + q_off, stride, q0, g.tq);
  LoadTile<BM, D, true>(sdO, dout + q_off, stride, q0, g.tq);
  LoadTile<BN, D, true>(sK, kh, stride, 0, g.tk);
  LoadTile<BN, D, true>(sV, vh, stride, 0, g.tk);
  CpAsyncCommit();

  // Per-row statistics of rows wrow + 16 mt + gr (+ 8); rows past Tq are masked below.
  float lse2[MT][2], dl[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = q0 + wrow + mt * 16 + gr + 8 * r;
      lse2[mt][r] = row < g.tq ? lse[bh * g.tq + row] * kLog2e : 0.f;
      dl[mt][r] = row < g.tq ? delta[bh * g.tq + row] : 0.f;
    }
  }

  float dq_acc[MT][D / 8][4] = {};
  for (int j = 0; j < n_kt; ++j) {
    CpAsyncWaitAll();
    __syncthreads();
    if (j + 1 < n_kt) {
      const int nb = (j + 1) & 1;
      LoadTile<BN, D, true>(sK + nb * BN * D, kh, stride, (j + 1) * BN, g.tk);
      LoadTile<BN, D, true>(sV + nb * BN * D, vh, stride, (j + 1) * BN, g.tk);
    }
    CpAsyncCommit();
    const bf16* cK = sK + (j & 1) * BN * D;
    const bf16* cV = sV + (j & 1) * BN * D;
    const int k0 = j * BN;
    // Causal: a tile whose keys all come after this warp's last row adds nothing to its dQ
    // (the block's later rows need the tile). The same skip in the forward measured 0-8%
    // slower at D = 128, so it is not there.
    if (g.causal && q0 + wrow + 16 * MT - 1 < k0) continue;

    // S = Q K^T and dP = dO V^T: this warp's 16 * MT rows x BN keys. The Q and dO operands
    // are re-read from shared memory rather than held, to leave registers to the accumulators.
    float s[MT][BN / 8][4] = {}, dp[MT][BN / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[MT][4], ao[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int at = Swz<KC>(wrow + mt * 16 + (lane & 15), 2 * kk + (lane >> 4));
        LdMatrix(a[mt], sQ + at);
        LdMatrix(ao[mt], sdO + at);
      }
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        const int at = Swz<KC>(np * 16 + (lane & 7) + ((lane >> 4) << 3), 2 * kk + ((lane >> 3) & 1));
        uint32_t b[4];
        LdMatrix(b, cK + at);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          Mma(s[mt][2 * np], a[mt], b[0], b[1]);
          Mma(s[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
        LdMatrix(b, cV + at);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          Mma(dp[mt][2 * np], ao[mt], b[0], b[1]);
          Mma(dp[mt][2 * np + 1], ao[mt], b[2], b[3]);
        }
      }
    }
    // dS = P (dP - delta), P = exp(scale S - lse); masked entries are 0.
    const bool mask = q0 + BM > g.tq || k0 + BN > g.tk || (g.causal && k0 + BN - 1 > q0 + wrow);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = k0 + n * 8 + 2 * t4 + (e & 1), r = e >> 1;
          const int row = q0 + wrow + mt * 16 + gr + 8 * r;
          float p = exp2f(fmaf(s[mt][n][e], g.scale_log2, -lse2[mt][r]));
          if (mask && (row >= g.tq || key >= g.tk || (g.causal && key > row))) p = 0.f;
          s[mt][n][e] = p * (dp[mt][n][e] - dl[mt][r]);
        }
      }
    }
    // dQ += dS K (scaled at the end).
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t da[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) AccToOperand(da[mt], s[mt], kk);
#pragma unroll
      for (int dn = 0; dn < D / 16; ++dn) {
        uint32_t b[4];
        LdMatrixTrans(b, cK + Swz<KC>(kk * 16 + (lane & 7) + (lane & 8), 2 * dn + (lane >> 4)));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          Mma(dq_acc[mt][2 * dn], da[mt], b[0], b[1]);
          Mma(dq_acc[mt][2 * dn + 1], da[mt], b[2], b[3]);
        }
      }
    }
  }

  // Stage in this warp's own rows of sQ and write.
  __syncwarp();
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = wrow + mt * 16 + gr + 8 * r;
        *reinterpret_cast<uint32_t*>(sQ + Swz<KC>(row, dn) + 2 * t4) = PackBf16(
            dq_acc[mt][dn][2 * r] * g.scale, dq_acc[mt][dn][2 * r + 1] * g.scale);
      }
    }
  }
  __syncwarp();
#pragma unroll
  for (int i = 0; i < 16 * MT * KC / 32; ++i) {
    const int c = lane + 32 * i, row = wrow + c / KC, ch = c % KC;
    if (q0 + row < g.tq)
      *reinterpret_cast<uint4*>(dq + q_off + int64_t(q0 + row) * stride + ch * 8) =
          *reinterpret_cast<const uint4*>(sQ + Swz<KC>(row, ch));
  }
}

// ---------------------------------------------------------------------------------------------
// float32: SIMT kernels. kLanes = D/16 consecutive threads share a row; thread c of them owns
// the 16 columns 4c + (D/4)u + e (u, e < 4), read as float4. The rows a CTA keeps (queries,
// or keys in dK/dV) live in registers; the other side streams through shared memory in
// double-buffered tiles of 16 rows, read by all threads of a row at once (broadcast).

template <int D>
struct F32Tile {
  static constexpr int kLanes = D / 16;
  static constexpr int kRows = kThreads / kLanes;  // rows per CTA: 32 (D = 64) or 16 (D = 128)
  static constexpr int kTile = 16;                 // rows per streamed tile (more spills on sm_80)
  static constexpr int kSmem = 4 * kTile * D * int(sizeof(float)) + 4 * kTile * int(sizeof(float));
};

template <int D>
__device__ __forceinline__ void LoadRow(float (&x)[16], const float* row, int c, bool valid) {
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const float4 f = valid ? *reinterpret_cast<const float4*>(row + 4 * c + (D / 4) * u)
                           : make_float4(0.f, 0.f, 0.f, 0.f);
    x[4 * u] = f.x;
    x[4 * u + 1] = f.y;
    x[4 * u + 2] = f.z;
    x[4 * u + 3] = f.w;
  }
}

template <int D>
__device__ __forceinline__ void StoreRow(float* row, const float (&x)[16], int c, float mul) {
#pragma unroll
  for (int u = 0; u < 4; ++u)
    *reinterpret_cast<float4*>(row + 4 * c + (D / 4) * u) =
        make_float4(x[4 * u] * mul, x[4 * u + 1] * mul, x[4 * u + 2] * mul, x[4 * u + 3] * mul);
}

// acc += w * (this thread's columns of a shared-memory row).
template <int D>
__device__ __forceinline__ void AxpyRow(float (&acc)[16], float w, const float* row, int c) {
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const float4 f = *reinterpret_cast<const float4*>(row + 4 * c + (D / 4) * u);
    acc[4 * u] = fmaf(w, f.x, acc[4 * u]);
    acc[4 * u + 1] = fmaf(w, f.y, acc[4 * u + 1]);
    acc[4 * u + 2] = fmaf(w, f.z, acc[4 * u + 2]);
    acc[4 * u + 3] = fmaf(w, f.w, acc[4 * u + 3]);
  }
}

// The dot product of a row held by the kLanes threads of a group with a shared-memory row.
template <int D>
__device__ __forceinline__ float DotRow(const float (&x)[16], const float* row, int c) {
  float s = 0.f;
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const float4 f = *reinterpret_cast<const float4*>(row + 4 * c + (D / 4) * u);
    s = fmaf(x[4 * u], f.x, s);
    s = fmaf(x[4 * u + 1], f.y, s);
    s = fmaf(x[4 * u + 2], f.z, s);
    s = fmaf(x[4 * u + 3], f.w, s);
  }
#pragma unroll
  for (int o = F32Tile<D>::kLanes / 2; o > 0; o /= 2) s += __shfl_xor_sync(kFull, s, o);
  return s;
}

template <int D>
__global__ void __launch_bounds__(kThreads)
AttentionFwdF32Kernel(const float* __restrict__ q, const float* __restrict__ k,
                      const float* __restrict__ v, float* __restrict__ out,
                      float* __restrict__ lse, Geometry g, int n_qt) {
  using C = F32Tile<D>;
  constexpr int RB = C::kRows, BN = C::kTile;
  extern __shared__ uint4 smem_fwd_f32[];
  float* sK = reinterpret_cast<float*>(smem_fwd_f32);  // [2][BN][D]
  float* sV = sK + 2 * BN * D;                         // [2][BN][D]

  int qt;
  int64_t bh;
  BlockCoords(n_qt, g.causal, &qt, &bh);
  const int q0 = qt * RB, row = q0 + threadIdx.x / C::kLanes, c = threadIdx.x % C::kLanes;
  const bool valid = row < g.tq;
  const int64_t stride = int64_t(g.heads) * D;
  const int64_t q_off = HeadOffset<D>(bh, g.tq, g.heads) + int64_t(row) * stride;
  const float* kh = k + HeadOffset<D>(bh, g.tk, g.heads);
  const float* vh = v + HeadOffset<D>(bh, g.tk, g.heads);
  const int n_kt = KeyTiles(g, q0, RB, BN);

  LoadTile<BN, D, false>(sK, kh, stride, 0, g.tk);
  LoadTile<BN, D, false>(sV, vh, stride, 0, g.tk);
  CpAsyncCommit();
  float qr[16], o[16] = {};
  LoadRow<D>(qr, q + q_off, c, valid);
  float m = -INFINITY, l = 0.f;

  for (int j = 0; j < n_kt; ++j) {
    CpAsyncWaitAll();
    __syncthreads();
    if (j + 1 < n_kt) {
      const int nb = (j + 1) & 1;
      LoadTile<BN, D, false>(sK + nb * BN * D, kh, stride, (j + 1) * BN, g.tk);
      LoadTile<BN, D, false>(sV + nb * BN * D, vh, stride, (j + 1) * BN, g.tk);
    }
    CpAsyncCommit();
    const float* cK = sK + (j & 1) * BN * D;
    const float* cV = sV + (j & 1) * BN * D;
    const int k0 = j * BN;
    float s[BN];
    float mx = -INFINITY;
#pragma unroll
    for (int jj = 0; jj < BN; ++jj) {
      const int key = k0 + jj;
      s[jj] = DotRow<D>(qr, cK + jj * D, c) * g.scale_log2;
      if (key >= g.tk || (g.causal && key > row)) s[jj] = -INFINITY;
      mx = fmaxf(mx, s[jj]);
    }
    const float m_new = fmaxf(m, mx);
    const float base = m_new == -INFINITY ? 0.f : m_new;
    const float alpha = exp2f(m - base);
    m = m_new;
    l *= alpha;
#pragma unroll
    for (int i = 0; i < 16; ++i) o[i] *= alpha;
#pragma unroll
    for (int jj = 0; jj < BN; ++jj) {
      const float p = exp2f(s[jj] - base);
      l += p;
      AxpyRow<D>(o, p, cV + jj * D, c);
    }
  }
  if (valid) {
    StoreRow<D>(out + q_off, o, c, l > 0.f ? 1.f / l : 0.f);
    if (c == 0) lse[bh * g.tq + row] = (m + log2f(l)) * kLn2;
  }
}

template <int D>
__global__ void __launch_bounds__(kThreads)
AttentionBwdKvF32Kernel(const float* __restrict__ q, const float* __restrict__ k,
                        const float* __restrict__ v, const float* __restrict__ dout,
                        const float* __restrict__ lse, const float* __restrict__ delta,
                        float* __restrict__ dk, float* __restrict__ dv, Geometry g, int n_kt) {
  using C = F32Tile<D>;
  constexpr int RB = C::kRows, BQ = C::kTile;
  extern __shared__ uint4 smem_kv_f32[];
  float* sQ = reinterpret_cast<float*>(smem_kv_f32);  // [2][BQ][D]
  float* sdO = sQ + 2 * BQ * D;                       // [2][BQ][D]
  float* sL = sdO + 2 * BQ * D;                       // [2][BQ]
  float* sDl = sL + 2 * BQ;                           // [2][BQ]

  int kt;
  int64_t bh;
  BlockCoords(n_kt, false, &kt, &bh);
  const int k0 = kt * RB, key = k0 + threadIdx.x / C::kLanes, c = threadIdx.x % C::kLanes;
  const bool valid = key < g.tk;
  const int64_t stride = int64_t(g.heads) * D;
  const int64_t kv_off = HeadOffset<D>(bh, g.tk, g.heads) + int64_t(key) * stride;
  const float* qh = q + HeadOffset<D>(bh, g.tq, g.heads);
  const float* doh = dout + HeadOffset<D>(bh, g.tq, g.heads);
  const float* lh = lse + bh * g.tq;
  const float* dlh = delta + bh * g.tq;
  const int n_qt = (g.tq + BQ - 1) / BQ;
  const int first = g.causal ? k0 / BQ : 0;

  LoadTile<BQ, D, false>(sQ, qh, stride, first * BQ, g.tq);
  LoadTile<BQ, D, false>(sdO, doh, stride, first * BQ, g.tq);
  LoadStats<BQ>(sL, lh, first * BQ, g.tq);
  LoadStats<BQ>(sDl, dlh, first * BQ, g.tq);
  CpAsyncCommit();
  float kr[16], vr[16], dk_acc[16] = {}, dv_acc[16] = {};
  LoadRow<D>(kr, k + kv_off, c, valid);
  LoadRow<D>(vr, v + kv_off, c, valid);

  for (int i = first; i < n_qt; ++i) {
    CpAsyncWaitAll();
    __syncthreads();
    if (i + 1 < n_qt) {
      const int nb = (i + 1 - first) & 1, r0 = (i + 1) * BQ;
      LoadTile<BQ, D, false>(sQ + nb * BQ * D, qh, stride, r0, g.tq);
      LoadTile<BQ, D, false>(sdO + nb * BQ * D, doh, stride, r0, g.tq);
      LoadStats<BQ>(sL + nb * BQ, lh, r0, g.tq);
      LoadStats<BQ>(sDl + nb * BQ, dlh, r0, g.tq);
    }
    CpAsyncCommit();
    const int buf = (i - first) & 1, q0 = i * BQ;
    const float* cQ = sQ + buf * BQ * D;
    const float* cdO = sdO + buf * BQ * D;
    const float* cL = sL + buf * BQ;
    const float* cDl = sDl + buf * BQ;
#pragma unroll 4
    for (int ii = 0; ii < BQ; ++ii) {
      const int query = q0 + ii;
      const float s = DotRow<D>(kr, cQ + ii * D, c);
      const float dp = DotRow<D>(vr, cdO + ii * D, c);
      float p = exp2f(fmaf(s, g.scale_log2, -cL[ii] * kLog2e));
      if (query >= g.tq || (g.causal && key > query)) p = 0.f;
      const float ds = p * (dp - cDl[ii]);
      AxpyRow<D>(dv_acc, p, cdO + ii * D, c);
      AxpyRow<D>(dk_acc, ds, cQ + ii * D, c);
    }
  }
  if (valid) {
    StoreRow<D>(dk + kv_off, dk_acc, c, g.scale);
    StoreRow<D>(dv + kv_off, dv_acc, c, 1.f);
  }
}

template <int D>
__global__ void __launch_bounds__(kThreads)
AttentionBwdQF32Kernel(const float* __restrict__ q, const float* __restrict__ k,
                       const float* __restrict__ v, const float* __restrict__ dout,
                       const float* __restrict__ lse, const float* __restrict__ delta,
                       float* __restrict__ dq, Geometry g, int n_qt) {
  using C = F32Tile<D>;
  constexpr int RB = C::kRows, BN = C::kTile;
  extern __shared__ uint4 smem_q_f32[];
  float* sK = reinterpret_cast<float*>(smem_q_f32);  // [2][BN][D]
  float* sV = sK + 2 * BN * D;                       // [2][BN][D]

  int qt;
  int64_t bh;
  BlockCoords(n_qt, g.causal, &qt, &bh);
  const int q0 = qt * RB, row = q0 + threadIdx.x / C::kLanes, c = threadIdx.x % C::kLanes;
  const bool valid = row < g.tq;
  const int64_t stride = int64_t(g.heads) * D;
  const int64_t q_off = HeadOffset<D>(bh, g.tq, g.heads) + int64_t(row) * stride;
  const float* kh = k + HeadOffset<D>(bh, g.tk, g.heads);
  const float* vh = v + HeadOffset<D>(bh, g.tk, g.heads);
  const int n_kt = KeyTiles(g, q0, RB, BN);

  LoadTile<BN, D, false>(sK, kh, stride, 0, g.tk);
  LoadTile<BN, D, false>(sV, vh, stride, 0, g.tk);
  CpAsyncCommit();
  float qr[16], dor[16], dq_acc[16] = {};
  LoadRow<D>(qr, q + q_off, c, valid);
  LoadRow<D>(dor, dout + q_off, c, valid);
  const float lse2 = valid ? lse[bh * g.tq + row] * kLog2e : 0.f;
  const float dl = valid ? delta[bh * g.tq + row] : 0.f;

  for (int j = 0; j < n_kt; ++j) {
    CpAsyncWaitAll();
    __syncthreads();
    if (j + 1 < n_kt) {
      const int nb = (j + 1) & 1;
      LoadTile<BN, D, false>(sK + nb * BN * D, kh, stride, (j + 1) * BN, g.tk);
      LoadTile<BN, D, false>(sV + nb * BN * D, vh, stride, (j + 1) * BN, g.tk);
    }
    CpAsyncCommit();
    const float* cK = sK + (j & 1) * BN * D;
    const float* cV = sV + (j & 1) * BN * D;
    const int k0 = j * BN;
#pragma unroll 4
    for (int jj = 0; jj < BN; ++jj) {
      const int key = k0 + jj;
      const float s = DotRow<D>(qr, cK + jj * D, c);
      const float dp = DotRow<D>(dor, cV + jj * D, c);
      float p = exp2f(fmaf(s, g.scale_log2, -lse2));
      if (!valid || key >= g.tk || (g.causal && key > row)) p = 0.f;
      AxpyRow<D>(dq_acc, p * (dp - dl), cK + jj * D, c);
    }
  }
  if (valid) StoreRow<D>(dq + q_off, dq_acc, c, g.scale);
}

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

// A kernel that uses more than 48 KiB of dynamic shared memory must say so, once per device
// (cudaFuncSetAttribute: a host-side setting, no stream work, so it is fine while XLA
// captures a CUDA graph). One instance per kernel: a static in the kernel's launcher.
class SmemOptIn {
 public:
  cudaError_t Allow(const void* kernel, int bytes, int device) {
    if (bytes <= kDefaultSmem) return cudaSuccess;
    std::atomic<int>* done = device >= 0 && device < 64 ? &allowed_[device] : nullptr;
    if (done && done->load(std::memory_order_relaxed) >= bytes) return cudaSuccess;
    // The attribute applies to the current device; make that the one we launch on.
    int current = -1;
    cudaError_t err = cudaGetDevice(&current);
    if (err == cudaSuccess && current != device) err = cudaSetDevice(device);
    if (err == cudaSuccess)
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (current >= 0 && current != device) cudaSetDevice(current);
    if (err == cudaSuccess && done) done->store(bytes, std::memory_order_relaxed);
    return err;
  }

 private:
  std::atomic<int> allowed_[64] = {};
};

// Launches kernel<<<blocks, kThreads, smem>>>(args...) after the shared-memory opt-in.
template <typename... Params, typename... Args>
ffi::Error Launch(const char* op, void (*kernel)(Params...), SmemOptIn& opt, int64_t blocks,
                  int smem, cudaStream_t stream, int device, Args... args) {
  cudaError_t err = opt.Allow(reinterpret_cast<const void*>(kernel), smem, device);
  if (err != cudaSuccess)
    return ffi::Error::Internal(StrCat(op, ": cannot allow ", smem,
                                       " bytes of shared memory: ", cudaGetErrorString(err)));
  kernel<<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(args...);
  return LastCudaError(op);
}

template <int D>
ffi::Error LaunchFwdBf16(const char* op, cudaStream_t stream, int device, int64_t bh,
                         const void* q, const void* k, const void* v, void* out, float* lse,
                         const Geometry& g) {
  static SmemOptIn opt;
  using C = FwdBf16<D>;
  const int n_qt = (g.tq + C::kBM - 1) / C::kBM;
  return Launch(op, AttentionFwdBf16Kernel<C>, opt, n_qt * bh, C::kSmem, stream, device,
                static_cast<const bf16*>(q), static_cast<const bf16*>(k),
                static_cast<const bf16*>(v), static_cast<bf16*>(out), lse, g, n_qt);
}

template <int D>
ffi::Error LaunchFwdF32(const char* op, cudaStream_t stream, int device, int64_t bh,
                        const void* q, const void* k, const void* v, void* out, float* lse,
                        const Geometry& g) {
  static SmemOptIn opt;
  const int n_qt = (g.tq + F32Tile<D>::kRows - 1) / F32Tile<D>::kRows;
  return Launch(op, AttentionFwdF32Kernel<D>, opt, n_qt * bh, F32Tile<D>::kSmem, stream, device,
                static_cast<const float*>(q), static_cast<const float*>(k),
                static_cast<const float*>(v), static_cast<float*>(out), lse, g, n_qt);
}

struct BwdBuffers {
  const void *q, *k, *v, *out, *dout;
  const float *lse, *dlse;
  void *dq, *dk, *dv;
  float* delta;
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

template <int D>
ffi::Error LaunchBwdBf16(const char* op, cudaStream_t stream, int device, int64_t bh,
                         const BwdBuffers& b, const Geometry& g) {
  static SmemOptIn opt_kv, opt_q;
  using KV = BwdKvBf16<D>;
  using Q = BwdQBf16<D>;
  const int n_kt = (g.tk + KV::kBN - 1) / KV::kBN, n_qt = (g.tq + Q::kBM - 1) / Q::kBM;
  auto q = static_cast<const bf16*>(b.q), k = static_cast<const bf16*>(b.k);
  auto v = static_cast<const bf16*>(b.v), dout = static_cast<const bf16*>(b.dout);
  BLUJAX_RETURN_IF_ERROR(Launch(op, AttentionBwdKvBf16Kernel<D>, opt_kv, n_kt * bh, KV::kSmem,
                                stream, device, q, k, v, dout, b.lse, b.delta,
                                static_cast<bf16*>(b.dk), static_cast<bf16*>(b.dv), g, n_kt));
  return Launch(op, AttentionBwdQBf16Kernel<Q>, opt_q, n_qt * bh, Q::kSmem, stream, device, q, k,
                v, dout, b.lse, b.delta, static_cast<bf16*>(b.dq), g, n_qt);
}

template <int D>
ffi::Error LaunchBwdF32(const char* op, cudaStream_t stream, int device, int64_t bh,
                        const BwdBuffers& b, const Geometry& g) {
  static SmemOptIn opt_kv, opt_q;
  using C = F32Tile<D>;
  const int n_kt = (g.tk + C::kRows - 1) / C::kRows, n_qt = (g.tq + C::kRows - 1) / C::kRows;
  auto q = static_cast<const float*>(b.q), k = static_cast<const float*>(b.k);
  auto v = static_cast<const float*>(b.v), dout = static_cast<const float*>(b.dout);
  BLUJAX_RETURN_IF_ERROR(Launch(op, AttentionBwdKvF32Kernel<D>, opt_kv, n_kt * bh, C::kSmem,
                                stream, device, q, k, v, dout, b.lse, b.delta,
                                static_cast<float*>(b.dk), static_cast<float*>(b.dv), g, n_kt));
  return Launch(op, AttentionBwdQF32Kernel<D>, opt_q, n_qt * bh, C::kSmem, stream, device, q, k,
                v, dout, b.lse, b.delta, static_cast<float*>(b.dq), g, n_qt);
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

Geometry MakeGeometry(const AttentionDims& d, bool causal, float scale) {
  Geometry g;
  g.heads = static_cast<int>(d.heads);
  g.tq = static_cast<int>(d.q_len);
  g.tk = static_cast<int>(d.kv_len);
  g.causal = causal;
  g.scale = scale;
  g.scale_log2 = scale * kLog2e;
  return g;
}

ffi::Error AttentionFwd(cudaStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                        ffi::AnyBuffer v, ffi::Result<ffi::AnyBuffer> out,
                        ffi::Result<ffi::AnyBuffer> lse, bool causal, float scale) {
  const char* op = "blujax_attention_fwd";
  AttentionDims d;
  BLUJAX_RETURN_IF_ERROR(CheckAttentionInputs(op, q, k, v, causal, scale, /*allow_f64=*/false, &d));
  BLUJAX_RETURN_IF_ERROR(CheckSame(op, "out", *out, "q", q));
  BLUJAX_RETURN_IF_ERROR(CheckAttentionLse(op, "lse", *lse, q.element_type(), d));
  BLUJAX_RETURN_IF_ERROR(CheckGpuLimits(
      op, d, {q.untyped_data(), k.untyped_data(), v.untyped_data(), out->untyped_data()}));
  if (d.batch * d.heads == 0) return ffi::Error::Success();
  const Geometry g = MakeGeometry(d, causal, scale);
  const bool is_bf16 = q.element_type() == ffi::DataType::BF16;
  float* lse_ptr = static_cast<float*>(lse->untyped_data());
  ffi::Error result = ffi::Error::Success();
  WithHeadDim(d.head_dim, [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    auto launch = is_bf16 ? &LaunchFwdBf16<D> : &LaunchFwdF32<D>;
    result = launch(op, stream, device, d.batch * d.heads, q.untyped_data(), k.untyped_data(),
                    v.untyped_data(), out->untyped_data(), lse_ptr, g);
  });
  return result;
}

ffi::Error AttentionBwd(cudaStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                        ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer lse,
                        ffi::AnyBuffer dout, ffi::AnyBuffer dlse, ffi::Result<ffi::AnyBuffer> dq,
                        ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                        ffi::Result<ffi::AnyBuffer> delta, bool causal, float scale) {
  const char* op = "blujax_attention_bwd";
  AttentionDims d;
  BLUJAX_RETURN_IF_ERROR(CheckAttentionInputs(op, q, k, v, causal, scale, /*allow_f64=*/false, &d));
  BLUJAX_RETURN_IF_ERROR(
      CheckAttentionBwdBuffers(op, q, k, v, out, lse, dout, dlse, *dq, *dk, *dv, *delta, d));
  BLUJAX_RETURN_IF_ERROR(CheckGpuLimits(
      op, d, {q.untyped_data(), k.untyped_data(), v.untyped_data(), out.untyped_data(),
              dout.untyped_data(), dq->untyped_data(), dk->untyped_data(), dv->untyped_data()}));
  if (d.batch * d.heads == 0) return ffi::Error::Success();
  const Geometry g = MakeGeometry(d, causal, scale);
  BwdBuffers b{q.untyped_data(), k.untyped_data(), v.untyped_data(), out.untyped_data(),
               dout.untyped_data(), static_cast<const float*>(lse.untyped_data()),
               static_cast<const float*>(dlse.untyped_data()), dq->untyped_data(),
               dk->untyped_data(), dv->untyped_data(), static_cast<float*>(delta->untyped_data())};
  const bool is_bf16 = q.element_type() == ffi::DataType::BF16;
  ffi::Error result = ffi::Error::Success();
  WithHeadDim(d.head_dim, [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    result = is_bf16 ? LaunchDelta<bf16, D>(op, stream, b, d)
                     : LaunchDelta<float, D>(op, stream, b, d);
    if (!result.failure()) {
      auto launch = is_bf16 ? &LaunchBwdBf16<D> : &LaunchBwdF32<D>;
      result = launch(op, stream, device, d.batch * d.heads, b, g);
    }
  });
  return result;
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kAttentionFwd, AttentionFwd,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Ctx<Device>()
                           .Arg<ffi::AnyBuffer>()   // q [B, Tq, H, D]
                           .Arg<ffi::AnyBuffer>()   // k [B, Tk, H, D]
                           .Arg<ffi::AnyBuffer>()   // v [B, Tk, H, D]
                           .Ret<ffi::AnyBuffer>()   // out [B, Tq, H, D]
                           .Ret<ffi::AnyBuffer>()   // lse [B, H, Tq] f32
                           .Attr<bool>("causal")
                           .Attr<float>("scale"),
                       kGraphSafe);

XLA_FFI_DEFINE_HANDLER(kAttentionBwd, AttentionBwd,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Ctx<Device>()
                           .Arg<ffi::AnyBuffer>()   // q [B, Tq, H, D]
                           .Arg<ffi::AnyBuffer>()   // k [B, Tk, H, D]
                           .Arg<ffi::AnyBuffer>()   // v [B, Tk, H, D]
                           .Arg<ffi::AnyBuffer>()   // out [B, Tq, H, D]
                           .Arg<ffi::AnyBuffer>()   // lse [B, H, Tq]
                           .Arg<ffi::AnyBuffer>()   // dout [B, Tq, H, D]
                           .Arg<ffi::AnyBuffer>()   // dlse [B, H, Tq], cotangent of lse
                           .Ret<ffi::AnyBuffer>()   // dq [B, Tq, H, D]
                           .Ret<ffi::AnyBuffer>()   // dk [B, Tk, H, D]
                           .Ret<ffi::AnyBuffer>()   // dv [B, Tk, H, D]
                           .Ret<ffi::AnyBuffer>()   // delta [B, H, Tq] f32, scratch
                           .Attr<bool>("causal")
                           .Attr<float>("scale"),
                       kGraphSafe);

BLUJAX_REGISTER(blujax_attention_fwd, kAttentionFwd);
BLUJAX_REGISTER(blujax_attention_bwd, kAttentionBwd);

}  // namespace blujax
