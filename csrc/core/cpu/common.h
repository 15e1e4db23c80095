// What every CPU handler shares: the platform (XLA's intra-op thread pool), the parallel-for
// over it, converting tile copies, and the ISA multiversioning of hot loops.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "core/op.h"

// CPU hot loops are compiled for several x86 ISA levels and picked at load time (ifunc), so one
// wheel runs everywhere and still uses AVX2 / AVX-512 where the machine has them, as XLA's own
// code does. A sanitizer build (JAXFUSE_CPU_ONE_ISA, with -march=native) compiles them once,
// for the machine it runs on: the one version a release build would pick there, and the only
// one its checks could run.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__) && \
    !defined(JAXFUSE_CPU_ONE_ISA)
#define JF_CPU_ISA_VERSIONS 1
#define JF_CPU_MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define JF_CPU_ISA_VERSIONS 0
#define JF_CPU_MULTIVERSION
#endif

namespace jaxfuse {

// The CPU platform of op.h: handlers run on XLA's intra-op thread pool.
struct Cpu {
  using Context = ffi::ThreadPool;
  using Arg = ffi::ThreadPool;
  static constexpr bool kCommandBufferCompatible = false;
};

// Eight fp32 / four fp64 lanes (GCC vector types): full-width SIMD with the same lanes, so the
// same rounding, on every ISA level, where a loop over a lane array may not vectorize.
typedef float F32x8 __attribute__((vector_size(32)));
typedef float F32x4 __attribute__((vector_size(16)));
typedef double F64x4 __attribute__((vector_size(32)));
// Sixteen fp32 lanes, one AVX-512 register (two or four vectors on lower ISA levels), and the
// 32-bit patterns of F32x8 / F32x16 lanes.
typedef float F32x16 __attribute__((vector_size(64)));
typedef uint32_t U32x8 __attribute__((vector_size(32)));
typedef uint32_t U32x16 __attribute__((vector_size(64)));
// Signed 32-bit lanes, and 16-bit lanes of the same count (8-bit weights, read two per lane).
typedef int32_t I32x8 __attribute__((vector_size(32)));
typedef int32_t I32x16 __attribute__((vector_size(64)));
typedef int16_t I16x8 __attribute__((vector_size(16)));
typedef int16_t I16x16 __attribute__((vector_size(32)));
typedef uint16_t U16x8 __attribute__((vector_size(16)));
typedef uint16_t U16x16 __attribute__((vector_size(32)));

// A spin-wait hint to the core (lets its sibling thread run, saves power).
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Spins until done() or until `limit` has passed.
template <typename Done>
void spin_until(const Done& done, std::chrono::nanoseconds limit) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (!done() && std::chrono::steady_clock::now() < end) {
    for (int i = 0; i < 16; ++i) cpu_relax();
  }
}

// How long parallel_for's caller spins for its started workers before it sleeps: their last
// items usually end within this, and waking a sleeping thread takes tens of microseconds (a
// futex round trip, through the hypervisor on a VM), as long as a decoder GEMV at batch 1.
constexpr std::chrono::microseconds kJoinSpin{100};

// Runs fn(item) for item in [0, num_items) on the calling thread and up to
// min(pool.num_threads(), max_helpers) pool workers. Items are claimed from a shared counter,
// and the caller only waits for workers that actually started, so it cannot deadlock when the
// pool is busy or when the caller is itself a pool thread. Workers that start after all items
// are claimed exit without touching `fn`. A null pool runs everything on the calling thread.
template <typename Fn>
void parallel_for(ffi::ThreadPool* pool, int64_t num_items, const Fn& fn,
                  int64_t max_helpers = INT64_MAX) {
  const int64_t helpers =
      pool == nullptr ? 0 : std::min({int64_t(pool->num_threads()), num_items - 1, max_helpers});
  if (helpers <= 0) {
    for (int64_t i = 0; i < num_items; ++i) fn(i);
    return;
  }
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> active{0};
    std::mutex mu;
    std::condition_variable done;
  };
  auto shared = std::make_shared<Shared>();
  const Fn* fn_ptr = &fn;
  for (int64_t w = 0; w < helpers; ++w) {
    pool->Schedule([shared, fn_ptr, num_items]() {
      shared->active.fetch_add(1);
      for (int64_t i = shared->next.fetch_add(1); i < num_items; i = shared->next.fetch_add(1)) {
        (*fn_ptr)(i);
      }
      if (shared->active.fetch_sub(1) == 1) {
        std::lock_guard<std::mutex> lock(shared->mu);
        shared->done.notify_all();
      }
    });
  }
  for (int64_t i = shared->next.fetch_add(1); i < num_items; i = shared->next.fetch_add(1)) fn(i);
  spin_until([&] { return shared->active.load() == 0; }, kJoinSpin);
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->done.wait(lock, [&] { return shared->active.load() == 0; });
}

// The most pool workers a parallel_for should add to its calling thread: one fewer than the
// pool has threads. XLA sizes the intra-op pool to the cores and the caller (often the Python
// thread) is one thread more; with more threads than cores the OS parks one of them, item in
// hand, and the join waits for it.
inline int64_t helpers_beside_caller(const ffi::ThreadPool* pool) {
  return pool == nullptr ? 0 : pool->num_threads() - 1;
}

// Converting tile copies: load a run of any storage dtype into compute-type scratch and store it
// back. Plain loops over typed pointers, so the compiler vectorizes each dtype's case; always
// inlined, so that a caller compiled per ISA level (JF_CPU_MULTIVERSION) converts at its level.
template <typename Real>
__attribute__((always_inline)) inline void load_tile(const void* base, DType t, int64_t start,
                                                     int64_t n, Real* out) {
  visit_dtype(t, [&](auto tag) {
    using S = typename decltype(tag)::S;
    const typename S::Bits* p = static_cast<const typename S::Bits*>(base) + start;
    for (int64_t i = 0; i < n; ++i) out[i] = S::template load<Real>(p[i]);
  });
}

template <typename Real>
__attribute__((always_inline)) inline void store_tile(void* base, DType t, int64_t start,
                                                      int64_t n, const Real* in) {
  visit_dtype(t, [&](auto tag) {
    using S = typename decltype(tag)::S;
    typename S::Bits* p = static_cast<typename S::Bits*>(base) + start;
    for (int64_t i = 0; i < n; ++i) p[i] = S::store(in[i]);
  });
}

// The storage dtype whose values are the compute type itself (read and written in place).
template <typename Real>
inline constexpr DType kNativeDType = sizeof(Real) == 8 ? DType::kF64 : DType::kF32;

}  // namespace jaxfuse
