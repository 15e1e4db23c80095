// The CUDA decoder kernel's shared pieces (included by cuda/decoder.cu only, with the other
// decoder_*.cuh stage files): launch constants, the kernel's parameters, workspace access from
// other blocks, the last-block counter and the block's shared memory.
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include "decoder/decoder.h"
#include "core/cuda/common.cuh"
#include "decoder/cuda/decoder_widen.cuh"

namespace jaxfuse::cuda_decoder {

namespace cg = cooperative_groups;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kBatchPass = 4;     // batch rows accumulated per pass over a weight slice
constexpr int kInFlight = 128;    // GEMV weight bytes a lane loads before using them
constexpr int kKChunk = 256;      // GEMV input rows staged in shared memory at a time
constexpr int kMaxHeadDim = 256;  // the shared-memory staging of a chunk's heads
constexpr int kHeadChunk = int(kDecHeadChunk);
// Blocks per SM, which caps registers at 65536 / (kThreads * blocks): 2 (128 registers; the
// kernel report holds the kernel to no spills there, see thread_index()).
// JAXFUSE_DECODER_BLOCKS_PER_SM is a tuning switch for tools/gpu_check.sh's variants stage.
#ifndef JAXFUSE_DECODER_BLOCKS_PER_SM
#define JAXFUSE_DECODER_BLOCKS_PER_SM 2
#endif
constexpr int kMaxBlocksPerSm = JAXFUSE_DECODER_BLOCKS_PER_SM;
constexpr int kMaxTile = 256;  // columns per tile for 16-bit dtypes
// The tensor-core GEMV (bf16 activations, decoder_gemv_mma.cuh): batch rows per pass, input rows
// staged per chunk, and the 16-byte cells of one staged batch row (4 of padding put two batch
// rows in one 128-byte shared-memory wavefront).
constexpr int kMmaBatch = 16;
constexpr int kMmaChunk = 128;
constexpr int kMmaCellsPerRow = kMmaChunk / 4 + 4;
constexpr int kStaged = kMmaBatch * kMmaCellsPerRow * 4;  // floats of the shared staging area
// The tensor-core GEMV's weight ring (decoder_gemv_mma.cuh): a slot per slab of a 256-column
// tile (32 rows of bf16 weights, 64 of 8-bit ones), 4 slots where two blocks an SM still fit (an
// H100's 228 KB of shared memory an SM), else 2 (an A100's 164 KB): ring_slots().
constexpr int kRingSlabBytes = 32 * kMaxTile * 2;
constexpr int kMaxRingSlots = 4;

// Whether decoder_kernel's layer GEMVs run on tensor cores (decoder_gemv_mma.cuh): under bf16
// activations, and under fp16 ones with 8-bit matrices, which widen to bf16 exactly (the inputs
// are split into bf16 hi + lo either way). fp16 matrices do not fit bf16 and keep the FMA GEMV,
// as fp32 activations do.
JF_HD constexpr bool mma_gemv(DType activations, DType weights) {
  return activations == DType::kBF16 || (activations == DType::kF16 && dtype_bytes(weights) == 1);
}
// Whether the LM head runs on tensor cores (decoder_head_mma.cuh, its inputs staged in the weight
// ring's memory): under bf16 activations only, whose instances always have a ring.
JF_HD constexpr bool mma_head(DType activations) { return activations == DType::kBF16; }

static_assert(kHeadChunk == 4, "attention accumulators are sized for 4 heads");
static_assert(kHeadChunk + 1 <= kWarps, "per-head q/k RMSNorm takes one warp per staged head");

// ---- kernel parameters -----------------------------------------------------------------------

// The sizes as ints (run<Cuda> checks the kernel limits) and the counts derived from them.
struct KernelDims {
  int layers, batch, hidden, kv_heads, head_dim, intermediate, max_seq_len;
  int q_dim, kv_dim;  // heads * head_dim, kv_heads * head_dim
  int group;          // query heads per kv head
  int head_chunks;    // chunks of <= kHeadChunk query heads per kv head
  int hidden_tiles, q_tiles, kv_tiles, mlp_tiles;  // GEMV column tiles of each output width
  float rms_eps;
  float attn_scale;  // 1 / sqrt(head_dim)
  // The flags (decoder.h; the kernels take `quantized` from their matrices' type kW, a template
  // argument, instead). The whole-model step
  // (decoder_head.cuh): tokens in, logits of `vocab` rows out (vocab 0 otherwise), and with
  // `sample` the next tokens at `temperature` (0: greedy), from the scores top_k (0: all) and
  // top_p (1: all) keep.
#define JF_KERNEL_FLAG_FIELD(name) bool name;
  JAXFUSE_DECODER_FLAGS(JF_KERNEL_FLAG_FIELD)
  JAXFUSE_DECODER_STEP_FLAGS(JF_KERNEL_FLAG_FIELD)
#undef JF_KERNEL_FLAG_FIELD
  float temperature;
  int vocab;
  int top_k;
  float top_p;
};

// How one launch splits the work over its grid (decoder_plan.h's StagePlan, the same in both
// schedules), its LM head's and weight ring's shape, and which of the call's slots it runs.
struct LaunchPlan : StagePlan {
  int head_rows;   // batch rows per pass of the LM head (its inputs staged in shared memory)
  int ring_slabs;  // slots of the tensor-core GEMV's weight ring (2 or 4; mma_gemv())
};

// The call's slots this launch runs (decoder_plan.h's stage_slot(), head_slot()...), [first,
// last), those of layers [first_layer, last_layer): all of them in the persistent schedule's one
// launch, one in each launch of the stage-kernel schedule (`chained`: its blocks wait for the
// launch before, wait_for_prior_grids(), where the persistent kernel's blocks wait on counters).
struct LaunchSlots {
  int first, last;
  int first_layer, last_layer;
  bool chained;

  __device__ bool runs(int slot) const { return slot >= first && slot < last; }
};

struct DecoderParams {
  KernelDims dims;
  DecoderBuffers io;  // operands and results
  DecoderWorkspace ws;
  LaunchPlan plan;
  LaunchSlots run;

  // The call's slots (decoder_plan.h's slots_run()).
  int slots() const { return int(slots_run(dims.layers, dims.model_step, dims.sample)); }
};

// ---- device helpers ----------------------------------------------------------------------------

// threadIdx.x, read where it is used: values derived from it cannot be hoisted out of the
// persistent kernel's layer loop (ptxas would keep dozens of them live across every stage and
// spill them).
__device__ __forceinline__ int thread_index() {
#if defined(__CUDA_ARCH__)
  int t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return t;
#else
  return int(threadIdx.x);
#endif
}

// blockIdx.x, read where it is used (as thread_index()), in code after the layer loop: a use
// there of the value the loop keeps made ptxas spill it for the whole kernel.
__device__ __forceinline__ int block_index() {
#if defined(__CUDA_ARCH__)
  int b;
  asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(b));
  return b;
#else
  return int(blockIdx.x);
#endif
}

// x, as a value the compiler cannot see through, so what is derived from it is formed where it
// is used: values derived from the layer, the item or the sizes would otherwise be hoisted out of
// the work-item loops (or the layer loop) and kept, spilled at 128 registers, across them.
__device__ __forceinline__ int opaque(int x) {
#if defined(__CUDA_ARCH__)
  asm volatile("mov.b32 %0, %0;" : "+r"(x));
#endif
  return x;
}

// The attention stages' head_dim (their float, vector counts and offsets formed per use: see
// opaque()).
__device__ __forceinline__ int head_dim_of(const KernelDims& d) { return opaque(d.head_dim); }

// The GEMV column tile of activation dtype kT: 32 lanes x kVec columns, kVec the elements of kT
// in 16 bytes. The tile does not depend on the weights' dtype, so neither do the workspace's
// layout, tiles and counters (decoder.h).
template <DType kT>
struct GemvTile {
  static constexpr int kBytes = kT == DType::kF32 ? 4 : 2;
  static constexpr int kVec = 16 / kBytes;  // columns per lane
  static constexpr int kColumns = 32 * kVec;
};

// The raw words of one vector load of kBytes bytes, and word i of them.
template <int kBytes>
struct VectorLoad;
template <>
struct VectorLoad<16> {
  using Raw = uint4;
};
template <>
struct VectorLoad<8> {
  using Raw = uint2;
};
template <>
struct VectorLoad<4> {
  using Raw = uint32_t;
};
__device__ __forceinline__ uint32_t word(const uint4& r, int i) {
  return i == 0 ? r.x : i == 1 ? r.y : i == 2 ? r.z : r.w;
}
__device__ __forceinline__ uint32_t word(const uint2& r, int i) { return i == 0 ? r.x : r.y; }
__device__ __forceinline__ uint32_t word(uint32_t r, int) { return r; }

// The weights a lane multiplies per row of a GemvTile<kT> column tile: kVec consecutive
// elements of the matrices' dtype kW (kT, or int8 / fp8 e4m3 when quantized), one vector load
// of 16 bytes (kW == kT) or kVec bytes (8-bit kW: 8 for 16-bit kT, 4 for fp32).
template <DType kT, DType kW>
struct WeightVector {
  static constexpr int kVec = GemvTile<kT>::kVec;
  static constexpr int kElementBytes = kW == kT ? GemvTile<kT>::kBytes : 1;
  static constexpr int kBytes = kVec * kElementBytes;
  static constexpr int kPerWord = 4 / kElementBytes;
  // Rows whose vectors a lane loads before using them: kInFlight bytes, so 8-bit weights keep
  // as many bytes in flight in the same raw registers (8 rows of 16 bytes, 16 of 8, 32 of 4).
  static constexpr int kRowsInFlight = kInFlight / kBytes;
  using Raw = typename VectorLoad<kBytes>::Raw;

  Raw raw;

  // The vector at element `at` of `matrix` (kBytes-aligned: run<Cuda> checks the buffers and
  // the columns).
  __device__ static WeightVector load(const char* matrix, int64_t at) {
    return {__ldg(reinterpret_cast<const Raw*>(matrix + at * kElementBytes))};
  }
  __device__ static WeightVector zero() { return {Raw{}}; }

  // The kVec weights as fp32: exact for every kW (8-bit ones a word at a time, without the
  // conversion unit: decoder_widen.cuh).
  __device__ void unpack(float* o) const {
    if constexpr (kElementBytes == 1) {
#pragma unroll
      for (int j = 0; j < kVec / 4; ++j) widen_floats<kW>(word(raw, j), o + 4 * j);
    } else {
#pragma unroll
      for (int i = 0; i < kVec; ++i) o[i] = at(i);
    }
  }
  // Weight i (a compile-time index) as fp32.
  __device__ float at(int i) const {
    const uint32_t w = word(raw, i / kPerWord);
    if constexpr (kW == DType::kF32) {
      return __uint_as_float(w);
    } else {
      constexpr int kBits = 8 * kElementBytes;
      using Bits = typename Storage<kW>::Bits;
      return Storage<kW>::template load<float>(
          Bits((w >> (kBits * (i % kPerWord))) & ((1u << kBits) - 1)));
    }
  }
};

// Workspace values written by other blocks in this launch: read from L2, never a stale L1 line.
__device__ __forceinline__ float ws_load(const float* p) { return __ldcg(p); }
__device__ __forceinline__ void ws_store(float* p, float v) { __stcg(p, v); }

// sum(load(i) for i < n), added in index order (the bits of a serial loop: deterministic), in
// rounds of kInFlight loads issued before any is added: with 12, 33 splits wait for 3 L2 round
// trips, 22 for 2 and a row's 8 tile sums for 1, where nvcc's unrolling of a serial loop (rounds
// of 16 loads, then 4, then 1) takes 3, 4 and 2. 16 would spill in the fp32 instances.
constexpr int kLoadsInFlight = 12;
template <int kInFlight = kLoadsInFlight, typename Load>
__device__ __forceinline__ float ordered_sum(int n, const Load& load) {
  float s = 0.0f;
  for (int i0 = 0; i0 < n; i0 += kInFlight) {
    float v[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) v[u] = i0 + u < n ? load(i0 + u) : 0.0f;
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      if (i0 + u < n) s += v[u];
    }
  }
  return s;
}

// Asks L2 to fetch the 16-byte words within [p, p + bytes) without waiting for them: weights never
// depend on activations, so the next stage's are fetched while this one finishes and the grid
// syncs. One bulk request on sm_90, one per 128-byte line before; nothing on the emulator.
__device__ __forceinline__ void prefetch_l2(const void* p, int bytes) {
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + 15) & ~uintptr_t(15);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~uintptr_t(15);
  if (end <= begin) return;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(begin), "r"(unsigned(end - begin))
               : "memory");
#elif defined(__CUDA_ARCH__)
  for (uintptr_t at = begin; at < end; at += 128) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(at));
  }
#endif
}

// Release this block's writes and count its arrival; true in every thread of the last block
// to arrive (which then sees every arrived block's writes).
__device__ __forceinline__ bool arrive_last(int* counter, int expected, int* flag) {
  __threadfence();  // release: this thread's partials are visible device-wide
  __syncthreads();  // ...for every thread of the block
  if (thread_index() == 0) *flag = atomicAdd(counter, 1) == expected - 1;
  __syncthreads();
  const bool last = *flag != 0;
  if (last) __threadfence();  // acquire
  return last;
}

// Marks a work group's counter (decoder.h's StageCounters) finished once every thread's writes
// are visible device-wide (release): the signal to the work items that wait for the group.
__device__ __forceinline__ void mark_finished(int* counter) {
  __threadfence();
  __syncthreads();
  if (thread_index() == 0) atomicExch(counter + 1, 1);
}

__device__ __forceinline__ int load_acquire(const int* p) {
#if defined(__CUDA_ARCH__)
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
#else
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#endif
}

// Nanoseconds of the device's global timer (the same clock in every SM; the emulator's: the
// host's steady clock).
__device__ __forceinline__ unsigned long long timer_ns() {
#if defined(__CUDA_ARCH__)
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#else
  return steady_clock_ns();
#endif
}

// The block's clock in its current stage (thread 0's, in shared memory: Smem::clock), written to
// the timeline at the stage's end when the call records one (decoder.h's StageTime).
struct StageClock {
  unsigned long long begin, ready;
  unsigned waited_ns, waits;

  // Thread 0, after the block sync that ends a wait begun at `since`.
  __device__ void waited(unsigned long long since) {
    if (thread_index() != 0) return;
    const unsigned long long now = timer_ns();
    if (waits++ == 0) ready = now;
    waited_ns += unsigned(now - since);
  }
};

// What a wait begins with: thread 0's clock (the others' is not used).
__device__ __forceinline__ unsigned long long wait_begins() {
  return thread_index() == 0 ? timer_ns() : 0;
}

// A chained launch's wait for the launch before it (which, having waited for its own, has
// itself waited for every earlier one): afterwards the thread sees every earlier stage's writes
// (read them from L2: ws_load). Every thread of a block calls it at the same point; a block's
// first call waits, later ones return at once. The wait is counted on `clock`.
__device__ __forceinline__ void await_prior_launch(StageClock& clock) {
  const unsigned long long since = wait_begins();
  wait_for_prior_grids();
  clock.waited(since);
}

// Waits for an earlier stage's groups: until counter(0) .. counter(n - 1) are marked finished
// (the persistent kernel), or for the launch before (`chained`). Their writes are then visible
// to the whole block (read them from L2: ws_load). In the persistent kernel one thread polls
// each counter (an acquire load, a short sleep between polls), then the block syncs; its blocks
// are co-resident (a cooperative launch) and take their work in stage order, waiting only for
// earlier stages' groups, so every wait ends. The wait is counted on `clock`.
constexpr unsigned kPollNanoseconds = 64;
template <typename CounterAt>
__device__ __forceinline__ void await_finished(bool chained, StageClock& clock, int n,
                                               const CounterAt& counter) {
  if (chained) return await_prior_launch(clock);
  const unsigned long long since = wait_begins();
  for (int i = thread_index(); i < n; i += kThreads) {
    const int* finished = counter(i) + 1;
    while (load_acquire(finished) == 0) __nanosleep(kPollNanoseconds);
  }
  __syncthreads();
  clock.waited(since);
}

// Waits until `counter` (a group's arrivals in this stage, decoder.h's StageCounters word 0)
// reaches `expected`: the arrived items' writes are then visible to the whole block (ws_load).
// A chained launch first waits for the launch before (what the arrived items read, this block
// reads too). A block of a stage-kernel launch waits here only for blocks of its own launch,
// which all run at once: its grid is at most what fits the device, and the next launch's blocks
// take the SMs only as this one's leave. The wait is counted on `clock`.
__device__ __forceinline__ void await_arrivals(bool chained, StageClock& clock,
                                               const int* counter, int expected) {
  if (chained) await_prior_launch(clock);
  const unsigned long long since = wait_begins();
  if (thread_index() == 0) {
    while (load_acquire(counter) < expected) __nanosleep(kPollNanoseconds);
  }
  __syncthreads();
  clock.waited(since);
}

// ---- shared memory -----------------------------------------------------------------------------

// A block's shared memory; the stages reuse the arrays (each work item syncs the block before it
// writes them).
struct Smem {
  float warp_sums[kWarps * kBatchPass * kMaxTile];  // per-warp GEMV column sums / attention o
  alignas(16) float staged[kStaged];                 // GEMV inputs / attention q, k_new, v_new
  float warp_ml[2 * kWarps * kHeadChunk];            // per-warp attention (m, l)
  float inv_rms[kMmaBatch];
  float scratch[kWarps];  // block_sum
  int flag;               // arrive_last
  StageClock clock;       // thread 0's

  // GEMV: warp w's column sums for batch row bb of the pass, in tiles of `columns`.
  __device__ float* gemv_warp_sums(int w, int bb, int columns) {
    return warp_sums + (w * kBatchPass + bb) * columns;
  }
  // Tensor-core GEMV: the staged inputs' cell c of batch row b (bf16 hi x4, then lo x4), and
  // warp phase ph's column sums of batch row b [kMaxTile].
  __device__ uint4* mma_cell(int b, int c) {
    return reinterpret_cast<uint4*>(staged) + b * kMmaCellsPerRow + c;
  }
  __device__ const uint4* mma_cell(int b, int c) const {
    return reinterpret_cast<const uint4*>(staged) + b * kMmaCellsPerRow + c;
  }
  __device__ float* mma_sums(int ph, int b) { return warp_sums + (ph * kMmaBatch + b) * kMaxTile; }
  // Attention: q of head g of the chunk [head_dim], the new k and v [head_dim].
  __device__ float* attn_q(int g, int head_dim) { return staged + g * head_dim; }
  __device__ float* attn_k_new() { return staged + kHeadChunk * kMaxHeadDim; }
  __device__ float* attn_v_new() { return attn_k_new() + kMaxHeadDim; }
  // Attention: warp w's o [head_dim] and (m, l) for head g of the chunk.
  __device__ float* attn_warp_o(int w, int g) {
    return warp_sums + (w * kHeadChunk + g) * kMaxHeadDim;
  }
  __device__ float* attn_warp_ml(int w, int g) { return warp_ml + (w * kHeadChunk + g) * 2; }
};
static_assert(kBatchPass * kKChunk <= kStaged, "staging area too small");
static_assert(kWarps / 4 * kMmaBatch <= kWarps * kBatchPass, "tensor-core sums area too small");
static_assert(kHeadChunk * kMaxHeadDim + 2 * kMaxHeadDim <= kStaged, "attention staging too small");
static_assert(kWarps * kHeadChunk * kMaxHeadDim <= kWarps * kBatchPass * kMaxTile,
              "attention merge area too small");

// The block's sum of `sq` (fixed order) as row b's sum of squares of h over column tile `tile`.
__device__ __forceinline__ void store_tile_sumsq(const DecoderParams& p, Smem& sm, int b, int tile,
                                                 float sq) {
  const float total = block_sum<kThreads>(sq, sm.scratch);
  if (thread_index() == 0) ws_store(p.ws.row_sumsq.at(b, tile), total);
}

}  // namespace jaxfuse::cuda_decoder
