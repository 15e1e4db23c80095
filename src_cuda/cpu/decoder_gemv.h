// The CPU decoder's GEMV engine: y[b, :] = a[b, :] @ W for the B rows of a decode step, over
// XLA's intra-op thread pool. The micro-kernel and its ISA versions are decoder_gemv.cc.
//
// A decode GEMV streams every weight once per step for only B rows, so it is bound by how fast
// the weights arrive and how cheaply each is widened and used B times:
//  - memory order: W [K, N] is walked k-row by k-row, each row's span of a work item read front
//    to back (the hardware prefetchers follow that; walking a narrow column strip down K, one
//    cache line per 1-3 KB row, runs at a quarter of the bandwidth on this class of machine);
//  - registers: the micro-kernel (gemv_tile) keeps an MR-row x NS-strip accumulator tile in
//    registers over kStepRows k rows, widens each weight vector once for its MR rows and
//    broadcasts a[r, k] against it. Between steps the accumulators wait in an L1-resident tile.
// Every output is summed over k in ascending order, one fp32 multiply and one add per term
// (no FMA contraction: see CMakeLists.txt), whatever the blocking, the vector width, the dtype's
// load path and the thread count: results are deterministic and equal to the plain loop's.
#pragma once

#include <algorithm>
#include <cstdint>

#include "jaxfuse/decoder.h"

#include "cpu_common.h"

namespace jaxfuse::cpu_decoder {

// The accumulator tile of one work item: at most kPassRows batch rows x (kTileFloats / rows)
// columns of fp32, 16 KB, half of L1. Batches above kPassRows take further passes over W.
constexpr int64_t kTileFloats = 4096;
constexpr int64_t kPassRows = 16;
// Below this many multiply-adds a stage runs on the calling thread: handing work to the pool
// costs more than it saves for small models.
constexpr int64_t kMinParallelWork = int64_t(1) << 17;

inline ffi::ThreadPool* pool_for(ffi::ThreadPool* pool, int64_t work) {
  return work >= kMinParallelWork ? pool : nullptr;
}

// y[r, 0:len] (row stride len) = sum_k a[r, k] * W[k, n0 + 0:len] for r < rows, where
// rows * round_up(len, 32) <= kTileFloats; a fp32 with row stride lda, W [K, N] in storage
// `dtype`.
void gemv_pass(int64_t rows, const float* a, int64_t lda, const void* W, DType dtype, int64_t K,
               int64_t N, int64_t n0, int64_t len, float* y);

// Columns per GEMV work item: as many as the accumulator tile holds for min(B, kPassRows) rows,
// but no more than N / threads, so every thread gets one.
int64_t gemv_item_width(int64_t B, int64_t N, int64_t threads);

// One layer's matrix W [K, N] in storage `dtype` (int8 and fp8 with per-column `scale` [N],
// else scale null).
struct GemvWeights {
  const void* data;
  DType dtype;
  const float* scale;
  int64_t K, N;
};

// y[b, n] = scale[n] * sum_k a[b, k] * W[k, n] (no scale: 1) for the B rows of `a` (fp32, row
// stride lda). Work items are column ranges, as wide as the accumulator tile allows (long
// sequential runs of each weight row) but at least one per thread; each covers all rows and all
// of K, so its sums do not depend on who computes it. epilogue(b, n0, len, y) receives each
// finished range of a row (fp32).
template <typename Epilogue>
void gemv(ffi::ThreadPool* pool, int64_t B, const float* a, int64_t lda, const GemvWeights& w,
          const Epilogue& epilogue) {
  const int64_t K = w.K, N = w.N;
  pool = pool_for(pool, B * K * N);
  const int64_t helpers = helpers_beside_caller(pool);
  const int64_t width = gemv_item_width(B, N, helpers + 1);
  parallel_for(pool, (N + width - 1) / width, [&](int64_t item) {
    const int64_t n0 = item * width;
    const int64_t len = std::min(width, N - n0);
    alignas(64) float y[kTileFloats];
    for (int64_t b0 = 0; b0 < B; b0 += kPassRows) {
      const int64_t rows = std::min(kPassRows, B - b0);
      gemv_pass(rows, a + b0 * lda, lda, w.data, w.dtype, K, N, n0, len, y);
      for (int64_t r = 0; r < rows; ++r) {
        float* yr = y + r * len;
        if (w.scale != nullptr) {
          for (int64_t i = 0; i < len; ++i) yr[i] *= w.scale[n0 + i];
        }
        epilogue(b0 + r, n0, len, yr);
      }
    }
  }, helpers);
}

}  // namespace jaxfuse::cpu_decoder
