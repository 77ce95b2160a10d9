// How fast can y = gelu(x) (float32) move its bytes on this GPU? A standalone program, no JAX:
// our GELU forward's way (one 16-byte vector a thread, 256-thread blocks, one pass) against
// cudaMemcpyAsync, the same kernel copying, other block shapes, cache-hinted loads and TMA bulk
// copies through shared memory. Each variant is checked against the first and timed with CUDA
// events (20 launches a sample, median of 7 interleaved rounds).
//
//   nvcc -std=c++17 -O3 -arch=sm_90a -o copy_variants benchmarks/probes/copy_variants.cu
//   ./copy_variants
//
// (The TMA variants need sm_90; the rest run anywhere.)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                              \
  do {                                                                        \
    cudaError_t e = (x);                                                      \
    if (e != cudaSuccess) {                                                   \
      std::printf("%s failed: %s\n", #x, cudaGetErrorString(e));             \
      std::exit(1);                                                           \
    }                                                                         \
  } while (0)

// GELU (tanh) as blujax computes it: v * sigmoid(2u), u = sqrt(2/pi) (v + 0.044715 v^3).
__device__ __forceinline__ float Gelu(float v) {
  const float kE1 = -2.302208f, kE3 = -0.102943f;  // -2 sqrt(2/pi) log2(e) (1, 0.044715)
  return v * __fdividef(1.f, 1.f + exp2f(v * fmaf(kE3, v * v, kE1)));
}
__device__ __forceinline__ float4 Gelu4(float4 a) {
  return make_float4(Gelu(a.x), Gelu(a.y), Gelu(a.z), Gelu(a.w));
}

enum Load { kPlain, kPrefetch256, kPrefetch128, kStreaming };

template <Load L>
__device__ __forceinline__ float4 Ld(const float4* p) {
  float4 r;
  if constexpr (L == kPlain) {
    r = *p;
  } else if constexpr (L == kPrefetch256) {
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.f32 {%0,%1,%2,%3}, [%4];"
                 : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "l"(p));
  } else if constexpr (L == kPrefetch128) {
    asm volatile("ld.global.nc.L2::128B.v4.f32 {%0,%1,%2,%3}, [%4];"
                 : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "l"(p));
  } else {
    r = __ldcs(p);
  }
  return r;
}

// kU vectors a thread, kT threads a block, each block passing once.
template <Load L, int kU, int kT, bool kGelu = true>
__global__ void __launch_bounds__(kT) Flat(const float4* __restrict__ x, float4* __restrict__ y,
                                           int64_t vecs) {
  const int64_t first = int64_t(blockIdx.x) * kT * kU + threadIdx.x;
  float4 a[kU];
#pragma unroll
  for (int u = 0; u < kU; ++u)
    if (first + u * kT < vecs) a[u] = Ld<L>(x + first + u * kT);
#pragma unroll
  for (int u = 0; u < kU; ++u)
    if (first + u * kT < vecs) y[first + u * kT] = kGelu ? Gelu4(a[u]) : a[u];
}

// TMA bulk copies: CTAs of kT threads take chunks of kChunk bytes round-robin; one thread
// loads each chunk into one of kS stages, all threads apply GELU in place, and the same thread
// stores the stage back with one bulk copy, refilling it once that store has read it.
__device__ __forceinline__ uint32_t Smem(const void* p) {
  return uint32_t(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void WaitParity(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra W;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void BulkLoad(uint32_t dst, const void* src, uint32_t bytes,
                                         uint32_t bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

template <int kChunk, int kS, int kT>
__global__ void __launch_bounds__(kT) Bulk(const float* __restrict__ x, float* __restrict__ y,
                                           int64_t n) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) uint64_t bars[kS];
  constexpr int kFloats = kChunk / 4;
  const int64_t chunks = n / kFloats;  // main() sizes n to whole chunks
  float* buf = reinterpret_cast<float*>(smem);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kS; ++s)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(Smem(&bars[s])));
    asm volatile("fence.mbarrier_init.release.cluster;");
  }
  __syncthreads();
  const int64_t mine = chunks > blockIdx.x ? (chunks - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  auto at = [&](int64_t j) { return (blockIdx.x + j * gridDim.x) * kFloats; };
  if (threadIdx.x == 0)
    for (int s = 0; s < kS && s < mine; ++s)
      BulkLoad(Smem(buf + s * kFloats), x + at(s), kChunk, Smem(&bars[s]));
  for (int64_t j = 0; j < mine; ++j) {
    const int s = j % kS;
    WaitParity(Smem(&bars[s]), (j / kS) & 1);
    float4* v = reinterpret_cast<float4*>(buf + s * kFloats);
    for (int i = threadIdx.x; i < kFloats / 4; i += kT) v[i] = Gelu4(v[i]);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic writes -> bulk read
    __syncthreads();
    if (threadIdx.x == 0) {
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(y + at(j)),
                   "r"(Smem(buf + s * kFloats)), "r"(kChunk) : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      if (j >= 1 && j - 1 + kS < mine) {  // refill the stage stored one step ago
        asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
        const int sp = (j - 1) % kS;
        BulkLoad(Smem(buf + sp * kFloats), x + at(j - 1 + kS), kChunk, Smem(&bars[sp]));
      }
    }
  }
  if (threadIdx.x == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
#endif
}

template <int kChunk, int kS, int kT>
void LaunchBulk(int ctas, const float* x, float* y, int64_t n) {
  CHECK(cudaFuncSetAttribute(Bulk<kChunk, kS, kT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             kS * kChunk));
  Bulk<kChunk, kS, kT><<<ctas, kT, kS * kChunk>>>(x, y, n);
}

int main() {
  int sms = 0, major = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  const char* names[] = {"1 vector x 256 threads (ours)", "  .L2::256B prefetch",
                         "  .L2::128B prefetch",          "  streaming (__ldcs)",
                         "2 vectors x 256 threads",       "1 vector x 512 threads",
                         "1 vector x 128 threads",        "the same kernel, copy only",
                         "cudaMemcpyAsync",               "TMA bulk 8 KB x 4, 128 thr",
                         "TMA bulk 16 KB x 4, 256 thr",   "TMA bulk 4 KB x 8, 128 thr",
                         "TMA bulk 16 KB x 3, 128 thr",   "TMA bulk 32 KB x 3, 256 thr"};
  const int variants = major >= 9 ? 14 : 9;
  const int64_t shapes[][2] = {{16384, 3072}, {32768, 3072}, {16384, 4096}};
  for (const auto& shape : shapes) {
    const int64_t n = shape[0] * shape[1], vecs = n / 4;  // whole vectors and 32 KB chunks
    float *x, *y;
    CHECK(cudaMalloc(&x, n * 4));
    CHECK(cudaMalloc(&y, n * 4));
    std::vector<float> host(n), want(n);
    for (int64_t i = 0; i < n; ++i) host[i] = float((i * 2654435761u) % 2000) / 500.f - 2.f;
    CHECK(cudaMemcpy(x, host.data(), n * 4, cudaMemcpyHostToDevice));
    const auto* x4 = reinterpret_cast<const float4*>(x);
    auto* y4 = reinterpret_cast<float4*>(y);
    auto run = [&](int k) {
      switch (k) {
        case 0: Flat<kPlain, 1, 256><<<(vecs + 255) / 256, 256>>>(x4, y4, vecs); break;
        case 1: Flat<kPrefetch256, 1, 256><<<(vecs + 255) / 256, 256>>>(x4, y4, vecs); break;
        case 2: Flat<kPrefetch128, 1, 256><<<(vecs + 255) / 256, 256>>>(x4, y4, vecs); break;
        case 3: Flat<kStreaming, 1, 256><<<(vecs + 255) / 256, 256>>>(x4, y4, vecs); break;
        case 4: Flat<kPlain, 2, 256><<<(vecs + 511) / 512, 256>>>(x4, y4, vecs); break;
        case 5: Flat<kPlain, 1, 512><<<(vecs + 511) / 512, 512>>>(x4, y4, vecs); break;
        case 6: Flat<kPlain, 1, 128><<<(vecs + 127) / 128, 128>>>(x4, y4, vecs); break;
        case 7: Flat<kPlain, 1, 256, false><<<(vecs + 255) / 256, 256>>>(x4, y4, vecs); break;
        case 8: CHECK(cudaMemcpyAsync(y, x, n * 4, cudaMemcpyDeviceToDevice)); break;
        case 9: LaunchBulk<8192, 4, 128>(sms * 8, x, y, n); break;
        case 10: LaunchBulk<16384, 4, 256>(sms * 3, x, y, n); break;
        case 11: LaunchBulk<4096, 8, 128>(sms * 8, x, y, n); break;
        case 12: LaunchBulk<16384, 3, 128>(sms * 4, x, y, n); break;
        case 13: LaunchBulk<32768, 3, 256>(sms * 2, x, y, n); break;
      }
    };
    run(0);
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemcpy(want.data(), y, n * 4, cudaMemcpyDeviceToHost));
    for (int k = 1; k < variants; ++k) {
      if (k == 7 || k == 8) continue;  // copies, not GELU
      CHECK(cudaMemset(y, 0, n * 4));
      run(k);
      CHECK(cudaGetLastError());
      CHECK(cudaDeviceSynchronize());
      CHECK(cudaMemcpy(host.data(), y, n * 4, cudaMemcpyDeviceToHost));
      int64_t bad = 0;
      for (int64_t i = 0; i < n; ++i) bad += host[i] != want[i];
      if (bad) std::printf("  %s: %lld values differ from the first variant\n", names[k],
                           static_cast<long long>(bad));
    }
    cudaEvent_t start, stop;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));
    std::vector<std::vector<float>> ms(variants);
    for (int round = 0; round < 7; ++round) {
      for (int k = 0; k < variants; ++k) {
        for (int w = 0; w < 3; ++w) run(k);
        CHECK(cudaEventRecord(start));
        for (int r = 0; r < 20; ++r) run(k);
        CHECK(cudaEventRecord(stop));
        CHECK(cudaEventSynchronize(stop));
        float t = 0.f;
        CHECK(cudaEventElapsedTime(&t, start, stop));
        ms[k].push_back(t / 20);
      }
    }
    std::printf("%lld x %lld float32 (%.0f MB each way)\n", static_cast<long long>(shape[0]),
                static_cast<long long>(shape[1]), n * 4 / 1e6);
    float first = 0.f;
    for (int k = 0; k < variants; ++k) {
      std::sort(ms[k].begin(), ms[k].end());
      const float median = ms[k][ms[k].size() / 2];
      if (k == 0) first = median;
      std::printf("  %-32s %8.1f us %6.0f GB/s  %.3fx of the first\n", names[k], median * 1e3,
                  2.0 * n * 4 / (median * 1e-3) / 1e9, first / median);
    }
    CHECK(cudaEventDestroy(start));
    CHECK(cudaEventDestroy(stop));
    CHECK(cudaFree(x));
    CHECK(cudaFree(y));
  }
  return 0;
}
