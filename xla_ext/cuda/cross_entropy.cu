// Softmax cross-entropy on the GPU (float32 and bfloat16 logits, float32 arithmetic); the CPU
// twin is xla_ext/cpu/cross_entropy.cc and the handler contract common/cross_entropy.h.
//
// Memory-bound on the logits ([N, V] with V ~ 50k), so the design is about passes over them:
// the forward reads each row once, keeping a running (max, sum of exps) per thread that is
// rescaled once per batch of up to 32 values (an online softmax: one exp per element, not
// two); the backward reads each row once and writes dlogits in the same pass, possibly into
// the same buffer. A long row belongs to a block of kRowThreads threads, a short one to a warp.
// Rows are streamed in 16-byte packs from the first 16-byte boundary inside the row, with the
// few elements before it (head) and after the last whole pack (tail) read one by one, so every
// V and every row alignment (V = 50257 leaves bfloat16 rows at 8 different alignments) takes
// the vectorised path.
//
// blujax_cross_entropy_loss_grad (the mean loss under differentiation) fuses the two: its
// cotangent is known up front, so one kernel writes each row's loss and dlogits and the logits
// are read from memory once. A long row belongs to one block, which copies it into shared
// memory with cp.async (all of a thread's 16-byte packs in flight at once), takes the max and
// sum of exps from there, and writes dlogits from there with streaming stores. Each thread
// reads back only the packs it copied, so the cache needs no barrier. Rows that do not fit in
// the block's shared memory (float32 V = 50k on an A100) read the row again from global
// memory in the second pass, where it mostly hits L2; short rows go to a warp, as above.

#include <algorithm>
#include <cfloat>

#include "common/cross_entropy.h"
#include "common/cuda_launch.cuh"
#include "common/cuda_util.cuh"
#include "common/registry.h"

namespace blujax {
namespace {

constexpr int kRowThreads = 512;  // threads that share one long row
constexpr int kWarpRowBytes = 16 << 10;  // rows up to this size go to a single warp
constexpr int kBlock = 256;       // threads per block when warps take rows
constexpr int kUnroll = 4;        // 16-byte packs each thread has in flight per step
constexpr float kLog2e = 1.4426950408889634f;

template <int kGroup> __host__ __device__ constexpr int BlockFor() {
  return kGroup > kBlock ? kGroup : kBlock;
}

// Where a row's 16-byte packs start and end: head scalars, then packs, then tail scalars.
struct RowSplit {
  int head;
  int packs;
  int tail;
};

template <typename T>
__device__ __forceinline__ RowSplit SplitRow(const T* row, int vocab) {
  constexpr int kPack = Pack<T>::kSize;
  const int misalign = static_cast<int>(reinterpret_cast<uintptr_t>(row) % 16);
  const int head = min(vocab, misalign ? (16 - misalign) / static_cast<int>(sizeof(T)) : 0);
  const int packs = (vocab - head) / kPack;
  return {head, packs, vocab - head - packs * kPack};
}

// 16 bytes of logits as loaded, converted to float element by element where used (the
// packs in flight stay 4 registers each, also for bfloat16).
template <typename T>
struct RawPack {
  uint32_t w[4];
  // k is a compile-time constant wherever this is called (unrolled loops).
  __device__ __forceinline__ float operator[](int k) const {
    if constexpr (sizeof(T) == 4) return __uint_as_float(w[k]);
    return Bf16OfWord(w[k / 2], k);
  }
};

// A plain (coherent) load, not __ldg: the backward may write the same addresses.
template <typename T>
__device__ __forceinline__ RawPack<T> LoadRaw(const T* p) {
  const uint4 v = *reinterpret_cast<const uint4*>(p);
  return {{v.x, v.y, v.z, v.w}};
}

// Stands in for a pack beyond the row: every element -inf, which adds exp(-inf) = 0.
template <typename T>
__device__ __forceinline__ RawPack<T> NegInfPack() {
  constexpr uint32_t w = sizeof(T) == 4 ? 0xff800000u : 0xff80ff80u;
  return {{w, w, w, w}};
}

// kStream: an evict-first store, for output nothing reads soon (dlogits of the fused kernel,
// which also leaves L2 to the logits it may read again).
template <typename T, bool kStream = false>
__device__ __forceinline__ void StoreFloats(T* p, const float (&v)[Pack<T>::kSize]) {
  const Pack<T> out = PackFromFloats<T>(v);
  const uint4 raw = *reinterpret_cast<const uint4*>(&out);
  // one 16-byte store (a plain assignment is split)
  if constexpr (kStream) __stcs(reinterpret_cast<uint4*>(p), raw);
  else __stwb(reinterpret_cast<uint4*>(p), raw);
}

// Running (max m, sum of exp(x - m)). m starts at -FLT_MAX rather than -inf so that -inf
// logits (masked classes) add exp(-inf) = 0 instead of exp(-inf + inf) = NaN.
struct MaxSum {
  float m = -FLT_MAX;
  float s = 0.f;

  // Adds the batch value(0), ..., value(kCount - 1) with one rescale of the running sum.
  template <int kCount, typename Value>
  __device__ __forceinline__ void Add(Value value) {
    float bm = value(0);
#pragma unroll
    for (int k = 1; k < kCount; ++k) bm = fmaxf(bm, value(k));
    const float nm = fmaxf(m, bm);  // fmaxf drops NaN; a NaN logit makes the sum NaN below
    // Differences first: nm * log2(e) would overflow to -inf while nm is still -FLT_MAX.
    float add = 0.f;
#pragma unroll
    for (int k = 0; k < kCount; ++k) add += exp2f((value(k) - nm) * kLog2e);
    s = s * exp2f((m - nm) * kLog2e) + add;
    m = nm;
  }

  __device__ __forceinline__ void Merge(float om, float os) {
    const float nm = fmaxf(m, om);
    s = s * exp2f((m - nm) * kLog2e) + os * exp2f((om - nm) * kLog2e);
    m = nm;
  }
};

// Combines the MaxSum of the kGroup threads that share a row; all of them get the result.
// Groups wider than a warp meet in shared memory `red` (2 * kGroup / 32 floats), so all
// threads of the block must call this together.
template <int kGroup>
__device__ __forceinline__ void GroupMaxSum(MaxSum& a, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2)
    a.Merge(__shfl_xor_sync(0xffffffffu, a.m, o), __shfl_xor_sync(0xffffffffu, a.s, o));
  if constexpr (kGroup > 32) {
    static_assert(BlockFor<kGroup>() == kGroup, "a wide group is the whole block");
    constexpr int kWarps = kGroup / 32;
    const int warp = threadIdx.x / 32;
    if (threadIdx.x % 32 == 0) {
      red[2 * warp] = a.m;
      red[2 * warp + 1] = a.s;
    }
    __syncthreads();
    MaxSum all;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) all.Merge(red[2 * w], red[2 * w + 1]);
    a = all;
    __syncthreads();  // red is reused for the next row
  }
}

// The MaxSum of the `lane`-th share of one row.
template <typename T, int kGroup>
__device__ __forceinline__ MaxSum RowMaxSum(const T* row, int vocab, int lane) {
  constexpr int kPack = Pack<T>::kSize;
  const RowSplit split = SplitRow(row, vocab);
  const T* body = row + split.head;
  MaxSum acc;
  for (int p0 = lane; p0 < split.packs; p0 += kUnroll * kGroup) {
    RawPack<T> raw[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int p = p0 + u * kGroup;
      raw[u] = p < split.packs ? LoadRaw(body + int64_t(p) * kPack) : NegInfPack<T>();
    }
    acc.Add<kUnroll * kPack>([&](int k) { return raw[k / kPack][k % kPack]; });
  }
  // head and tail have fewer than kPack <= 32 elements each: one per lane.
  const float edge[2] = {
      lane < split.head ? ToFloat(row[lane]) : -INFINITY,
      lane < split.tail ? ToFloat(body[int64_t(split.packs) * kPack + lane]) : -INFINITY};
  acc.Add<2>([&](int k) { return edge[k]; });
  return acc;
}

struct FwdArgs {
  const int32_t* targets;
  const int32_t* vocab_start;  // stats only
  int64_t rows_per_start;
  float* out0;  // loss | row_max
  float* out1;  // lse | sum_exp
  float* out2;  // target_logit (stats only)
  int64_t rows;
  int vocab;
  int64_t ignore_index;
  int64_t num_classes;
};

// This row's count of leading columns that are classes (common/cross_entropy.h).
__device__ __forceinline__ int RowColumns(int64_t num_classes, const int32_t* vocab_start,
                                          int64_t rows_per_start, int64_t r, int vocab) {
  const int64_t start = vocab_start ? vocab_start[r / rows_per_start] : 0;
  const int64_t n = num_classes - start;
  return static_cast<int>(n < 0 ? 0 : (n > vocab ? vocab : n));
}

// kStats = false: blujax_cross_entropy_fwd (loss, lse); true: blujax_cross_entropy_stats.
template <typename T, int kGroup, bool kStats>
__global__ void __launch_bounds__(BlockFor<kGroup>())
CrossEntropyFwdKernel(const T* __restrict__ logits, FwdArgs a) {
  constexpr int kGroups = BlockFor<kGroup>() / kGroup;
  __shared__ float red[2 * BlockFor<kGroup>() / 32];
  const int lane = threadIdx.x % kGroup, group = threadIdx.x / kGroup;
  // The loop bound is the same for the whole block, so wide groups may synchronise in it (a
  // wide group is the whole block, so its rows and branches are uniform too).
  for (int64_t base = int64_t(blockIdx.x) * kGroups; base < a.rows;
       base += int64_t(gridDim.x) * kGroups) {
    const int64_t r = base + group;
    if (r >= a.rows) continue;  // only in warp-per-row blocks, which never synchronise
    const T* row = logits + r * a.vocab;
    const int64_t target = a.targets[r];
    const int cols = RowColumns(a.num_classes, a.vocab_start, a.rows_per_start, r, a.vocab);
    if constexpr (!kStats) {
      // Ignored rows have no loss and no gradient, so they are not read; unknown targets NaN.
      const bool ignored = target == a.ignore_index;
      if (ignored || target < 0 || target >= cols) {
        if (lane == 0) {
          a.out0[r] = ignored ? 0.f : NAN;
          a.out1[r] = ignored ? 0.f : NAN;
        }
        continue;
      }
    }
    MaxSum acc = RowMaxSum<T, kGroup>(row, cols, lane);
    GroupMaxSum<kGroup>(acc, red);
    if (lane == 0) {
      if constexpr (kStats) {
        const int64_t local = target - a.vocab_start[r / a.rows_per_start];
        a.out0[r] = acc.m;
        a.out1[r] = acc.s;
        a.out2[r] = local >= 0 && local < cols ? ToFloat(row[local]) : 0.f;
      } else {
        const float lse = acc.m + __logf(acc.s);
        a.out0[r] = lse - ToFloat(row[target]);
        a.out1[r] = lse;
      }
    }
  }
}

struct BwdArgs {
  const int32_t* targets;
  const float* lse;
  const float* g;
  const int32_t* vocab_start;
  int64_t rows_per_start;
  int64_t rows;
  int vocab;
  int64_t ignore_index;
  int64_t num_classes;
};

// dlogits = (exp(x - lse) - [c == target]) * g, one read and one write per element. `logits`
// and `dlogits` may be the same buffer (no __restrict__): each step loads its packs before it
// stores any, and no element is read after it is written.
template <typename T, int kGroup>
__global__ void __launch_bounds__(BlockFor<kGroup>())
CrossEntropyBwdKernel(const T* logits, T* dlogits, BwdArgs a) {
  constexpr int kPack = Pack<T>::kSize;
  constexpr int kGroups = BlockFor<kGroup>() / kGroup;
  const int lane = threadIdx.x % kGroup, group = threadIdx.x / kGroup;
  for (int64_t base = int64_t(blockIdx.x) * kGroups; base < a.rows;
       base += int64_t(gridDim.x) * kGroups) {
    const int64_t r = base + group;
    if (r >= a.rows) continue;
    const int64_t off = r * a.vocab;
    const RowSplit split = SplitRow(logits + off, a.vocab);
    const T* in = logits + off + split.head;
    T* out = dlogits + off + split.head;
    const int64_t target = a.targets[r];
    if (target == a.ignore_index) {  // no gradient: zeros, without reading the row
      const float zero[kPack] = {};
      for (int p = lane; p < split.packs; p += kGroup) StoreFloats(out + int64_t(p) * kPack, zero);
      if (lane < split.head) dlogits[off + lane] = FromFloat<T>(0.f);
      if (lane < split.tail) out[split.packs * kPack + lane] = FromFloat<T>(0.f);
      continue;
    }
    // The target's column relative to the first pack; INT_MIN (no column) when the target is
    // not in this row's slice of the vocabulary.
    const int64_t local = target - a.vocab_start[r / a.rows_per_start];
    const int cols = RowColumns(a.num_classes, a.vocab_start, a.rows_per_start, r, a.vocab);
    const int col = local >= 0 && local < cols ? static_cast<int>(local) - split.head : INT_MIN;
    // Columns from `end` on (relative to the first pack, as c is) are not classes: zero.
    const int end = cols - split.head;
    const float g = a.g[r], lse = a.lse[r];
    auto grad = [&](float x, int c) {
      return c < end ? (exp2f((x - lse) * kLog2e) - (c == col ? 1.f : 0.f)) * g : 0.f;
    };
    for (int p0 = lane; p0 < split.packs; p0 += kUnroll * kGroup) {
      RawPack<T> raw[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int p = p0 + u * kGroup;
        if (p < split.packs) raw[u] = LoadRaw(in + int64_t(p) * kPack);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int p = p0 + u * kGroup;
        if (p < split.packs) {
          float d[kPack];
#pragma unroll
          for (int k = 0; k < kPack; ++k) d[k] = grad(raw[u][k], p * kPack + k);
          StoreFloats(out + int64_t(p) * kPack, d);
        }
      }
    }
    if (lane < split.head) {
      const float x = ToFloat(logits[off + lane]);
      dlogits[off + lane] = FromFloat<T>(grad(x, lane - split.head));
    }
    if (lane < split.tail) {
      const int c = split.packs * kPack + lane;
      const float x = ToFloat(in[c]);
      out[c] = FromFloat<T>(grad(x, c));
    }
  }
}

// ----------------------------------------------------------------------------------------------
// Loss and gradient of a row in one kernel (blujax_cross_entropy_loss_grad).

// Loads pack p of a row from the row itself; `body` is where its packs start (after the head).
struct GlobalPacks {
  template <typename T>
  __device__ __forceinline__ RawPack<T> operator()(const T* body, int p) const {
    return LoadRaw(body + int64_t(p) * Pack<T>::kSize);
  }
};

// RowMaxSum with the packs from pack_at(body, p) and kSteps of them per thread per step. (The
// forward keeps its own copy: sharing this one changed its register allocation.)
template <typename T, int kGroup, int kSteps, typename PackAt>
__device__ __forceinline__ MaxSum RowMaxSumFrom(const T* row, int vocab, int lane,
                                                PackAt pack_at) {
  constexpr int kPack = Pack<T>::kSize;
  const RowSplit split = SplitRow(row, vocab);
  const T* body = row + split.head;
  MaxSum acc;
  for (int p0 = lane; p0 < split.packs; p0 += kSteps * kGroup) {
    RawPack<T> raw[kSteps];
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      const int p = p0 + u * kGroup;
      raw[u] = p < split.packs ? pack_at(body, p) : NegInfPack<T>();
    }
    acc.Add<kSteps * kPack>([&](int k) { return raw[k / kPack][k % kPack]; });
  }
  // head and tail have fewer than kPack <= 32 elements each: one per lane.
  const float edge[2] = {
      lane < split.head ? ToFloat(row[lane]) : -INFINITY,
      lane < split.tail ? ToFloat(body[int64_t(split.packs) * kPack + lane]) : -INFINITY};
  acc.Add<2>([&](int k) { return edge[k]; });
  return acc;
}

struct LossGradArgs {
  const int32_t* targets;
  const float* scale;
  int64_t rows_per_scale;
  float* loss;
  int64_t rows;
  int vocab;
  int64_t ignore_index;
  int64_t num_classes;
};

// Writes a row of dlogits: value(x, c) for each element, x its logit (unused by value where the
// row was not read) and c its column relative to the first pack (negative in the head), as
// CrossEntropyBwdKernel does. pack_at(body, p) gives the p-th pack of logits, body = in + head.
template <typename T, int kGroup, int kSteps, typename PackAt, typename Value>
__device__ __forceinline__ void WriteRowGrad(const T* in, T* out, RowSplit split, int lane,
                                             PackAt pack_at, Value value) {
  constexpr int kPack = Pack<T>::kSize;
  const T* in_body = in + split.head;
  T* body = out + split.head;
  for (int p0 = lane; p0 < split.packs; p0 += kSteps * kGroup) {
    RawPack<T> raw[kSteps];
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      const int p = p0 + u * kGroup;
      if (p < split.packs) raw[u] = pack_at(in_body, p);
    }
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      const int p = p0 + u * kGroup;
      if (p < split.packs) {
        float d[kPack];
#pragma unroll
        for (int k = 0; k < kPack; ++k) d[k] = value(raw[u][k], p * kPack + k);
        StoreFloats<T, /*kStream=*/true>(body + int64_t(p) * kPack, d);
      }
    }
  }
  if (lane < split.head) out[lane] = FromFloat<T>(value(ToFloat(in[lane]), lane - split.head));
  if (lane < split.tail) {
    const int c = split.packs * kPack + lane;
    body[c] = FromFloat<T>(value(ToFloat(in_body[c]), c));
  }
}

// loss = lse - x[target] and dlogits = (exp(x - lse) - [c == target]) * scale per row, the
// row read from memory once with kCache (into shared memory; a whole block per row), twice
// otherwise. logits and dlogits may be the same buffer: the first pass only reads, its values
// meet in the group's reduction before any thread writes, and in the second pass each thread
// reads a pack (or element) before it writes it, and no other thread touches it. That is also
// why the loss is written by the thread that meets the target column in the second pass.
template <typename T, int kGroup, bool kCache>
__global__ void __launch_bounds__(BlockFor<kGroup>(), 1024 / BlockFor<kGroup>())
CrossEntropyLossGradKernel(const T* logits, T* dlogits, LossGradArgs a) {
  static_assert(!kCache || BlockFor<kGroup>() == kGroup, "a cached row belongs to a whole block");
  constexpr int kPack = Pack<T>::kSize;
  constexpr int kGroups = BlockFor<kGroup>() / kGroup;
  // Packs per step: 32 bfloat16 values at once would not fit in 64 registers beside the rest.
  constexpr int kSteps = sizeof(T) == 4 ? kUnroll : kUnroll / 2;
  extern __shared__ uint4 cache[];  // kCache: pack p of the row (after its head) in cache[p]
  __shared__ float red[2 * BlockFor<kGroup>() / 32];
  const int lane = threadIdx.x % kGroup, group = threadIdx.x / kGroup;
  // Uniform loop bound and branches for a group that is the whole block, as in the forward.
  for (int64_t base = int64_t(blockIdx.x) * kGroups; base < a.rows;
       base += int64_t(gridDim.x) * kGroups) {
    const int64_t r = base + group;
    if (r >= a.rows) continue;
    const int64_t off = r * a.vocab;
    const T* row = logits + off;
    T* out = dlogits + off;
    const RowSplit split = SplitRow(row, a.vocab);
    const int64_t target = a.targets[r];
    const int cols = RowColumns(a.num_classes, nullptr, 1, r, a.vocab);
    const int end = cols - split.head;  // columns from here on (relative to c) are not classes
    const bool ignored = target == a.ignore_index;
    if (ignored || target < 0 || target >= cols) {
      // Ignored: loss 0 and zeros; unknown target: NaN loss and NaN over the classes. Unread.
      const float fill = ignored ? 0.f : NAN;
      if (lane == 0) a.loss[r] = fill;
      WriteRowGrad<T, kGroup, kSteps>(
          row, out, split, lane, [](const T*, int) { return RawPack<T>{}; },
          [&](float, int c) { return c < end ? fill : 0.f; });
      continue;
    }
    auto cached_pack = [&](const T*, int p) {
      const uint4 v = cache[p];
      return RawPack<T>{{v.x, v.y, v.z, v.w}};
    };
    MaxSum acc;
    if constexpr (kCache) {
      const T* body = row + split.head;
      for (int p = lane; p < split.packs; p += kGroup)
        CopyAsync16(&cache[p], body + int64_t(p) * kPack);
      CopyAsyncWaitAll();  // this thread's packs, which are the only ones it reads
      // Over the classes only: up to `cols`, the row's packs are a prefix of the ones cached.
      acc = RowMaxSumFrom<T, kGroup, kSteps>(row, cols, lane, cached_pack);
    } else {
      acc = RowMaxSumFrom<T, kGroup, kSteps>(row, cols, lane, GlobalPacks{});
    }
    GroupMaxSum<kGroup>(acc, red);
    const float lse = acc.m + __logf(acc.s);
    const float scale = a.scale[r / a.rows_per_scale];
    const int col = static_cast<int>(target) - split.head;
    float* loss = a.loss + r;
    auto value = [&](float x, int c) {
      if (c == col) *loss = lse - x;  // read before this thread overwrites it
      return c < end ? (exp2f((x - lse) * kLog2e) - (c == col ? 1.f : 0.f)) * scale : 0.f;
    };
    if constexpr (kCache)
      WriteRowGrad<T, kGroup, kSteps>(row, out, split, lane, cached_pack, value);
    else
      WriteRowGrad<T, kGroup, kSteps>(row, out, split, lane, GlobalPacks{}, value);
  }
}

// ----------------------------------------------------------------------------------------------
// Launchers.

// Warps take rows of up to kWarpRowBytes; longer rows get a block each.
template <typename T, typename F>
void WithGroup(int vocab, F&& f) {
  if (int64_t(vocab) * sizeof(T) <= kWarpRowBytes) f(std::integral_constant<int, 32>{});
  else f(std::integral_constant<int, kRowThreads>{});
}

// Blocks for `rows` rows, kGroups at a time; the kernels loop over rows beyond the grid.
inline unsigned GridFor(int64_t rows, int groups_per_block, int device) {
  const int64_t want = (rows + groups_per_block - 1) / groups_per_block;
  return static_cast<unsigned>(std::min<int64_t>(want, int64_t(SmCount(device)) * 128));
}

template <typename T, bool kStats>
void LaunchFwd(cudaStream_t stream, int device, const void* logits, const FwdArgs& args) {
  WithGroup<T>(args.vocab, [&](auto g) {
    constexpr int kGroup = decltype(g)::value, kThreads = BlockFor<kGroup>();
    CrossEntropyFwdKernel<T, kGroup, kStats>
        <<<GridFor(args.rows, kThreads / kGroup, device), kThreads, 0, stream>>>(
            static_cast<const T*>(logits), args);
  });
}

template <typename T>
void LaunchBwd(cudaStream_t stream, int device, const void* logits, void* dlogits,
               const BwdArgs& args) {
  WithGroup<T>(args.vocab, [&](auto g) {
    constexpr int kGroup = decltype(g)::value, kThreads = BlockFor<kGroup>();
    CrossEntropyBwdKernel<T, kGroup>
        <<<GridFor(args.rows, kThreads / kGroup, device), kThreads, 0, stream>>>(
            static_cast<const T*>(logits), static_cast<T*>(dlogits), args);
  });
}

template <typename T>
void LaunchLossGrad(cudaStream_t stream, int device, const void* logits, void* dlogits,
                    const LossGradArgs& args) {
  const T* in = static_cast<const T*>(logits);
  T* out = static_cast<T*>(dlogits);
  const int64_t row_bytes = int64_t(args.vocab) * sizeof(T);
  if (row_bytes <= kWarpRowBytes) {
    CrossEntropyLossGradKernel<T, 32, false>
        <<<GridFor(args.rows, kBlock / 32, device), kBlock, 0, stream>>>(in, out, args);
    return;
  }
  const size_t cache_bytes = static_cast<size_t>(row_bytes / 16 * 16);  // most packs of a row
  const unsigned grid = GridFor(args.rows, 1, device);
  constexpr auto kCached = CrossEntropyLossGradKernel<T, kRowThreads, true>;
  if (cache_bytes <= SharedMemoryLimit<kCached>(device))
    kCached<<<grid, kRowThreads, cache_bytes, stream>>>(in, out, args);
  else
    CrossEntropyLossGradKernel<T, kRowThreads, false><<<grid, kRowThreads, 0, stream>>>(in, out,
                                                                                      args);
}

float* RowOut(ffi::Result<ffi::AnyBuffer>& b) { return static_cast<float*>(b->untyped_data()); }
template <typename T> const T* In(const ffi::AnyBuffer& b) {
  return static_cast<const T*>(b.untyped_data());
}

ffi::Error CrossEntropyFwd(cudaStream_t stream, int32_t device, ffi::AnyBuffer logits,
                           ffi::AnyBuffer targets, ffi::Result<ffi::AnyBuffer> loss,
                           ffi::Result<ffi::AnyBuffer> lse, int64_t ignore_index,
                           int64_t num_classes) {
  const char* op = "blujax_cross_entropy_fwd";
  CrossEntropyShape shape;
  BLUJAX_RETURN_IF_ERROR(CheckCrossEntropyFwd(op, /*allow_f64=*/false, logits, targets, *loss, *lse,
                                              num_classes, &shape));
  if (shape.rows == 0) return ffi::Error::Success();
  const FwdArgs args{In<int32_t>(targets), nullptr, 1, RowOut(loss), RowOut(lse), nullptr,
                     shape.rows, static_cast<int>(shape.vocab), ignore_index, num_classes};
  if (logits.element_type() == ffi::DataType::F32)
    LaunchFwd<float, false>(stream, device, logits.untyped_data(), args);
  else
    LaunchFwd<__nv_bfloat16, false>(stream, device, logits.untyped_data(), args);
  return LastCudaError(op);
}

ffi::Error CrossEntropyStats(cudaStream_t stream, int32_t device, ffi::AnyBuffer logits,
                             ffi::AnyBuffer targets, ffi::AnyBuffer vocab_start,
                             ffi::Result<ffi::AnyBuffer> row_max,
                             ffi::Result<ffi::AnyBuffer> sum_exp,
                             ffi::Result<ffi::AnyBuffer> target_logit, int64_t num_classes) {
  const char* op = "blujax_cross_entropy_stats";
  CrossEntropyShape shape;
  int64_t rows_per_start = 1;
  BLUJAX_RETURN_IF_ERROR(CheckCrossEntropyStats(op, /*allow_f64=*/false, logits, targets,
                                                vocab_start, *row_max, *sum_exp, *target_logit,
                                                num_classes, &shape, &rows_per_start));
  if (shape.rows == 0) return ffi::Error::Success();
  const FwdArgs args{In<int32_t>(targets), In<int32_t>(vocab_start), rows_per_start,
                     RowOut(row_max), RowOut(sum_exp), RowOut(target_logit), shape.rows,
                     static_cast<int>(shape.vocab), 0, num_classes};
  if (logits.element_type() == ffi::DataType::F32)
    LaunchFwd<float, true>(stream, device, logits.untyped_data(), args);
  else
    LaunchFwd<__nv_bfloat16, true>(stream, device, logits.untyped_data(), args);
  return LastCudaError(op);
}

ffi::Error CrossEntropyBwd(cudaStream_t stream, int32_t device, ffi::AnyBuffer logits,
                           ffi::AnyBuffer targets, ffi::AnyBuffer lse, ffi::AnyBuffer g,
                           ffi::AnyBuffer vocab_start, ffi::Result<ffi::AnyBuffer> dlogits,
                           int64_t ignore_index, int64_t num_classes) {
  const char* op = "blujax_cross_entropy_bwd";
  CrossEntropyShape shape;
  int64_t rows_per_start = 1;
  BLUJAX_RETURN_IF_ERROR(CheckCrossEntropyBwd(op, /*allow_f64=*/false, logits, targets, lse, g,
                                              vocab_start, *dlogits, num_classes, &shape,
                                              &rows_per_start));
  if (shape.rows == 0) return ffi::Error::Success();
  const BwdArgs args{In<int32_t>(targets), In<float>(lse), In<float>(g), In<int32_t>(vocab_start),
                     rows_per_start, shape.rows, static_cast<int>(shape.vocab), ignore_index,
                     num_classes};
  if (logits.element_type() == ffi::DataType::F32)
    LaunchBwd<float>(stream, device, logits.untyped_data(), dlogits->untyped_data(), args);
  else
    LaunchBwd<__nv_bfloat16>(stream, device, logits.untyped_data(), dlogits->untyped_data(),
                             args);
  return LastCudaError(op);
}


ffi::Error CrossEntropyLossGrad(cudaStream_t stream, int32_t device, ffi::AnyBuffer logits,
                                ffi::AnyBuffer targets, ffi::AnyBuffer scale,
                                ffi::Result<ffi::AnyBuffer> loss,
                                ffi::Result<ffi::AnyBuffer> dlogits, int64_t ignore_index,
                                int64_t num_classes) {
  const char* op = "blujax_cross_entropy_loss_grad";
  CrossEntropyShape shape;
  int64_t rows_per_scale = 1;
  BLUJAX_RETURN_IF_ERROR(CheckCrossEntropyLossGrad(op, /*allow_f64=*/false, logits, targets, scale,
                                                   *loss, *dlogits, num_classes, &shape,
                                                   &rows_per_scale));
  if (shape.rows == 0) return ffi::Error::Success();
  const LossGradArgs args{In<int32_t>(targets), In<float>(scale), rows_per_scale, RowOut(loss),
                          shape.rows, static_cast<int>(shape.vocab), ignore_index, num_classes};
  if (logits.element_type() == ffi::DataType::F32)
    LaunchLossGrad<float>(stream, device, logits.untyped_data(), dlogits->untyped_data(), args);
  else
    LaunchLossGrad<__nv_bfloat16>(stream, device, logits.untyped_data(),
                                  dlogits->untyped_data(), args);
  return LastCudaError(op);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kCrossEntropyFwd, CrossEntropyFwd,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Ctx<Device>()
                           .Arg<ffi::AnyBuffer>()   // logits [..., V]
                           .Arg<ffi::AnyBuffer>()   // targets [...] int32
                           .Ret<ffi::AnyBuffer>()   // loss [...] f32
                           .Ret<ffi::AnyBuffer>()   // lse [...] f32
                           .Attr<int64_t>("ignore_index")
                           .Attr<int64_t>("num_classes"),
                       kGraphSafe);

XLA_FFI_DEFINE_HANDLER(kCrossEntropyStats, CrossEntropyStats,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Ctx<Device>()
                           .Arg<ffi::AnyBuffer>()   // logits [..., V]
                           .Arg<ffi::AnyBuffer>()   // targets [...] int32, global class ids
                           .Arg<ffi::AnyBuffer>()   // vocab_start [] or [K] int32
                           .Ret<ffi::AnyBuffer>()   // row_max [...] f32
                           .Ret<ffi::AnyBuffer>()   // sum_exp [...] f32
                           .Ret<ffi::AnyBuffer>()   // target_logit [...] f32
                           .Attr<int64_t>("num_classes"),
                       kGraphSafe);

XLA_FFI_DEFINE_HANDLER(kCrossEntropyBwd, CrossEntropyBwd,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Ctx<Device>()
                           .Arg<ffi::AnyBuffer>()   // logits [..., V]
                           .Arg<ffi::AnyBuffer>()   // targets [...] int32, global class ids
                           .Arg<ffi::AnyBuffer>()   // lse [...] f32
                           .Arg<ffi::AnyBuffer>()   // g [...] f32, the loss cotangent
                           .Arg<ffi::AnyBuffer>()   // vocab_start [] or [K] int32
                           .Ret<ffi::AnyBuffer>()   // dlogits [..., V], may alias logits
                           .Attr<int64_t>("ignore_index")
                           .Attr<int64_t>("num_classes"),
                       kGraphSafe);

XLA_FFI_DEFINE_HANDLER(kCrossEntropyLossGrad, CrossEntropyLossGrad,
                       ffi::Ffi::Bind()
                           .Ctx<Stream>()
                           .Ctx<Device>()
                           .Arg<ffi::AnyBuffer>()   // logits [..., V]
                           .Arg<ffi::AnyBuffer>()   // targets [...] int32
                           .Arg<ffi::AnyBuffer>()   // scale [] or [K] f32, the gradient's factor
                           .Ret<ffi::AnyBuffer>()   // loss [...] f32
                           .Ret<ffi::AnyBuffer>()   // dlogits [..., V], may alias logits
                           .Attr<int64_t>("ignore_index")
                           .Attr<int64_t>("num_classes"),
                       kGraphSafe);

BLUJAX_REGISTER(blujax_cross_entropy_fwd, kCrossEntropyFwd);
BLUJAX_REGISTER(blujax_cross_entropy_stats, kCrossEntropyStats);
BLUJAX_REGISTER(blujax_cross_entropy_bwd, kCrossEntropyBwd);
BLUJAX_REGISTER(blujax_cross_entropy_loss_grad, kCrossEntropyLossGrad);

}  // namespace blujax
