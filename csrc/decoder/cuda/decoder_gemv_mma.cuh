// The CUDA decoder's tensor-core GEMV work item, for bf16 activations and for fp16 ones with 8-bit
// matrices (mma_gemv(); included by decoder_gemv.cuh only): every weight byte of the item is read
// once for up to kMmaBatch batch rows, so a step's time hardly grows with the batch, where the
// fp32-FMA item re-reads its slice per kBatchPass rows.
//
// y[b, n] = sum_k x[b, k] W[k, n] as mma.sync m16n8k16 (bf16 in, fp32 accumulate) with the
// weights as the 16 x 16 operand A (rows m: output columns, columns: k) and the inputs as the
// 16 x 8 operand B (k x batch rows). A sum over k does not care which k a fragment slot holds, so
// each lane loads its own 4 consecutive rows of 8 consecutive columns (from the weight ring in
// shared memory, below) and a byte permute pairs rows into A's k-pairs; the inputs are staged in
// shared memory in the same k order, so one 16-byte load gives a lane its B fragment. Lane
// (g, q) = (lane / 4, lane % 4) of a warp's 16-row step holds:
//   A: rows 4q .. 4q + 3 of columns 8g .. 8g + 7 of the warp's 64 (mma j takes columns 8g + 2j
//      as m = g and 8g + 2j + 1 as m = g + 8);
//   B: x[8t + g][4q .. 4q + 3] (t: the batch tile);
//   C: batch rows 8t + 2q, 8t + 2q + 1 of columns 8g + 2j (c0, c1) and 8g + 2j + 1 (c2, c3).
// The fp32 inputs are split into bf16 hi + lo (x - hi, exact), two mmas each: products within
// about 2^-17 of fp32's. 8-bit weights are widened to bf16 (exact for int8 and fp8 e4m3).
//
// The block's 256-column tile is 4 warp tiles of 64 columns; warps w and w + 4 share one and take
// alternate 16-row steps of each ring slab, then sum their columns in shared memory in a fixed
// order. The emulator runs the mma as the same sum by warp shuffles.
#pragma once

#include "decoder/cuda/decoder_gemv_job.cuh"
#include "decoder/cuda/decoder_widen.cuh"

namespace jaxfuse::cuda_decoder {

constexpr int kMmaSubTiles = 4;                     // 64-column warp tiles per block tile
constexpr int kMmaPhases = kWarps / kMmaSubTiles;   // warps per warp tile
static_assert(kMmaSubTiles * 64 == GemvTile<DType::kBF16>::kColumns, "block tile of 256 columns");

// D += A B for one m16n8k16 bf16 mma (fragments as the file comment lays them out).
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4],
                                         const uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__)
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  // The emulator: each lane gathers rows g, g + 8 of A and columns 2q, 2q + 1 of B from the lanes
  // holding them (PTX's fragment layout), two registers per shuffle, and sums over k in order.
  const int lane = int(threadIdx.x % 32), g = lane / 4, q = lane % 4;
  const auto pair = [](uint32_t lo, uint32_t hi) { return uint64_t(lo) | uint64_t(hi) << 32; };
  uint64_t rows[4][2], cols[2][4];  // rows[src]: A's registers 0-1, 2-3; cols[c][src]: B's 0-1
  for (int src = 0; src < 4; ++src) {
    rows[src][0] = __shfl_sync(0xffffffffu, pair(a[0], a[1]), g * 4 + src);
    rows[src][1] = __shfl_sync(0xffffffffu, pair(a[2], a[3]), g * 4 + src);
    for (int c = 0; c < 2; ++c) {
      cols[c][src] = __shfl_sync(0xffffffffu, pair(b[0], b[1]), (2 * q + c) * 4 + src);
    }
  }
  // Element h (0, 1) of 32-bit register r (0-3) of a 64-bit pair of registers.
  const auto element = [](const uint64_t* regs, int r, int h) {
    return bf16_to_float(uint16_t(regs[r / 2] >> (32 * (r % 2) + 16 * h)));
  };
  for (int i = 0; i < 4; ++i) {
    const int upper = i / 2, c = i % 2;  // A row g + 8 * upper, B column 2q + c
    for (int k = 0; k < 16; ++k) {
      const int src = k % 8 / 2, h = k % 2, high_k = k / 8;
      d[i] = fmaf(element(rows[src], upper + 2 * high_k, h), element(&cols[c][src], high_k, h),
                  d[i]);
    }
  }
#endif
}

// ---- the weight ring -------------------------------------------------------------------------
// A work item's weights stream through the block's ring of shared-memory slots (dynamic shared
// memory, LaunchPlan::ring_slabs of kRingSlabBytes), filled by cp.async: slab s holds rows
// k0 + s R .. k0 + s R + R - 1 of the item's 256-column block tile (R = RingSlab::kRows: 32 of
// 16-bit weights, 64 of 8-bit ones: a whole slot either way; zero past the item's rows and the
// matrix's columns). ring_slabs - 1 slabs are in flight while one is multiplied, the first ones
// issued before the item waits for its inputs, so the weights stream while the stage boundary's
// chain runs. Row r of a slab keeps 16-byte chunk c at c ^ ring_swizzle(r): a warp's fragment
// loads (4 rows x 8 lanes of one 128-byte span) then fall in distinct banks.
template <DType kW>
struct RingSlab {
  static constexpr int kRowBytes = GemvTile<DType::kBF16>::kColumns * dtype_bytes(kW);
  static constexpr int kChunksPerRow = kRowBytes / 16;
  static constexpr int kRows = kRingSlabBytes / kRowBytes;
  static constexpr int kSteps = kRows / 16 / kMmaPhases;  // 16-row mma steps per warp phase
  static constexpr int kCopiesPerThread = kRows * kChunksPerRow / kThreads;
  static_assert(kCopiesPerThread * kThreads == kRows * kChunksPerRow, "whole rounds");
  static_assert(kSteps * 16 * kMmaPhases == kRows, "whole steps for every warp phase");
  static_assert(kMmaChunk % kRows == 0, "a staged chunk is whole slabs");
  static_assert(kChunksPerRow % 8 == 0, "the swizzle permutes chunks within 128-byte spans");
};

__device__ __forceinline__ int ring_swizzle(int row) { return (row >> 2 & 3) << 1; }

// A work item's slab stream: rows [k0, k1) of its block tile, from `column` on.
template <DType kW>
struct SlabStream {
  using Slab = RingSlab<kW>;
  const char* matrix;
  int64_t columns;
  int column;
  int k0, k1;
  char* ring;
  int slots;  // LaunchPlan::ring_slabs: a power of two

  __device__ int slabs() const { return (k1 - k0 + Slab::kRows - 1) / Slab::kRows; }
  __device__ char* slot(int s) const { return ring + (s & (slots - 1)) * kRingSlabBytes; }

  // Issues slab s's copies (none past the item's last slab) as one commit group: every wait
  // then counts slabs. A thread copies the same 16-byte chunk of rows kRoundRows apart, so its
  // column and first address are formed once and each copy adds the rows' stride.
  __device__ void issue(int s) const {
    constexpr int kBytes = dtype_bytes(kW);
    constexpr int kRoundRows = kThreads / Slab::kChunksPerRow;
    if (s < slabs()) {
      const unsigned t = unsigned(thread_index());
      const int chunk = int(t % Slab::kChunksPerRow), row0 = int(t / Slab::kChunksPerRow);
      const int col = column + chunk * 16 / kBytes;
      // Rows are whole 16-byte chunks (check_kernel_limits): a chunk is in the matrix or past it.
      const bool in_matrix = col < columns;
      const int k = k0 + s * Slab::kRows + row0;
      const char* src = matrix + (int64_t(k) * columns + col) * kBytes;
      const int64_t round_bytes = kRoundRows * columns * kBytes;
      char* dst = slot(s) + row0 * Slab::kRowBytes;
#pragma unroll
      for (int u = 0; u < Slab::kCopiesPerThread; ++u) {
        const int row = row0 + u * kRoundRows;
        const bool copied = in_matrix && k + u * kRoundRows < k1;
        copy_async_16(dst + u * kRoundRows * Slab::kRowBytes + (chunk ^ ring_swizzle(row)) * 16,
                      copied ? src : matrix, copied);
        src += round_bytes;
      }
    }
    commit_async_copies();
  }
};

// Waits for the oldest of the ring's slabs in flight (slots - 1 issued ahead of use), then syncs
// the block: the slab is visible to every warp, and every warp is done with the previous slab,
// whose slot the next issue refills.
__device__ __forceinline__ void await_slab(int slots) {
  if (slots == 4) wait_async_copies<2>();
  else wait_async_copies<0>();
  __syncthreads();
}

// One lane's weights of one 16-row step: rows 4q .. 4q + 3 of its 8 columns.
template <DType kW>
struct MmaStepWeights {
  using Weights = WeightVector<DType::kBF16, kW>;  // 8 columns of kW: 16 or 8 bytes
  Weights row[4];

  // From a ring slab: rows 0 .. 3 from `at`, the lane's chunk of its step's first row (rows are
  // kRowBytes apart; the swizzle is the same for the 16 rows of a step).
  __device__ static MmaStepWeights from_slab(const char* at) {
    using Raw = typename Weights::Raw;
    MmaStepWeights s;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      s.row[r].raw = *reinterpret_cast<const Raw*>(at + r * RingSlab<kW>::kRowBytes);
    }
    return s;
  }

  // A fragment of mma j: columns 2j (m = g), 2j + 1 (m = g + 8); rows (0, 1) and (2, 3) as the
  // two k-pairs.
  __device__ void fragment(int j, uint32_t (&a)[4]) const {
    if constexpr (kW == DType::kBF16) {
      const uint32_t r0 = word(row[0].raw, j), r1 = word(row[1].raw, j);
      const uint32_t r2 = word(row[2].raw, j), r3 = word(row[3].raw, j);
      a[0] = (r0 & 0xffffu) | (r1 << 16);
      a[1] = (r0 >> 16) | (r1 & 0xffff0000u);
      a[2] = (r2 & 0xffffu) | (r3 << 16);
      a[3] = (r2 >> 16) | (r3 & 0xffff0000u);
    } else {
      // Columns 2j, 2j + 1: bytes 2 (j % 2) and the next of each row's word j / 2.
      widen_rows<kW>(word(row[0].raw, j / 2), word(row[1].raw, j / 2), 2 * (j % 2), a[0], a[1]);
      widen_rows<kW>(word(row[2].raw, j / 2), word(row[3].raw, j / 2), 2 * (j % 2), a[2], a[3]);
    }
  }
};

// Stages input rows [r0, r0 + rows) of batch rows b0 .. b0 + nb - 1 (zero past them) as bf16
// hi / lo cells: cell (b, c) holds the hi parts of rows 4c .. 4c + 3, then their lo parts. The
// first chunk of a pass (`first`) also stages 1 / rms of its rows (normalized inputs), its loads
// in flight with the inputs' own: one L2 round trip, not two.
template <typename Input>
__device__ __forceinline__ void stage_mma_inputs(Smem& sm, const Input& in, int b0, int nb,
                                                 int r0, int rows, bool first) {
  constexpr int kCells = kMmaBatch * kMmaChunk / 4;
  constexpr int kPerThread = kCells / kThreads;
  static_assert(kPerThread * kThreads == kCells, "whole rounds");
  const int t = thread_index();
  __syncthreads();  // previous readers of the staging area and of inv_rms are done
  typename Input::Fetched f[kPerThread][4];
#pragma unroll
  for (int u = 0; u < kPerThread; ++u) {
    const int cell = t + u * kThreads, b = cell / (kMmaChunk / 4), c = cell % (kMmaChunk / 4);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = 4 * c + e;
      f[u][e] = b < nb && r < rows ? in.fetch(b0 + b, r0 + r) : typename Input::Fetched{};
    }
  }
  if constexpr (Input::kNormalized) {
    if (first) {
      if (t < nb) sm.inv_rms[t] = in.inv_rms(b0 + t);
      __syncthreads();
    }
  }
#pragma unroll
  for (int u = 0; u < kPerThread; ++u) {
    const int cell = t + u * kThreads, b = cell / (kMmaChunk / 4), c = cell % (kMmaChunk / 4);
    const float inv_rms = Input::kNormalized ? sm.inv_rms[min(b, nb - 1)] : 0.0f;
    uint16_t hi[4], lo[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float v = Input::value_of(f[u][e], inv_rms);
      hi[e] = float_to_bf16(v);
      lo[e] = float_to_bf16(v - bf16_to_float(hi[e]));
    }
    *sm.mma_cell(b, c) = uint4{hi[0] | uint32_t(hi[1]) << 16, hi[2] | uint32_t(hi[3]) << 16,
                               lo[0] | uint32_t(lo[1]) << 16, lo[2] | uint32_t(lo[3]) << 16};
  }
  __syncthreads();
}

template <int kTiles>
using MmaAcc = float[kTiles][4][4];  // [batch tile][mma j][c0..c3]

// A lane's offsets in every ring slab and staged chunk of a pass (formed once a pass, not per
// slab from the thread index): phase p of a warp tile takes the slab's 16-row steps p,
// p + kMmaPhases, ...; lane (g, q) reads rows 4q .. 4q + 3 of each, columns 8g .. 8g + 7 of its
// warp tile, and the inputs' cell of those rows in batch row 8t + g.
template <DType kW>
struct MmaLane {
  int weights;  // bytes from a slab's start to the lane's chunk of its first step's first row
  int cell;     // the index of its input cell of batch tile 0 at a staged chunk's row 0

  __device__ static MmaLane of_thread() {
    const unsigned tid = unsigned(thread_index());  // unsigned: shifts and masks, not divisions
    const int warp = int(tid / 32), g = int(tid % 32 / 4), q = int(tid % 4);
    const int row = 16 * (warp / kMmaSubTiles) + 4 * q;
    const int byte = (warp % kMmaSubTiles * 8 + g) * WeightVector<DType::kBF16, kW>::kBytes;
    return {row * RingSlab<kW>::kRowBytes + ((byte >> 4) ^ ring_swizzle(row)) * 16 + (byte & 15),
            g * kMmaCellsPerRow + row / 4};
  }
};

// acc += this warp's steps of a ring slab, whose inputs are the staged chunk's rows from
// chunk_row on. kTiles: batch tiles of 8 rows (1 or 2).
template <DType kW, int kTiles>
__device__ __forceinline__ void mma_slab(const Smem& sm, const char* slab, int chunk_row,
                                         const MmaLane<kW>& lane, MmaAcc<kTiles>& acc) {
  constexpr int kSteps = RingSlab<kW>::kSteps, kStepRows = 16 * kMmaPhases;
  MmaStepWeights<kW> w[kSteps];
#pragma unroll
  for (int st = 0; st < kSteps; ++st) {
    w[st] = MmaStepWeights<kW>::from_slab(slab + lane.weights +
                                          st * kStepRows * RingSlab<kW>::kRowBytes);
  }
  const uint4* cells = sm.mma_cell(0, 0) + lane.cell + chunk_row / 4;
#pragma unroll
  for (int st = 0; st < kSteps; ++st) {
    uint4 x[kTiles];
#pragma unroll
    for (int t = 0; t < kTiles; ++t) x[t] = cells[8 * t * kMmaCellsPerRow + st * kStepRows / 4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t a[4];
      w[st].fragment(j, a);
#pragma unroll
      for (int t = 0; t < kTiles; ++t) {
        mma_bf16(acc[t][j], a, {x[t].x, x[t].y});  // hi
        mma_bf16(acc[t][j], a, {x[t].z, x[t].w});  // lo
      }
    }
  }
}

// Sums the two phases' columns (fixed order) and writes one partial per (work item, batch row):
// `partials` is the item's first row's (GemvJob::partial).
template <int kTiles>
__device__ __forceinline__ void write_mma_partials(Smem& sm, const MmaAcc<kTiles>& acc,
                                                   float* partials, int nb) {
  constexpr int kColumns = GemvTile<DType::kBF16>::kColumns;
  const int t = thread_index(), warp = t / 32, lane = t % 32, g = lane / 4, q = lane % 4;
  const int phase = warp / kMmaSubTiles, base = warp % kMmaSubTiles * 64 + 8 * g;
  __syncthreads();
#pragma unroll
  for (int bt = 0; bt < kTiles; ++bt) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int b = 8 * bt + 2 * q + i % 2, c = base + 2 * j + i / 2;
        sm.mma_sums(phase, b)[c] = acc[bt][j][i];
      }
    }
  }
  __syncthreads();
  // The item's partials of rows b0 .. b0 + nb - 1 are contiguous (decoder.h: tile() columns a row).
  for (int i = t; i < nb * kColumns; i += kThreads) {
    const int b = i / kColumns, c = i % kColumns;
    float sum = 0.0f;
#pragma unroll
    for (int ph = 0; ph < kMmaPhases; ++ph) sum += sm.mma_sums(ph, b)[c];
    ws_store(partials + i, sum);
  }
}

// One pass of a work item (its slab stream) for batch rows b0 .. b0 + nb - 1: the ring's first
// slabs are issued before the inputs are staged (the first pass's before the item waits for them).
template <DType kW, int kTiles, typename Input, typename Await>
__device__ __forceinline__ void mma_pass(Smem& sm, const SlabStream<kW>& stream, const Input& in,
                                         const Await& await_inputs, float* partials, int b0,
                                         int nb) {
  MmaAcc<kTiles> acc;
#pragma unroll
  for (int t = 0; t < kTiles; ++t)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[t][j][i] = 0.0f;
  for (int s = 0; s + 1 < stream.slots; ++s) stream.issue(s);
  if (b0 == 0) await_inputs();
  const MmaLane<kW> lane = MmaLane<kW>::of_thread();
  for (int s = 0; s < stream.slabs(); ++s) {
    const int chunk_row = s * RingSlab<kW>::kRows % kMmaChunk;
    const int r0 = stream.k0 + s * RingSlab<kW>::kRows;
    if (chunk_row == 0) {
      stage_mma_inputs(sm, in, b0, nb, r0, min(kMmaChunk, stream.k1 - r0), /*first=*/s == 0);
    }
    await_slab(stream.slots);
    stream.issue(s + stream.slots - 1);
    mma_slab<kW, kTiles>(sm, stream.slot(s), chunk_row, lane, acc);
  }
  write_mma_partials<kTiles>(sm, acc, partials, nb);
}

// Work item `item` of a GEMV job (bf16 activations): one column tile's partial sums over one
// split of K for every batch row, kMmaBatch rows per pass (8 when no more are left).
template <DType kW, typename Input, typename Await>
__device__ __forceinline__ void mma_gemv_item(const DecoderParams& p, Smem& sm,
                                              const GemvJob& job, const Input& in, int item,
                                              const Await& await_inputs) {
  const int split = item % job.splits;
  const MatrixTile mt = locate_tile(job, item / job.splits);
  const int k0 = job.split_row(split), k1 = job.split_row(split + 1);
  const SlabStream<kW> stream{static_cast<const char*>(mt.matrix.weights), mt.matrix.columns,
                              mt.tile * GemvTile<DType::kBF16>::kColumns, k0, k1,
                              dynamic_shared_memory(), p.plan.ring_slabs};
  prefetch_rows<DType::kBF16, kW>(mt, k0, k1);
  for (int b0 = 0; b0 < p.dims.batch; b0 += kMmaBatch) {
    const int nb = min(kMmaBatch, p.dims.batch - b0);
    float* partials = job.partial(p, item, b0);
    if (nb > 8) mma_pass<kW, 2>(sm, stream, in, await_inputs, partials, b0, nb);
    else mma_pass<kW, 1>(sm, stream, in, await_inputs, partials, b0, nb);
  }
}

}  // namespace jaxfuse::cuda_decoder
