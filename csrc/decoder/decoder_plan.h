// The jaxfuse_decoder op's stage plan, shared by the CUDA kernel's two schedules and the CPU
// twin: which stages a call runs and in what order (each a slot of the timeline), how the GEMV
// column tiles and attention's head chunks cut the work, and how the CUDA kernel splits each
// stage's work items over its grid (StagePlan).
//
// A call runs the embedding, then per layer the LayerStage sequence ([q|k|v], attention, the O
// projection, gate/up, down), then in a whole-model step the LM head and, sampling, the draw.
// The persistent schedule runs them all in one launch, its blocks waiting on counters between
// stages; the stage-kernel schedule launches the same kernel once per stage, each launch waiting
// for the one before (programmatic dependent launch). Both take the same StagePlan, so they
// sum in the same order and their results are the same bits.
#pragma once

#include <algorithm>
#include <cstdint>
#include <iterator>

#include "decoder/decoder_operands.h"

namespace jaxfuse {

// Partial-sum slots per GEMV stage, in each of two regions: consecutive GEMV stages alternate
// between them, so a stage's items write their partials while the previous stage's last tiles
// still read theirs (the persistent kernel has no grid sync between them).
inline constexpr int64_t kDecMaxGemvItems = 512;
inline constexpr int64_t kDecMaxAttnSplits = 64;  // flash-decoding splits of the cache length
inline constexpr int64_t kDecHeadChunk = 4;       // query heads per attention work item
// The CPU GEMV's split of K: each split of this many rows is one contiguous stretch of the
// weights (what a core's prefetchers stream fastest), and the splits' partial sums are added in
// order. A constant, so that results do not depend on the thread count.
inline constexpr int64_t kDecCpuSplitRows = 512;

// ---- the stages ---------------------------------------------------------------------------------

// A layer's stages, in the order they run; kLayerStageNames are their names in the contract
// (the timeline's, jaxfuse/_decode/timeline.py).
enum class LayerStage : int { kQkv, kAttention, kOProj, kGateUp, kDown };
inline constexpr const char* kLayerStageNames[] = {"qkv", "attention", "o_proj", "gate_up",
                                                   "down"};
inline constexpr int kLayerStages = int(std::size(kLayerStageNames));
static_assert(int(LayerStage::kDown) == kLayerStages - 1, "a name for every layer stage");

// A call's stages as slots, in order: 0 the embedding, then layer l's stage s, then the LM head
// and the draw (a whole-model step's; their slots exist in every call's timeline).
JF_HD int64_t stage_slot(int64_t layer, LayerStage stage) {
  return 1 + kLayerStages * layer + int(stage);
}
JF_HD int64_t head_slot(int64_t layers) { return 1 + kLayerStages * layers; }
JF_HD int64_t sample_slot(int64_t layers) { return head_slot(layers) + 1; }
JF_HD int64_t stage_slots(int64_t layers) { return sample_slot(layers) + 1; }
// The slots a call of `layers` layers runs, [0, this): with the head in a whole-model step, and
// with the draw when it samples.
JF_HD int64_t slots_run(int64_t layers, bool model_step, bool sample) {
  return sample ? stage_slots(layers) : model_step ? sample_slot(layers) : head_slot(layers);
}

// ---- the work's tiles ---------------------------------------------------------------------------

// GEMV column tiles: one 16-byte vector of the activations' dtype per lane of a warp, so a tile
// does not depend on the matrices' dtype (nor do the workspace's layout, tiles and counters).
inline int64_t gemv_vec(const DecoderDims& d) { return 16 / dtype_bytes(d.dtype); }
inline int64_t gemv_tile(const DecoderDims& d) { return 32 * gemv_vec(d); }
inline int64_t gemv_tiles(const DecoderDims& d, int64_t n) {
  return (n + gemv_tile(d) - 1) / gemv_tile(d);
}
inline int64_t hidden_tiles(const DecoderDims& d) { return gemv_tiles(d, d.D); }
inline int64_t qkv_tiles(const DecoderDims& d) {
  return gemv_tiles(d, d.q_dim()) + 2 * gemv_tiles(d, d.kv_dim());
}
inline int64_t mlp_tiles(const DecoderDims& d) { return gemv_tiles(d, d.I); }
// Chunks of <= kDecHeadChunk query heads per kv head (an attention work item's heads).
inline int64_t head_chunks(const DecoderDims& d) {
  return (d.group() + kDecHeadChunk - 1) / kDecHeadChunk;
}

// The CPU GEMV's splits of K rows, and the floats of its scratch: the GEMV input rows [B][D],
// the gate projection [B][I] and the largest GEMV's split partial sums [splits][B][N].
inline int64_t cpu_splits(int64_t k_rows) {
  return (k_rows + kDecCpuSplitRows - 1) / kDecCpuSplitRows;
}
inline int64_t cpu_gemv_floats(const DecoderDims& d) {
  const int64_t partials = std::max({cpu_splits(d.D) * std::max(d.q_dim(), d.I),
                                     cpu_splits(d.q_dim()) * d.D, cpu_splits(d.I) * d.D});
  return d.B * (d.D + d.I + partials);
}

// ---- the CUDA kernel's split of the work over its grid -----------------------------------------

// A GEMV stage's work over the grid. The kernel reads these counts from its parameters where
// it uses them: products of them formed in the kernel are hoisted out of the layer loop and
// spill.
struct GemvPlan {
  int splits;     // K splits per column tile
  int items;      // split items: column tiles x splits
  int groups;     // tile groups, one counter each (gate/up: tile t of both matrices is one group)
  int arrivals;   // split items per group
  int all_items;  // items + finish items (groups x (batch rows - 1): run_gemv)
};

// Every stage's work items over a grid of `blocks` (stage_plan()).
struct StagePlan {
  GemvPlan qkv, o_proj, gate_up, down;
  int attn_splits;  // flash-decoding splits of the positions 0..p
  // Attention work items: batch x kv heads x head chunks x splits. A parameter, not a product
  // the kernel forms: ptxas hoisted that loop-invariant product out of the layer loop and
  // spilled it.
  int attn_items;
  int attn_groups;  // batch x kv heads x head chunks: the split items' counters, one per group
};

// K splits for a GEMV stage: enough items to cover the grid, at most kDecMaxGemvItems partial
// slots, at least 16 rows per split.
inline int gemv_splits(int blocks, int64_t tiles, int64_t k_rows) {
  const int64_t budget = std::min<int64_t>(blocks, kDecMaxGemvItems);
  const int64_t s = std::max<int64_t>(1, budget / tiles);
  return int(std::min(s, std::max<int64_t>(1, k_rows / 16)));
}

// A GEMV stage of `tiles` column tiles over k_rows inputs; `paired`: tile t of its two matrices
// is one group (gate/up).
inline GemvPlan gemv_plan(int blocks, int64_t tiles, int64_t k_rows, int64_t batch, bool paired) {
  GemvPlan g;
  g.splits = gemv_splits(blocks, tiles, k_rows);
  g.items = int(tiles) * g.splits;
  g.groups = int(paired ? tiles / 2 : tiles);
  g.arrivals = paired ? 2 * g.splits : g.splits;
  g.all_items = g.items + g.groups * int(batch - 1);
  return g;
}

inline StagePlan stage_plan(const DecoderDims& d, int blocks) {
  StagePlan plan;
  plan.qkv = gemv_plan(blocks, qkv_tiles(d), d.D, d.B, false);
  plan.o_proj = gemv_plan(blocks, hidden_tiles(d), d.q_dim(), d.B, false);
  plan.gate_up = gemv_plan(blocks, 2 * mlp_tiles(d), d.D, d.B, true);
  plan.down = gemv_plan(blocks, hidden_tiles(d), d.I, d.B, false);
  // Attention: enough splits to cover the grid, at most kDecMaxAttnSplits, >= 16 positions each.
  const int64_t items = d.B * d.KV * head_chunks(d);
  const int64_t splits = std::clamp<int64_t>(blocks / std::max<int64_t>(1, items), 1,
                                             kDecMaxAttnSplits);
  plan.attn_splits = int(std::min<int64_t>(splits, std::max<int64_t>(1, d.S / 16)));
  plan.attn_items = int(items) * plan.attn_splits;
  plan.attn_groups = int(items);
  return plan;
}

}  // namespace jaxfuse
