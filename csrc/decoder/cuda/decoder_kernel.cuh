// The CUDA decoder's kernel (included by cuda/decoder.cu only): one decode step of an L-layer
// Llama-style decoder as a sequence of stages, one struct each, of which a launch runs the slots
// its LaunchSlots name. Its two schedules launch it differently (decoder_persistent.cuh: every
// slot in one cooperative launch; decoder_stage_kernels.cuh: one launch per slot); the stages'
// work, their order and their split over the grid (decoder_plan.h's StagePlan) are the same in
// both, so are the results' bits. What a stage's work items wait for (after the bar: the
// persistent kernel's counters; a stage kernel waits for the launch before instead):
//
//   EmbedStage:      h = float(x), per-tile sums of squares of h
//   per layer l:
//   QkvStage:        [q|k|v] = rmsnorm(h) * attn_norm @ [wq|wk|wv]        | all of h (l-1's down)
//   AttentionStage:  RoPE on q, k; append k, v at [l, b, p];            | its q, k, v tiles
//                    flash-decoding over 0..p
//   OProjStage:      h += attn_out @ wo; sums of squares of h            | l's attention groups
//   GateUpStage:     mlp_act = silu(m @ w_gate) * (m @ w_up),            | all of h (l's O)
//                    m = rmsnorm(h) * mlp_norm
//   DownStage:       h += mlp_act @ w_down; sums of squares (last        | its K split's gate/up
//                    layer: out = h, NaN rows for bad p)                   tiles
// and in a whole-model step (decoder_head.cuh, decoder_sample.cuh), after the last layer:
//   HeadStage:       logits = (rmsnorm(h) * final_norm, as kT) @ head^T | all of h (last down)
//                    (times the rows' scales when quantized)
//   SampleStage:     next_tokens = argmax of the sampling scores kept by | a grid sync (all logits)
//                    top-k / top-p (their thresholds: radix passes over    then its own passes'
//                    the logits)                                           counters
// with EmbedStage then gathering h = embed[tokens[b]] (layer 0 waits for the embedding's h).
//
// In the persistent schedule a wait is on a counter per tile group (decoder.h's StageCounters):
// its split items' arrivals and a flag set once the last to arrive has finished the group
// (release / acquire, gpu scope). A block goes from its last item of one stage straight to its
// first of the next. Every block takes its items in stage order and waits only for earlier
// stages, on a co-resident (cooperative) grid, so every wait ends. No stage's writes can overtake
// a reader of the previous layer: every group of a stage needs all of K, which needs every item
// of the stage before; the GEMV stages' partial sums alternate between two regions, so a stage's
// items may write theirs while the last groups of the stage before still read their own.
//
// Either way an item asks for its first weights before it waits (L2 prefetch of its first rows;
// on tensor cores the weight ring's first slabs copied into shared memory; attention: its cache
// rows), so HBM streams while the stage before finishes: weights never depend on activations,
// and nothing a stage does before its first wait reads what an earlier stage writes.
//
// With the `timeline` flag each block records its times in each stage (decoder.h's StageTime:
// when it entered and left, when its first wait ended, how long it waited) in the workspace, read
// by jaxfuse/_decode/timeline.py; every call keeps the clock, and only such a call writes it.
//
// Weight-only quantized models (int8 or fp8 e4m3 matrices with per-column scales, decoder.h) run
// the same stages in their own kernel instance: the GEMV engine widens the 8-bit weights, each
// finish() applies the scales to the summed columns.
//
// Workspace data written by other blocks is read with ld.global.cg (L2), so stale L1 lines are
// never observed; weights are read through the read-only path.
#pragma once

#include <cooperative_groups.h>

#include "decoder/cuda/decoder_attention.cuh"
#include "decoder/cuda/decoder_head.cuh"
#include "decoder/cuda/decoder_head_mma.cuh"
#include "decoder/cuda/decoder_sample.cuh"
#include "decoder/cuda/decoder_stages.cuh"

namespace jaxfuse::cuda_decoder {

// The block's clock starts a stage (thread 0's; the waits add to it).
__device__ __forceinline__ void start_clock(Smem& sm) {
  if (thread_index() == 0) sm.clock = StageClock{timer_ns(), 0, 0, 0};
}

// The block's times in the stage that started the clock, as timeline slot `slot` of a call
// that records a timeline (thread 0; its own program order orders the clock's writes). A stage
// kernel's block first waits for the launch before, if its work has not: so its launch's
// completion implies every earlier launch's, and it stores nothing before its wait.
__device__ __forceinline__ void stop_clock(const DecoderParams& p, Smem& sm, int slot) {
  if (p.run.chained) await_prior_launch(sm.clock);
  if (thread_index() != 0) return;
  StageTime* record = p.ws.stage_time(block_index(), slot);
  if (record == nullptr) return;
  const StageClock& c = sm.clock;
  *record = StageTime{c.begin, c.ready, timer_ns(), c.waited_ns, c.waits};
  if (slot == 0 && block_index() == 0) p.ws.timeline->blocks = gridDim.x;
}

// The LM head with weights of kH: on tensor cores where mma_head().
template <DType kT, DType kH>
__device__ __forceinline__ void run_head_stage(const DecoderParams& p, Smem& sm) {
  if constexpr (mma_head(kT)) {
    MmaHeadStage<kH>{p, sm}.run();
  } else {
    HeadStage<kT, kH>{p, sm}.prefetch();
    HeadStage<kT, kH>{p, sm}.run();
  }
}

// The whole-model step's stages after the last layer, those of the launch's slots: the head in
// kW when it comes quantized (with a quantized layer stack, whose format it shares), else in kT;
// the draw, which waits for every logit (a grid sync in the persistent kernel; a stage kernel's
// launch of it comes after the head's). (A call instead of inlining them changes the layer
// loop's register allocation: it spilled the f16 instances.)
template <DType kT, DType kW>
__device__ __forceinline__ void run_head(const DecoderParams& p, Smem& sm) {
  const int head = int(head_slot(p.dims.layers));
  if (p.run.runs(head)) {
    start_clock(sm);
    if (kW != kT && p.io.head_scale != nullptr) {
      run_head_stage<kT, kW>(p, sm);
    } else {
      run_head_stage<kT, kT>(p, sm);
    }
    stop_clock(p, sm, head);
  }
  if (p.dims.sample && p.run.runs(head + 1)) {
    start_clock(sm);
    if (!p.run.chained) {
      const unsigned long long since = wait_begins();
      cg::this_grid().sync();
      sm.clock.waited(since);
    }
    SampleStage{p, sm}.run();
    stop_clock(p, sm, head + 1);
  }
}

// kT: the dtype of x, the caches, norms and biases; kW: the matrices' (kT, or int8 / fp8 e4m3
// when quantized). Min blocks per SM pinned: without it ptxas may use up to 168 registers (one
// block per SM). The O projection's first rows are asked of L2 before attention, whose items are
// short. Each GEMV stage gets the layer as an opaque() value: the offsets derived from it are
// then formed in the stage, not at the layer loop's head and kept (spilled) across the others.
// A stage kernel lets the next launch's blocks be scheduled at once (they take SMs only as this
// one's blocks leave them, and do no more than ask for their weights before they wait).
template <DType kT, DType kW>
__global__ void __launch_bounds__(kThreads, kMaxBlocksPerSm)
    decoder_kernel(const __grid_constant__ DecoderParams p) {
  __shared__ Smem sm;
  if (p.run.chained) allow_dependent_launch();
  if (p.run.runs(0)) {
    start_clock(sm);
    EmbedStage<kT>{p, sm}.run();
    stop_clock(p, sm, 0);
  }
  for (int layer = p.run.first_layer; layer < p.run.last_layer; ++layer) {
    const auto timed = [&](LayerStage stage, const auto& run) {
      const int slot = int(stage_slot(opaque(layer), stage));
      if (!p.run.runs(slot)) return;
      start_clock(sm);
      run();
      stop_clock(p, sm, slot);
    };
    timed(LayerStage::kQkv, [&] { QkvStage<kT, kW>{p, sm, opaque(layer)}.run(); });
    timed(LayerStage::kAttention, [&] {
      OProjStage<kT, kW>{p, sm, opaque(layer)}.prefetch();
      AttentionStage<kT>{p, sm, layer}.run();
    });
    timed(LayerStage::kOProj, [&] { OProjStage<kT, kW>{p, sm, opaque(layer)}.run(); });
    timed(LayerStage::kGateUp, [&] { GateUpStage<kT, kW>{p, sm, opaque(layer)}.run(); });
    timed(LayerStage::kDown, [&] { DownStage<kT, kW>{p, sm, opaque(layer)}.run(); });
  }
  if (p.dims.model_step) run_head<kT, kW>(p, sm);
}

}  // namespace jaxfuse::cuda_decoder
