// What every handler of the CPU kernel library shares so that a bad call fails alone: the step
// gets an error, the process and its other requests live on.
//
// Why: XLA calls a handler through a C ABI, so a C++ exception escaping one (std::bad_alloc from
// a scratch buffer, std::length_error from a vector) would std::terminate the whole engine.
// `Guarded` turns one into the handler's ffi::Error. Pool tasks run where no handler can return
// anything: `TaskErrors::run` records a task's first failure (and the task still counts its
// items done, or the caller's wait would never end); the caller rethrows it after the wait.
// An offset into a mapped file arrives as two i32 words (jax runs with 32-bit integers, and one
// i32 of 32-byte units ends at 64 GiB): `FileUnits`. Sizes from attributes are multiplied with
// `CheckedMul`, so that a huge one is refused rather than wrapped into a small one.

#pragma once

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <exception>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxbatch_ffi {

// An error with "name: what" (the bare code where even that string cannot be allocated).
inline xla::ffi::Error Failure(xla::ffi::ErrorCode code, const char* name,
                               const char* what) noexcept {
  try {
    return xla::ffi::Error(code, std::string(name) + ": " + what);
  } catch (...) {
    return xla::ffi::Error(code, std::string());
  }
}

// body() -> its ffi::Error; an exception -> kResourceExhausted (out of memory) or kInternal.
template <class F>
xla::ffi::Error Guarded(const char* name, F&& body) noexcept {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return Failure(xla::ffi::ErrorCode::kResourceExhausted, name, "out of memory");
  } catch (const std::exception& e) {
    return Failure(xla::ffi::ErrorCode::kInternal, name, e.what());
  } catch (...) {
    return Failure(xla::ffi::ErrorCode::kInternal, name, "unknown exception");
  }
}

// The first failure among a job's pool tasks, kept for the caller.
class TaskErrors {
 public:
  // f() with any exception recorded, never thrown out (the first one is kept)
  template <class F>
  void run(F&& f) noexcept {
    try {
      f();
    } catch (const std::bad_alloc&) {
      note(kOutOfMemory, "out of memory");
    } catch (const std::exception& e) {
      note(kOther, e.what());
    } catch (...) {
      note(kOther, "unknown exception");
    }
  }
  // some task failed: the others skip their remaining items (still counting them done)
  bool failed() const { return state_.load(std::memory_order_relaxed) != kNone; }
  // on the calling thread, after the tasks are done: the failure as an exception again
  void rethrow() const {
    switch (state_.load(std::memory_order_acquire)) {
      case kNone: return;
      case kOutOfMemory: throw std::bad_alloc();
      default: throw std::runtime_error(what_);
    }
  }

 private:
  enum : int { kNone, kWriting, kOutOfMemory, kOther };
  void note(int kind, const char* what) noexcept {
    int expected = kNone;
    if (!state_.compare_exchange_strong(expected, kWriting)) return;
    std::snprintf(what_, sizeof what_, "a worker thread failed: %s", what);
    state_.store(kind, std::memory_order_release);
  }
  std::atomic<int> state_{kNone};
  char what_[200] = {};
};

// Schedules up to n copies of `task`; returns how many were. Each is copied onto the heap, so
// out of memory leaves fewer helpers, and the caller's own drain does their share.
template <class F>
int64_t ScheduleHelpers(xla::ffi::ThreadPool& pool, int64_t n, const F& task) noexcept {
  int64_t t = 0;
  try {
    for (; t < n; ++t) pool.Schedule(F(task));
  } catch (...) {
  }
  return t;
}

// The loop a pooled matmul's threads run (its "drain"): claim items [0, job.items) one at a
// time (job.next), run work(item) unless a task of the call has failed (the failure kept in
// job.errors), and count each in job.done whatever happened, so that RunPooled's wait ends.
// Job: std::atomic<int64_t> next, done; int64_t items; TaskErrors errors.
template <class Job, class F>
void DrainItems(Job& job, const F& work) {
  for (int64_t it = job.next.fetch_add(1); it < job.items; it = job.next.fetch_add(1)) {
    if (!job.errors.failed()) job.errors.run([&] { work(it); });
    job.done.fetch_add(1, std::memory_order_release);
  }
}

// Runs drain(*job) on up to `helpers` pool threads and on the calling thread, waits until
// job->done counts every item, then rethrows the first error a task met (the handler's error
// through Guarded). Shared ownership: a helper scheduled late still finds the job alive.
template <class Job, class Drain>
void RunPooled(xla::ffi::ThreadPool& pool, int64_t helpers, const std::shared_ptr<Job>& job,
               Drain drain) {
  ScheduleHelpers(pool, helpers, [job, drain] { drain(*job); });
  drain(*job);
  while (job->done.load(std::memory_order_acquire) < job->items) std::this_thread::yield();
  job->errors.rethrow();
}

// The offset in 32-byte units held by words [low, high] (quant_formats.offset_words); -1 for a
// negative high word. At most 2^63 - 1: compare it with the file's units before scaling it.
inline int64_t FileUnits(const int32_t* words) {
  if (words[1] < 0) return -1;
  return static_cast<int64_t>((static_cast<uint64_t>(static_cast<uint32_t>(words[1])) << 32) |
                              static_cast<uint32_t>(words[0]));
}

// a * b, or -1 where either is negative or the product overflows int64.
inline int64_t CheckedMul(int64_t a, int64_t b) {
  int64_t r;
  if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &r)) return -1;
  return r;
}

// A thread's reusable 64-byte-aligned buffer (the matmuls' per-thread scratch, thread_local),
// grown in whole pages; never null: a failed allocation throws std::bad_alloc (the call's
// error through Guarded / TaskErrors).
struct Scratch {
  void* p = nullptr;
  size_t n = 0;
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() { std::free(p); }
  void* get(size_t bytes) {
    if (bytes > n) {
      std::free(p);
      p = nullptr;
      n = 0;
      const size_t want = (bytes + 4095) & ~size_t(4095);
      if (want < bytes || (p = std::aligned_alloc(64, want)) == nullptr) throw std::bad_alloc();
      n = want;
    }
    return p;
  }
};

}  // namespace jaxbatch_ffi
