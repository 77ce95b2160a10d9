// Helpers shared by the CPU handlers: dtype dispatch and typed views of FFI buffers.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "common/ffi_util.h"

namespace blujax {

// Calls fn with a value of the storage type of a float buffer (uint16_t stands for bfloat16).
template <typename Fn>
ffi::Error DispatchFloat(ffi::DataType t, Fn&& fn) {
  switch (t) {
    case ffi::DataType::F32: fn(float{}); return ffi::Error::Success();
    case ffi::DataType::F64: fn(double{}); return ffi::Error::Success();
    case ffi::DataType::BF16: fn(uint16_t{}); return ffi::Error::Success();
    default: return InvalidArgument("unsupported dtype ", DtypeName(t));
  }
}

template <typename T> const T* In(const ffi::AnyBuffer& b) {
  return reinterpret_cast<const T*>(b.untyped_data());
}
template <typename T> T* Out(ffi::Result<ffi::AnyBuffer>& b) {
  return reinterpret_cast<T*>(b->untyped_data());
}

// Runs fn(begin, end) over [0, n) in chunks of at least `grain` on XLA's intra-op thread pool
// and the calling thread. The caller claims chunks too and then waits only for chunks already
// claimed, so it never waits on a task the pool has not started: a busy pool (8 emulated
// devices all calling kernels) slows it down but cannot deadlock it. A task that starts late
// finds no chunk left and touches only the shared counters, which it co-owns.
template <typename Fn>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, int64_t grain, Fn&& fn) {
  if (n <= 0) return;
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t chunks =
      std::min<int64_t>(threads * 4, (n + grain - 1) / std::max<int64_t>(grain, 1));
  if (chunks <= 1 || threads == 1) {
    fn(int64_t{0}, n);
    return;
  }
  struct Shared {
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto shared = std::make_shared<Shared>();
  auto work = [shared, chunks, n, fn_ptr = &fn]() {
    for (;;) {
      const int64_t c = shared->next.fetch_add(1);
      if (c >= chunks) return;
      (*fn_ptr)(c * n / chunks, (c + 1) * n / chunks);
      if (shared->done.fetch_add(1) + 1 == chunks) {
        std::lock_guard<std::mutex> lock(shared->mu);
        shared->cv.notify_all();
      }
    }
  };
  for (int64_t i = 0; i < std::min(threads, chunks) - 1; ++i) {
    auto task = work;  // Schedule takes ownership of a copy
    pool.Schedule(std::move(task));
  }
  work();
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->cv.wait(lock, [&] { return shared->done.load() == chunks; });
}

// Rows per chunk so that a chunk is worth a task (about 64k elements).
inline int64_t RowGrain(int64_t cols) {
  return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(cols, 1));
}

}  // namespace blujax
