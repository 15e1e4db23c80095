// The CPU decoder's GEMV engine: y[b, :] = a[b, :] @ W for the B rows of a decode step, over
// XLA's intra-op thread pool. The micro-kernel and its ISA versions are decoder_gemv.cc.
//
// A decode GEMV streams every weight once per step for only B rows, so it is bound by how fast
// the weights arrive and how cheaply each is widened and used B times:
//  - memory order: W [K, N] is split into stretches of kDecCpuSplitRows k rows, and a work item
//    is one split times a column range as wide as the accumulator tile allows, mostly all of N:
//    a contiguous run of the weights, which a core's prefetchers stream at up to twice the rate
//    of the half-rows that splitting only N gives two threads. Within an item, k rows are walked
//    kStepRows at a time, each row's span front to back;
//  - registers: the micro-kernel (gemv_tile) keeps an MR-row x NS-strip accumulator tile in
//    registers over kStepRows k rows, widens each weight vector once for its MR rows and
//    broadcasts a[r, k] against it. Between steps the accumulators wait in an L1-resident tile.
// Each split's sums run over its k rows in ascending order, one fp32 multiply and one add per
// term (no FMA contraction: see CMakeLists.txt), then the splits' partial sums are added in split
// order: the same bits whatever the column ranges, the vector width, the dtype's load path and
// the thread count.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include "decoder/decoder.h"

#include "core/cpu/common.h"

namespace jaxfuse::cpu_decoder {

// The accumulator tile of one work item: at most kPassRows batch rows x (kTileFloats / rows)
// columns of fp32, 16 KB, half of L1. Batches above kPassRows take further passes over W.
constexpr int64_t kTileFloats = 4096;
constexpr int64_t kPassRows = 16;
// Below this many multiply-adds a stage runs on the calling thread: handing work to the pool
// costs more than it saves for small models.
constexpr int64_t kMinParallelWork = int64_t(1) << 17;

#if defined(__x86_64__)
// Float subnormal inputs read as such in this scope: XLA's CPU threads run with MXCSR's
// denormals-are-zero bit set, which would read the fp8 widenings' subnormal codes (F8Strip's in
// decoder_gemv.cc, the LM head's in decoder_head.cc) as 0. Restored on exit.
class SubnormalInputs {
 public:
  static constexpr unsigned kDenormalsAreZero = 1u << 6;
  SubnormalInputs() : saved_(__builtin_ia32_stmxcsr()) {
    __builtin_ia32_ldmxcsr(saved_ & ~kDenormalsAreZero);
  }
  ~SubnormalInputs() { __builtin_ia32_ldmxcsr(saved_); }
  SubnormalInputs(const SubnormalInputs&) = delete;
  SubnormalInputs& operator=(const SubnormalInputs&) = delete;

 private:
  unsigned saved_;
};
#endif

inline ffi::ThreadPool* pool_for(ffi::ThreadPool* pool, int64_t work) {
  return work >= kMinParallelWork ? pool : nullptr;
}

// y[r, 0:len] (row stride ldy) = sum_k a[r, k] * W[k, n0 + 0:len] for r < rows, where
// rows * round_up(len, 64) <= kTileFloats; a fp32 with row stride lda, W [K, N] in storage
// `dtype`.
void gemv_pass(int64_t rows, const float* a, int64_t lda, const void* W, DType dtype, int64_t K,
               int64_t N, int64_t n0, int64_t len, float* y, int64_t ldy);

// The column ranges of a GEMV's work items: `count` ranges of `width` columns (the last one
// shorter), as wide as the accumulator tile holds for min(B, kPassRows) rows, and narrower when
// `splits` alone would leave a thread without an item (the ranges change no sum).
struct GemvColumns {
  int64_t width, count;
};
GemvColumns gemv_columns(int64_t B, int64_t N, int64_t splits, int64_t threads);

// One layer's matrix W [K, N] in storage `dtype` (int8 and fp8 with per-column `scale` [N],
// else scale null).
struct GemvWeights {
  const void* data;
  DType dtype;
  const float* scale;
  int64_t K, N;
};

// y[b, n] = scale[n] * sum_k a[b, k] * W[k, n] (no scale: 1) for the B rows of `a` (fp32, row
// stride lda). `partials` holds the split partial sums, [splits][B][N] floats
// (decoder_plan.h's cpu_gemv_floats() counts them). epilogue(b, n0, len, y) receives each finished
// range of a row (fp32).
template <typename Epilogue>
void gemv(ffi::ThreadPool* pool, int64_t B, const float* a, int64_t lda, const GemvWeights& w,
          float* partials, const Epilogue& epilogue) {
  const int64_t K = w.K, N = w.N;
  pool = pool_for(pool, B * K * N);
  const int64_t helpers = helpers_beside_caller(pool);
  const int64_t splits = cpu_splits(K);
  const GemvColumns cols = gemv_columns(B, N, splits, helpers + 1);
  auto range = [&](int64_t c) { return std::min(cols.width, N - c * cols.width); };
  auto finish = [&](int64_t b, int64_t n0, int64_t len, float* y) {
    if (w.scale != nullptr) {
      for (int64_t i = 0; i < len; ++i) y[i] *= w.scale[n0 + i];
    }
    epilogue(b, n0, len, y);
  };
  // Rows [b0, b0 + rows) of split s over columns [n0, n0 + len), to y (row stride ldy).
  auto pass = [&](int64_t s, int64_t b0, int64_t rows, int64_t n0, int64_t len, float* y,
                  int64_t ldy) {
    const int64_t k0 = s * kDecCpuSplitRows;
    gemv_pass(rows, a + b0 * lda + k0, lda, element_ptr(w.data, w.dtype, k0 * N), w.dtype,
              std::min(kDecCpuSplitRows, K - k0), N, n0, len, y, ldy);
  };
  if (splits == 1) {  // each item's sums are final
    parallel_for(pool, cols.count, [&](int64_t c) {
      const int64_t n0 = c * cols.width, len = range(c);
      alignas(64) float y[kTileFloats];
      for (int64_t b0 = 0; b0 < B; b0 += kPassRows) {
        const int64_t rows = std::min(kPassRows, B - b0);
        pass(0, b0, rows, n0, len, y, len);
        for (int64_t r = 0; r < rows; ++r) finish(b0 + r, n0, len, y + r * len);
      }
    }, helpers);
    return;
  }
  // Item (column range c, split s); consecutive items are consecutive splits of a range. The
  // last item of a range to finish (its arrival publishes its partials and acquires the others')
  // adds the range's splits, in split order.
  auto split_row = [&](int64_t s, int64_t b) { return partials + (s * B + b) * N; };
  const std::unique_ptr<std::atomic<int64_t>[]> arrivals(new std::atomic<int64_t>[cols.count]());
  parallel_for(pool, cols.count * splits, [&](int64_t item) {
    const int64_t c = item / splits, s = item % splits;
    const int64_t n0 = c * cols.width, len = range(c);
    for (int64_t b0 = 0; b0 < B; b0 += kPassRows) {
      pass(s, b0, std::min(kPassRows, B - b0), n0, len, split_row(s, b0) + n0, N);
    }
    if (arrivals[c].fetch_add(1, std::memory_order_acq_rel) != splits - 1) return;
    for (int64_t b = 0; b < B; ++b) {
      alignas(64) float y[kTileFloats];
      std::copy_n(split_row(0, b) + n0, len, y);
      for (int64_t t = 1; t < splits; ++t) {
        const float* p = split_row(t, b) + n0;
        for (int64_t i = 0; i < len; ++i) y[i] += p[i];
      }
      finish(b, n0, len, y);
    }
  }, helpers);
}

}  // namespace jaxfuse::cpu_decoder
