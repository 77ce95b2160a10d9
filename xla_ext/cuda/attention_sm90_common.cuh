// What the Hopper (sm_90a) attention kernels share beyond common/sm90.cuh's PTX wrappers: the
// producer loop that streams K and V tiles through shared memory (attention_sm90_fwd.cuh has
// the forward, attention_sm90_bwd.cuh the backward, attention.cu the overview and the
// launchers).

#pragma once

#include "common/sm90.cuh"
#include "cuda/attention_common.cuh"

namespace blujax {
namespace {

// The mbarriers and the producer loop of a kernel that holds one block of query rows and
// streams the K and V tiles of its (batch, head) through kStages buffers each: tile j goes to
// buffer j % kStages once tile j - kStages has left it (every consumer warp arrived on empty).
// Consumers wait for tile j with parity (j / kStages) & 1.
template <int kStages>
struct KvStream {
  static constexpr int kBarriers = 1 + 4 * kStages;
  uint64_t *q_full, *k_full, *k_empty, *v_full, *v_empty;

  __device__ explicit KvStream(uint64_t* bars)
      : q_full(bars),
        k_full(bars + 1),
        k_empty(k_full + kStages),
        v_full(k_empty + kStages),
        v_empty(v_full + kStages) {}

  // One thread, before a __syncthreads.
  __device__ void Init(int consumer_warps) const {
    MbarInit(q_full, 1);
    for (int i = 0; i < kStages; ++i) {
      MbarInit(k_full + i, 1);
      MbarInit(v_full + i, 1);
      MbarInit(k_empty + i, consumer_warps);
      MbarInit(v_empty + i, consumer_warps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }

  // The producer's one thread: K_j and V_j of (b, h) for j < n_kt, in tiles of kRows rows.
  // `first` tiles went through the buffers before (a CTA's earlier blocks of query rows), so
  // tile j is the buffers' (first + j)-th.
  template <int D, int kRows>
  __device__ void Stream(bf16* sK, bf16* sV, const CUtensorMap* k, const CUtensorMap* v, int h,
                         int b, int n_kt, int first = 0) const {
    constexpr int kBytes = kRows * D * int(sizeof(bf16));
    for (int j = 0; j < n_kt; ++j) {
      const int buf = (first + j) % kStages, use = (first + j) / kStages;
      if (use > 0) MbarWait(k_empty + buf, (use - 1) & 1);
      MbarExpectBytes(k_full + buf, kBytes);
      TmaTile<D>(sK + buf * kRows * D, kRows, k, h, j * kRows, b, k_full + buf);
      if (use > 0) MbarWait(v_empty + buf, (use - 1) & 1);
      MbarExpectBytes(v_full + buf, kBytes);
      TmaTile<D>(sV + buf * kRows * D, kRows, v, h, j * kRows, b, v_full + buf);
    }
  }
};

}  // namespace
}  // namespace blujax
