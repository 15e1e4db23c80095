// The CUDA decoder's GEMV engine (included by cuda/decoder.cu only): the fp32-FMA work item for
// fp32 activations and fp16 matrices under fp16 ones (the others run on tensor cores, mma_gemv():
// decoder_gemv_mma.cuh), the stage loop, the split-K finish and the L2 prefetch shared by both.
// Weights [K, N], N contiguous, of dtype kW: the activations' kT, or int8 / fp8 e4m3 with
// per-column scales (weight-only quantization: y[n] = scale[n] * sum_k a[k] * W[k, n]). A column
// tile is 32 lanes x kVec columns (GemvTile<kT>: 256 columns of a 16-bit kT, 128 of fp32), so every
// warp load is contiguous: 512 bytes, or 256 / 128 of 8-bit weights. A work item is (tile, split of
// K); the 8 warps of a block take interleaved groups of kRowsInFlight rows (128 bytes of loads in
// flight per lane: 8 rows of 16-byte vectors, 16 or 32 of 8-bit ones), accumulate fp32 for up to
// kBatchPass batch rows (more rows: another pass over the same, now L1/L2-resident, weight slice),
// reduce across warps in shared memory and write one partial per (item, batch row) to the
// workspace. The last block to finish a tile (an atomic counter, release/acquire by __threadfence)
// sums batch row 0's partials of all splits in a fixed order, so results are deterministic, and
// runs the stage's finish() on it (scales, residual add, SwiGLU, sums of squares for the next
// RMSNorm); finish items after the split items do the same for the other batch rows, one block
// each, and the last marks the tile finished for the items of later stages that wait for it.
//
// Weights never wait for activations: every item asks L2 for its first rows before it waits for
// its inputs (prefetch_rows); on the FMA path a chunk's first row group is loaded before its
// inputs are staged (the 1 / rms and input reads from L2 overlap it), on the tensor-core path the
// weight ring's first slabs are copied to shared memory before the wait. Sums over workspace
// values (1 / rms, the splits) keep several loads in flight (ordered_sum).
#pragma once

#include "decoder/cuda/decoder_gemv_job.cuh"
#include "decoder/cuda/decoder_gemv_mma.cuh"

namespace jaxfuse::cuda_decoder {

// Stages input rows [r0, r0 + rows) of batch rows b0 .. b0 + nb - 1 in shared memory as
// staged[bb][r] (zero past `rows`): every thread's values loaded before any is stored.
template <typename Input>
__device__ __forceinline__ void stage_inputs(Smem& sm, const Input& in, int b0, int nb, int r0,
                                             int rows) {
  constexpr int kPerThread = kBatchPass * kKChunk / kThreads;
  static_assert(kPerThread * kThreads == kBatchPass * kKChunk, "whole rounds");
  __syncthreads();  // previous readers of the staging area are done; inv_rms is written
  const int t = thread_index();
  float v[kPerThread];
#pragma unroll
  for (int u = 0; u < kPerThread; ++u) {
    const int i = t + u * kThreads, bb = i / kKChunk, r = i % kKChunk;
    const float inv_rms = Input::kNormalized ? sm.inv_rms[min(bb, nb - 1)] : 0.0f;
    v[u] = bb < nb && r < rows ? in.value(b0 + bb, r0 + r, inv_rms) : 0.0f;
  }
#pragma unroll
  for (int u = 0; u < kPerThread; ++u) sm.staged[t + u * kThreads] = v[u];
  __syncthreads();
}

// The weight vectors a lane multiplies: columns [column, column + kVec) of a [K, columns] matrix.
struct LaneColumns {
  const char* matrix;
  int columns;
  int column;
  bool valid;  // column < columns (columns % kVec == 0, checked on the host)
};

template <DType kT>
using GemvAcc = float[kBatchPass][GemvTile<kT>::kVec];

// The weight vectors of the kRowsInFlight rows from rb of a lane's columns, loaded before any is
// used (zero past `rows`).
template <DType kT, DType kW>
struct RowGroup {
  using Weights = WeightVector<kT, kW>;
  static constexpr int kRows = Weights::kRowsInFlight;
  Weights w[kRows];

  __device__ static RowGroup load(const LaneColumns& lc, int r0, int rb, int rows) {
    RowGroup g;
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      const int r = rb + u;
      const int64_t at = int64_t(r0 + r) * lc.columns + lc.column;
      g.w[u] = lc.valid && r < rows ? Weights::load(lc.matrix, at) : Weights::zero();
    }
    return g;
  }

  // acc[bb][v] += staged[bb][rb + u] * w[u][v]
  __device__ void accumulate(const Smem& sm, int rb, int nb, GemvAcc<kT>& acc) const {
    constexpr int kVec = Weights::kVec;
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      float wf[kVec];
      w[u].unpack(wf);
      const int r = min(rb + u, kKChunk - 1);  // rows past `rows` have zero weights
#pragma unroll
      for (int bb = 0; bb < kBatchPass; ++bb) {
        if (bb < nb) {
          const float a = sm.staged[bb * kKChunk + r];
#pragma unroll
          for (int v = 0; v < kVec; ++v) acc[bb][v] = fmaf(a, wf[v], acc[bb][v]);
        }
      }
    }
  }
};

// This warp's first row group of a chunk: warps take interleaved groups of kRows rows.
template <DType kT, DType kW>
__device__ __forceinline__ int first_group_row() {
  return thread_index() / 32 * RowGroup<kT, kW>::kRows;
}

// acc over this warp's staged rows of a chunk, its first group already loaded (`first`, in
// flight while the inputs were staged); each later group's loads all issued before its math.
template <DType kT, DType kW>
__device__ __forceinline__ void accumulate_rows(const Smem& sm, const LaneColumns& lc, int r0,
                                                int rows, int nb, RowGroup<kT, kW> group,
                                                GemvAcc<kT>& acc) {
  constexpr int kStride = kWarps * RowGroup<kT, kW>::kRows;
  int rb = first_group_row<kT, kW>();
  if (rb >= rows) return;
  while (true) {
    group.accumulate(sm, rb, nb, acc);
    rb += kStride;
    if (rb >= rows) break;
    group = RowGroup<kT, kW>::load(lc, r0, rb, rows);
  }
}

// Sums acc over the warps (fixed order) and writes one partial per (work item, batch row).
template <DType kT>
__device__ __forceinline__ void write_partials(const DecoderParams& p, Smem& sm,
                                               const GemvJob& job, const GemvAcc<kT>& acc,
                                               int item, int b0, int nb) {
  constexpr int kVec = GemvTile<kT>::kVec;
  constexpr int kColumns = GemvTile<kT>::kColumns;
  const int t = thread_index(), warp = t / 32, lane = t % 32;
  __syncthreads();
#pragma unroll
  for (int bb = 0; bb < kBatchPass; ++bb) {
    float* sums = sm.gemv_warp_sums(warp, bb, kColumns) + lane * kVec;
#pragma unroll
    for (int v = 0; v < kVec; ++v) sums[v] = acc[bb][v];
  }
  __syncthreads();
  for (int i = thread_index(); i < nb * kColumns; i += kThreads) {
    const int bb = i / kColumns, c = i % kColumns;
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += sm.gemv_warp_sums(w, bb, kColumns)[c];
    ws_store(job.partial(p, item, b0 + bb) + c, sum);
  }
}

// Work item `item` of a GEMV job: one column tile's partial sums over one split of K, for every
// batch row (kBatchPass rows per pass over the weight slice).
template <DType kT, DType kW, typename Input, typename Await>
__device__ __forceinline__ void gemv_item(const DecoderParams& p, Smem& sm, const GemvJob& job,
                                          const Input& in, int item, const Await& await_inputs) {
  if constexpr (mma_gemv(kT, kW)) {
    mma_gemv_item<kW>(p, sm, job, in, item, await_inputs);
    return;
  }
  constexpr int kVec = GemvTile<kT>::kVec;
  const int split = item % job.splits;
  const MatrixTile mt = locate_tile(job, item / job.splits);
  const GemvMatrix& m = mt.matrix;
  const int column = mt.tile * GemvTile<kT>::kColumns + thread_index() % 32 * kVec;
  const LaneColumns lc{static_cast<const char*>(m.weights), m.columns, column, column < m.columns};
  const int k0 = job.split_row(split), k1 = job.split_row(split + 1);
  // The item's first rows are asked of L2 before it waits for its inputs. (The tensor-core item
  // also loads its first row group before the wait; here that raised the fp16 instances' spills.)
  prefetch_rows<kT, kW>(mt, k0, k1);
  await_inputs();
  for (int b0 = 0; b0 < p.dims.batch; b0 += kBatchPass) {
    const int nb = min(kBatchPass, p.dims.batch - b0);
    GemvAcc<kT> acc;
#pragma unroll
    for (int bb = 0; bb < kBatchPass; ++bb)
#pragma unroll
      for (int v = 0; v < kVec; ++v) acc[bb][v] = 0.0f;
    // Each chunk's first weight loads are issued before its inputs are staged: they depend on
    // no activation, so the staging's L2 round trips (1 / rms, the inputs) overlap them.
    for (int r0 = k0; r0 < k1; r0 += kKChunk) {
      const int rows = min(kKChunk, k1 - r0);
      const auto first = RowGroup<kT, kW>::load(lc, r0, first_group_row<kT, kW>(), rows);
      if (r0 == k0) stage_inv_rms(sm, in, b0, nb);
      stage_inputs(sm, in, b0, nb, r0, rows);
      accumulate_rows<kT, kW>(sm, lc, r0, rows, nb, first, acc);
    }
    write_partials<kT>(p, sm, job, acc, item, b0, nb);
  }
}

// This block's first work item of a GEMV stage, asked of L2 ahead of the stages before it.
template <DType kT, DType kW, typename Stage>
__device__ __forceinline__ void prefetch_gemv(const Stage& stage) {
  const GemvJob job = stage.job();
  const int item = blockIdx.x;
  if (item >= stage.plan().items) return;
  const int split = item % job.splits;
  prefetch_rows<kT, kW>(locate_tile(job, item / job.splits), job.split_row(split),
                        job.split_row(split + 1));
}

// Counts one finished batch row of a group whose split items have all arrived (`arrivals`); the
// last of its rows marks the group finished for the stages that wait for it.
__device__ __forceinline__ void finish_row_done(const DecoderParams& p, Smem& sm, int* counter,
                                                int arrivals) {
  if (p.dims.batch == 1 || arrive_last(counter, arrivals + p.dims.batch, &sm.flag)) {
    mark_finished(counter);
  }
}

// Runs a GEMV stage: its work items over the grid, each waiting for its inputs
// (stage.await_inputs: the counters of the items that write them) once its first weights are
// asked for, then its finish items. A tile group's finish (stage.finish(job, group, b): the sum
// over its splits' partials with split_sum(), then scales, residual add or SwiGLU) is spread
// over blocks by batch row: the last split item to arrive finishes row 0, a finish item (group,
// row) each of the others, so a stage's finish chain does not grow with the batch. Finish items
// follow the stage's split items in every block's order and wait only for them, so every wait
// ends; the group is finished when all its rows are. (One loop, one finish() call site and the
// job formed per item from an opaque() layer: a second inlined finish, or a job kept across the
// items, spilled the kernel at 128 registers.)
template <DType kT, DType kW, typename Stage>
__device__ __forceinline__ void run_gemv(const Stage& stage) {
  const auto input = stage.input();
  const GemvPlan& plan = stage.plan();
  for (int item = blockIdx.x; item < plan.all_items; item += gridDim.x) {
    const GemvJob job = stage.job();
    int group, b = 0;
    if (item < plan.items) {
      gemv_item<kT, kW>(stage.p, stage.sm, job, input, item,
                        [&] { stage.await_inputs(job, item); });
      group = job.group(opaque(item) / job.splits);  // not kept across the item
      if (!arrive_last(stage.counter(group), plan.arrivals, &stage.sm.flag)) continue;
    } else {
      group = (item - plan.items) % plan.groups;
      b = 1 + (item - plan.items) / plan.groups;
      await_arrivals(stage.p.run.chained, stage.sm.clock, stage.counter(group), plan.arrivals);
    }
    stage.finish(job, group, b);
    finish_row_done(stage.p, stage.sm, stage.counter(group), plan.arrivals);
  }
}

// Partial sums a finish loads before it adds any: the tensor-core (bf16) instances, whose
// weights stream through shared memory, have the registers for 36 (the O and down projections'
// 33 splits on an H100's 264 blocks in one L2 round trip instead of 3); the FMA ones keep 12.
template <DType kT>
constexpr int kSplitLoads = kT == DType::kBF16 ? 36 : kLoadsInFlight;

// Sum over the splits (fixed order: deterministic) of stage tile `tile`'s partials at (b, c).
template <DType kT>
__device__ __forceinline__ float split_sum(const DecoderParams& p, const GemvJob& job, int tile,
                                           int b, int c) {
  return ordered_sum<kSplitLoads<kT>>(job.splits, [&](int s) {
    return ws_load(job.partial(p, tile * job.splits + s, b) + c);
  });
}

// Finishes batch row b of a residual GEMV tile of matrix m (O and down projections): h += y,
// the tile's sum of squares for the next RMSNorm, and after the last layer the output row.
template <DType kT, DType kW>
__device__ void add_residual(const DecoderParams& p, Smem& sm, const GemvJob& job, int tile,
                             int b, bool last_layer) {
  const GemvMatrix& m = job.matrix[0];
  constexpr int kColumns = GemvTile<kT>::kColumns;
  const int c = thread_index();
  const int col = tile * kColumns + c;
  float sq = 0.0f;
  if (c < kColumns && col < p.dims.hidden) {
    float* h = p.ws.hidden.at(b, col);
    const float hn = ws_load(h) + apply_scale<kT, kW>(m, col, split_sum<kT>(p, job, tile, b, c));
    ws_store(h, hn);
    sq = hn * hn;
    if (last_layer) {
      const bool valid = position_valid(p.io.row_position(b, p.dims.vocab), p.dims.max_seq_len);
      store_from_float(p.io.out, kT, int64_t(b) * p.dims.hidden + col,
                       valid ? hn : quiet_nan_f32());
    }
  }
  store_tile_sumsq(p, sm, b, tile, sq);
}

}  // namespace jaxfuse::cuda_decoder
