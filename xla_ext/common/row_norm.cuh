// What the two row normalizations (LayerNorm, RMSNorm) share on the GPU: how their kernels are
// shaped and launched (a group of threads per row, its block, the registers a thread keeps, the
// launch-time choice of the group, as many blocks as fit at once), and the backward's machinery
// (the register-path backward body, the partial rows of the weight gradients it leaves per
// block, and the kernel that sums them), templated on what differs between the two: the mean
// term (an op's Term: LayerNormTerm in cuda/layernorm_bwd.cuh, RmsNormTerm in
// cuda/rms_norm_bwd.cuh). Each op's kernels (named for the op), launchers and handlers stay in
// its own files (cuda/layernorm*, cuda/rms_norm*).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "common/cuda_launch.cuh"
#include "common/cuda_util.cuh"

namespace blujax {
namespace {

// Forward: threads per block, unless one row's group is wider.
constexpr int kBlock = 256;

template <int kGroup> __host__ __device__ constexpr int BlockFor() {
  return kGroup > kBlock ? kGroup : kBlock;
}

constexpr int kFwdFloats = 32;  // row elements a thread keeps in registers, forward

// Backward: groups share a block of at least 512 threads, so a multiprocessor holds one or two
// blocks and leaves as many partial rows of the weight gradients, not four or more (fewer to
// write and to sum: measured faster for narrow groups).
template <int kGroup> __host__ __device__ constexpr int BwdBlockFor() {
  return kGroup < 512 ? 512 : kGroup;
}
// Elements of dy (and of x) a backward thread keeps in registers: 16, in twice as many threads
// as 32 would need, each held to 64 registers so that 1024 threads fit a multiprocessor (32 and
// ~125 registers were latency-bound). bfloat16 fits the bound only with its packs kept whole.
constexpr int kBwdFloats = 16;
template <typename T> __host__ __device__ constexpr int BwdVecs() {
  return kBwdFloats / Pack<T>::kSize;
}
// Blocks a multiprocessor must hold, promised through __launch_bounds__.
template <int kThreads> __host__ __device__ constexpr int BwdMinBlocks() {
  return kThreads < 1024 ? 1024 / kThreads : 1;
}

// Dynamic shared memory a launch takes without opting in to more: the default, less room for
// the kernels' static shared memory.
constexpr int kMaxSharedBytes = kDefaultSharedBytes - (2 << 10);

// ----------------------------------------------------------------------------------------------
// The backward's device code.

// Backward, register path, the body of an op's kernel (LayerNormBwdKernel, RmsNormBwdKernel): a
// group of kGroup threads takes a row at a time, holding its dy and x packs in registers. A
// thread's columns are the same for every row, so it adds its share of dweight (and, where the
// op has a bias, dbias; with kXBias also dx_bias) into its group's own slice of shared memory
// without atomics; at the end the block sums its groups' slices into its partial row
// ws[blockIdx.x]: kPlanes rows of C floats (dweight, dbias, dx_bias).
// Term is the op's mean term: Term::Mean loads a row's mean (0 for RMSNorm); a Term made from it
// sums what the row's dx needs, reduces the sums over the group, and gives xhat and dx (before
// dsum) from them. kHoldW keeps the weight of a thread's columns, the same for every row, in
// registers instead of reading it again in both loops of every row. dx += dsum (the add
// variants) with kAdd, and otherwise where dsum is not null (so one kernel may serve both).
template <typename Term, typename T, int kGroup, int kVecs, int kThreads, bool kXBias,
          bool kHoldW, bool kAdd>
__device__ __forceinline__ void RowNormBwdRows(const T* __restrict__ dy,
                                               const T* __restrict__ dsum,
                                               const T* __restrict__ x,
                                               const T* __restrict__ weight,
                                               const float* __restrict__ mean,
                                               const float* __restrict__ rstd,
                                               T* __restrict__ dx, float* __restrict__ ws,
                                               int64_t rows, int cols) {
  constexpr int kPack = Pack<T>::kSize;
  constexpr int kGroups = kThreads / kGroup;
  static_assert(Term::kBias || !kXBias, "dx_bias is the plane after dbias");
  constexpr int kPlanes = Term::kBias ? (kXBias ? 3 : 2) : 1;
  __shared__ float red[2 * kThreads / 32];
  // Per group: dweight (then dbias, then dx_bias), each stored as [chunk][pack][4] with chunk =
  // a float4 of a pack (bfloat16 packs hold two), so the float4s a warp updates together are
  // consecutive and free of bank conflicts.
  extern __shared__ float4 acc4[];
  constexpr int kChunks = kPack / 4;
  const int lane = threadIdx.x % kGroup, group = threadIdx.x / kGroup;
  const int packs = cols / kPack;
  const float inv_cols = 1.f / cols;
  float4* dw_acc = acc4 + int64_t(group) * kPlanes * (cols / 4);
  float4* db_acc = dw_acc + cols / 4;   // Term::kBias only
  float4* dxb_acc = db_acc + cols / 4;  // kXBias only
  // Each thread zeroes exactly the float4s it accumulates, so no barrier is needed yet.
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int p = lane + i * kGroup;
    if (p < packs) {
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        if constexpr (Term::kBias) db_acc[c * packs + p] = float4{};
        dw_acc[c * packs + p] = float4{};
        if constexpr (kXBias) dxb_acc[c * packs + p] = float4{};
      }
    }
  }

  Pack<T> held_w[kHoldW ? kVecs : 1];
  if constexpr (kHoldW) {
#pragma unroll
    for (int i = 0; i < kVecs; ++i)
      if (lane + i * kGroup < packs) held_w[i] = LoadPack(weight + (lane + i * kGroup) * kPack);
  }
  auto weight_pack = [&](int i, int p) {
    if constexpr (kHoldW) return held_w[i];
    else return LoadPack(weight + p * kPack);
  };

  // Rows of several groups a block read dy and x through the read-only path, measured faster
  // there than loads without L1 allocation. A row a block (C > 4096) keeps the loads without
  // L1 allocation, which were the faster when C = 3072 and 4096 took a block a row; C > 4096
  // itself is not measured.
  auto load_row = [](const T* p) {
    if constexpr (kGroups > 1) return LoadPack(p);
    else return LoadPackNoL1(p);
  };

  for (int64_t base = int64_t(blockIdx.x) * kGroups; base < rows;
       base += int64_t(gridDim.x) * kGroups) {
    const int64_t row = base + group;
    const bool valid = row < rows;
    const float m = Term::Mean(mean, row, valid), rs = valid ? rstd[row] : 0.f;
    Pack<T> d[kVecs], a[kVecs];
    Term term(m);
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
        const Pack<T> w = weight_pack(i, p);
#pragma unroll
        for (int k = 0; k < kPack; ++k)
          term.Add(PackElem(d[i], k) * PackElem(w, k), PackElem(a[i], k));
      }
    }
    term.template Reduce<kGroup, kThreads>(red, rs, inv_cols);
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int p = lane + i * kGroup;
      if (valid && p < packs) {
        const int64_t off = row * cols + int64_t(p) * kPack;
        const Pack<T> w = weight_pack(i, p);
        Pack<T> ds;
        if (kAdd || dsum) ds = LoadPackNoL1(dsum + off);
        float o[kPack], dwv[kPack], dbv[kPack];
#pragma unroll
        for (int k = 0; k < kPack; ++k) {
          const float dd = PackElem(d[i], k), xhat = term.Xhat(PackElem(a[i], k), rs);
          o[k] = term.Dx(dd * PackElem(w, k), xhat, rs);
          if (kAdd || dsum) o[k] += PackElem(ds, k);
          dwv[k] = dd * xhat;
          dbv[k] = dd;  // Term::kBias only
        }
        StorePackNoL1(dx + off, PackFromFloats<T>(o));
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
          float4& w4 = dw_acc[c * packs + p];
          w4 = float4{w4.x + dwv[4 * c], w4.y + dwv[4 * c + 1], w4.z + dwv[4 * c + 2],
                      w4.w + dwv[4 * c + 3]};
          if constexpr (Term::kBias) {
            float4& b4 = db_acc[c * packs + p];
            b4 = float4{b4.x + dbv[4 * c], b4.y + dbv[4 * c + 1], b4.z + dbv[4 * c + 2],
                        b4.w + dbv[4 * c + 3]};
          }
          if constexpr (kXBias) {  // dx_bias before rounding, as dweight and dbias
            float4& x4 = dxb_acc[c * packs + p];
            x4 = float4{x4.x + o[4 * c], x4.y + o[4 * c + 1], x4.z + o[4 * c + 2],
                        x4.w + o[4 * c + 3]};
          }
        }
      }
    }
  }

  __syncthreads();
  const float* acc = reinterpret_cast<const float*>(acc4);
  float* part = ws + int64_t(blockIdx.x) * kPlanes * cols;
  for (int j = threadIdx.x; j < kPlanes * cols; j += kThreads) {
    // Column col of dweight (j < cols), dbias or dx_bias sits at [chunk][pack][lane of float4].
    const int which = kPlanes == 1 || j < cols ? 0 : (kXBias && j >= 2 * cols) ? 2 : 1;
    const int col = j - which * cols;
    const int p = col / kPack, r = col % kPack;
    const int at = which * cols + ((r / 4) * packs + p) * 4 + r % 4;
    float total = 0.f;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) total += acc[int64_t(g) * kPlanes * cols + at];
    part[j] = total;
  }
}

// The body of an op's ReducePartials kernel: dweight[c] = the sum over blocks of ws[b, 0, c], in
// a fixed order (so the weight gradients are deterministic); dbias likewise from ws[b, 1, c]
// (kPlanes >= 2) and dx_bias from ws[b, 2, c] (kPlanes 3). There are only kPlanes * C / 32
// blocks, so each thread keeps several independent loads in flight rather than waiting on one
// partial row at a time.
constexpr int kReduceX = 32, kReduceY = 32, kReduceUnroll = 8;
template <typename T, int kPlanes>
__device__ __forceinline__ void ReducePartialRows(const float* __restrict__ ws, int partials,
                                                  int cols, T* __restrict__ dweight,
                                                  T* __restrict__ dbias,
                                                  T* __restrict__ dx_bias) {
  __shared__ float tile[kReduceY][kReduceX + 1];
  const int j = blockIdx.x * kReduceX + threadIdx.x;  // over kPlanes * cols
  const int64_t stride = kPlanes * int64_t(cols);
  // Column j of partial row p. (One plane is indexed as RMSNorm's own kernel did: the same
  // address, and the code it had.)
  auto partial = [&](int p) {
    if constexpr (kPlanes == 1) return ws[int64_t(p) * cols + j];
    else return ws[p * stride + j];
  };
  float acc[kReduceUnroll] = {};
  if (j < kPlanes * cols) {
    int p = threadIdx.y;
    for (; p + (kReduceUnroll - 1) * kReduceY < partials; p += kReduceUnroll * kReduceY) {
#pragma unroll
      for (int u = 0; u < kReduceUnroll; ++u) acc[u] += partial(p + u * kReduceY);
    }
    for (; p < partials; p += kReduceY) acc[0] += partial(p);
  }
  float s = 0.f;
#pragma unroll
  for (int u = 0; u < kReduceUnroll; ++u) s += acc[u];
  tile[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && j < kPlanes * cols) {
    for (int r = 1; r < kReduceY; ++r) s += tile[r][threadIdx.x];
    if (kPlanes == 1 || j < cols) dweight[j] = FromFloat<T>(s);
    else if (kPlanes == 2 || j < 2 * cols) dbias[j - cols] = FromFloat<T>(s);
    else dx_bias[j - 2 * cols] = FromFloat<T>(s);
  }
}

// ----------------------------------------------------------------------------------------------
// Launch-time choices and launches.

// The narrowest group whose threads hold a row of `packs` packs, `vecs` a thread; 0 when even
// 1024 threads cannot.
inline int GroupFor(int packs, int vecs) {
  for (int g = 32; g <= 1024; g *= 2)
    if (int64_t(g) * vecs >= packs) return g;
  return 0;
}

// Blocks of a kernel that fit on one multiprocessor (at least 1).
template <typename Kernel>
int BlocksPerSm(Kernel kernel, int threads, size_t smem) {
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem) != cudaSuccess) {
    cudaGetLastError();  // a sizing query only: clear it and fall back to one block
    n = 1;
  }
  return n < 1 ? 1 : n;
}

// f(std::integral_constant<int, group>) for a group GroupFor chose: the kernels take it as a
// template argument.
template <typename F>
void WithGroup(int group, F&& f) {
  switch (group) {
    case 32: f(std::integral_constant<int, 32>{}); break;
    case 64: f(std::integral_constant<int, 64>{}); break;
    case 128: f(std::integral_constant<int, 128>{}); break;
    case 256: f(std::integral_constant<int, 256>{}); break;
    case 512: f(std::integral_constant<int, 512>{}); break;
    default: f(std::integral_constant<int, 1024>{}); break;
  }
}

// Blocks of `kernel` that the device holds at once: the grid of a kernel whose blocks loop over
// their share of the rows.
template <typename Kernel>
int64_t ResidentBlocks(int device, Kernel kernel, int threads, size_t smem) {
  return int64_t(SmCount(device)) * BlocksPerSm(kernel, threads, smem);
}

// The forward's launch for either norm: kernel_for(std::integral_constant<int, kGroup>) (the
// register path, a group of kGroup threads a row, BlockFor<kGroup>() threads a block) where
// GroupFor found a group, else `any` (a block a row); as many blocks as fit on the device at
// once, no more than the rows need. (A block per kGroups rows, each passing once, as the GELU
// forward does, measured about the same.)
template <typename KernelFor, typename AnyKernel, typename... Args>
void LaunchFwdRows(cudaStream_t stream, int device, int group, int64_t rows,
                   KernelFor kernel_for, AnyKernel any, Args... args) {
  auto launch = [&](auto kernel, int64_t rows_per_block, int threads) {
    const int64_t blocks = std::min((rows + rows_per_block - 1) / rows_per_block,
                                    ResidentBlocks(device, kernel, threads, 0));
    kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(args...);
  };
  if (group) {
    WithGroup(group, [&](auto g) {
      constexpr int kGroup = decltype(g)::value, kThreads = BlockFor<kGroup>();
      launch(kernel_for(g), kThreads / kGroup, kThreads);
    });
  } else {
    launch(any, 1, kBlock);
  }
}

// A backward kernel's launch: as many blocks as fit on the device at once (each leaves one
// partial row of the weight gradients), no more than the workspace holds (partials) or the
// rows need (rows_per_block a pass). Returns the blocks launched: the partial rows to sum.
template <typename Kernel, typename... Args>
int64_t LaunchBwdBlocks(cudaStream_t stream, int device, Kernel kernel, int64_t rows_per_block,
                        int threads, size_t smem, int64_t rows, int64_t partials, Args... args) {
  const int64_t blocks =
      std::max<int64_t>(1, std::min({partials, ResidentBlocks(device, kernel, threads, smem),
                                     (rows + rows_per_block - 1) / rows_per_block}));
  kernel<<<static_cast<unsigned>(blocks), threads, smem, stream>>>(args...);
  return blocks;
}

// The backward's kernel for either norm, given the op's kernels for one dtype and variant:
//   Kernels::template Register<kGroup>() the register path (RowNormBwdRows), kGroup threads a row
//   Kernels::kAny                        a block a row, any shape
//   Kernels::kPlanes                     partial rows a block leaves (dweight, dbias, ...)
// The register path where GroupFor found a group (group != 0) and its groups' sums fit in
// shared memory, else the block-per-row path: run(kernel, rows_per_block, threads, smem)
// launches the one chosen (LaunchBwdBlocks with the op's arguments).
template <typename Kernels, typename Run>
void LaunchBwdRows(int device, int group, int cols, Run&& run) {
  bool launched = false;
  if (group) {
    WithGroup(group, [&](auto g) {
      constexpr int kGroup = decltype(g)::value, kThreads = BwdBlockFor<kGroup>();
      constexpr int kGroups = kThreads / kGroup;
      constexpr auto kKernel = Kernels::template Register<kGroup>();
      const size_t smem = size_t(kGroups) * Kernels::kPlanes * cols * sizeof(float);
      if (smem <= kMaxSharedBytes || smem <= SharedMemoryLimit<kKernel>(device)) {
        run(kKernel, kGroups, kThreads, smem);
        launched = true;
      }
    });
  }
  if (!launched) run(Kernels::kAny, 1, kBlock, 0);
}

// An op's ReducePartials kernel over the blocks' partial rows, `planes` rows of C columns each.
template <typename Kernel, typename... Args>
void LaunchReducePartials(cudaStream_t stream, Kernel kernel, int planes, int cols,
                          Args... args) {
  const dim3 threads(kReduceX, kReduceY);
  const unsigned grid = static_cast<unsigned>((planes * cols + kReduceX - 1) / kReduceX);
  kernel<<<grid, threads, 0, stream>>>(args...);
}

}  // namespace
}  // namespace blujax
