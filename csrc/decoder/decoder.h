// The jaxfuse_decoder op: FFI signature, operand and workspace layout, decoding and
// validation, shared by the CPU and CUDA handlers (op.h), and the workspace's typed views
// (DecoderWorkspace) that both run steps use. The element math is decoder_math.h; the run steps
// are src_cuda/cpu/decoder*.{h,cc} and src_cuda/cuda/decoder*.{cu,cuh}.
//
// Operands (x, the caches, the norms and biases share one dtype T: f32, bf16 or f16), in
// kDecoderOperands order:
//   x T[B, D], positions s32[B], rope_inv_freq f32[hd/2] (the RoPE frequency of each rotated pair,
//   scaling rule applied: Python computes it), then the stacked layer weights
//   (JAXFUSE_DECODER_WEIGHTS): attn_norm T[L, D], the matrices wq W[L, D, H*hd],
//   wk W[L, D, KV*hd], wv W[L, D, KV*hd], wo W[L, H*hd, D], mlp_norm T[L, D], w_gate W[L, D, I],
//   w_up W[L, D, I], w_down W[L, I, D], the optional q_bias T[L, H*hd], k_bias T[L, KV*hd],
//   v_bias T[L, KV*hd] (attribute qkv_bias; else each T[L, 0]), q_norm, k_norm T[L, hd]
//   (attribute qk_norm; else T[L, 0]) and the matrices' per-output-column scales wq_scale
//   f32[L, H*hd] ... w_down_scale f32[L, D] (attribute quantized; else each f32[L, 0]), then
//   k_cache and v_cache T[L, B, S, KV, hd]. The matrices' dtype W is T, or with `quantized`
//   int8 or float8_e4m3fn (weight-only quantization: y[n] = scale[n] * sum_k a[k] * W[k, n]).
//   Then the whole-model step's operands (attribute model_step; else each empty): tokens s32[B]
//   (x is then T[B, 0]: the step starts from embed[tokens[b]]), embed T[V, D], final_norm T[D],
//   lm_head T[V, D] (T[0, D] when tied to embed) or, quantized, W[V, D] with lm_head_scale
//   f32[V] (only with `quantized`: the matrices' format, a scale per vocabulary row; else
//   f32[0]), and sample_key u32[2] (attribute sample: the jax.random key data the next tokens
//   are drawn with; else u32[0]).
// Results, in kDecoderResults order: out T[B, D]; k_cache and v_cache, aliased to their operands
//   (updated in place at [l, b, positions[b]]); logits f32[B, V] (model_step; else f32[B, 0]):
//   rmsnorm(out) * final_norm, rounded to T, times the head's rows (and their scales);
//   next_tokens s32[B] (sample; else s32[0]): argmax of the logits (temperature 0) or a draw
//   from softmax(logits / temperature) restricted by top_k and top_p (sampling_math.h);
//   workspace u8[decoder_layout(...).total]: fp32 activations, partial sums and counters (and
//   with `timeline`, every block's StageTime in every stage).
// Attributes: the DecoderAttrs fields (the names of jaxfuse.DecoderConfig's fields, then the
//   step's model_step, sample, timeline, temperature, top_k (0: off) and top_p (1: off)).
// Python reads all of these names and the workspace size from DecoderOp::contract().
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "decoder/decoder_math.h"
#include "core/op.h"
#include "decoder/sampling_math.h"
#include "core/vector_layout.h"

namespace jaxfuse {

using PositionsBuffer = ffi::Buffer<ffi::S32, 1>;
using RopeTableBuffer = ffi::Buffer<ffi::F32, 1>;
using WorkspaceBuffer = ffi::Buffer<ffi::U8, 1>;
using TokensBuffer = ffi::Buffer<ffi::S32, 1>;
using SampleKeyBuffer = ffi::Buffer<ffi::U32, 1>;

// Constants of the workspace layout.
// Partial-sum slots per GEMV stage, in each of two regions: consecutive GEMV stages alternate
// between them, so a stage's items write their partials while the previous stage's last tiles
// still read theirs (the CUDA kernel has no grid sync between them).
inline constexpr int64_t kDecMaxGemvItems = 512;
inline constexpr int64_t kDecMaxAttnSplits = 64;   // flash-decoding splits of the cache length
inline constexpr int64_t kDecHeadChunk = 4;        // query heads per attention work item
inline constexpr int64_t kDecAlign = 256;          // byte alignment of workspace regions
// The CUDA kernel's passes over the logits before a filtered draw: top-k's radix passes, a pass
// for the largest score (when top-k does not find it), top-p's radix passes.
inline constexpr int64_t kDecSamplePasses = 2 * kSelectPasses + 1;
// The CPU GEMV's split of K: each split of this many rows is one contiguous stretch of the
// weights (what a core's prefetchers stream fastest), and the splits' partial sums are added in
// order. A constant, so that results do not depend on the thread count.
inline constexpr int64_t kDecCpuSplitRows = 512;
// A timeline's rows: blocks past the first kDecTimelineBlocks record nothing.
inline constexpr int64_t kDecTimelineBlocks = 1024;

// The bool attributes, each a field of DecoderAttrs and DecoderDims and a name in the contract.
// The config's (DecoderConfig fields; JAXFUSE_DECODER_WEIGHTS names them as the flags of the
// optional weights):
//   qkv_bias    the q/k/v projections add a bias
//   qk_norm     per-head RMSNorm of q and k before RoPE
//   quantized   the matrices are int8 or fp8 with per-column scales
// The whole-model step's (set by persistent_decoder's callers, not config fields):
//   model_step  tokens in, embedding gathered, final norm and LM head of V rows after the last
//               layer (V = 0 otherwise)
//   sample      the next tokens drawn in the same call
//   timeline    each block's times in each stage recorded in the workspace (StageTime)
#define JAXFUSE_DECODER_FLAGS(X) X(qkv_bias) X(qk_norm) X(quantized)
#define JAXFUSE_DECODER_STEP_FLAGS(X) X(model_step) X(sample) X(timeline)
inline constexpr const char* kDecoderFlags[] = {JAXFUSE_DECODER_FLAGS(JF_VECTOR_NAME)};
inline constexpr const char* kDecoderStepFlags[] = {JAXFUSE_DECODER_STEP_FLAGS(JF_VECTOR_NAME)};

// The sizes of one call (DecoderAttrs and the batch), in the names of the operand shapes above.
struct DecoderDims {
  int64_t L = 0;   // layers
  int64_t B = 0;   // batch rows
  int64_t D = 0;   // hidden size
  int64_t H = 0;   // query heads
  int64_t KV = 0;  // key/value heads
  int64_t hd = 0;  // head_dim
  int64_t I = 0;   // intermediate (MLP) size
  int64_t S = 0;   // max_seq_len: cache positions
  float eps = 0.f;
#define JF_DECODER_FLAG_FIELD(name) bool name = false;
  JAXFUSE_DECODER_FLAGS(JF_DECODER_FLAG_FIELD)
  JAXFUSE_DECODER_STEP_FLAGS(JF_DECODER_FLAG_FIELD)
#undef JF_DECODER_FLAG_FIELD
  float temperature = 0.f;  // 0: greedy
  int64_t top_k = 0;        // 0: no top-k filter
  float top_p = 1.f;        // 1: no top-p filter
  int64_t V = 0;
  DType dtype = DType::kF32;   // x, caches, norms, biases, out
  DType wdtype = DType::kF32;  // the matrices: dtype, or kI8 / kF8E4M3 when quantized

  int64_t q_dim() const { return H * hd; }
  int64_t kv_dim() const { return KV * hd; }
  int64_t qkv_dim() const { return q_dim() + 2 * kv_dim(); }
  int64_t group() const { return H / KV; }  // query heads per kv head
  int64_t head_chunks() const { return (group() + kDecHeadChunk - 1) / kDecHeadChunk; }
  // GEMV column tile: one 16-byte vector per lane of a warp.
  int64_t vec() const { return 16 / dtype_bytes(dtype); }
  int64_t tile() const { return 32 * vec(); }
  int64_t tiles(int64_t n) const { return (n + tile() - 1) / tile(); }
  // Whether a draw may be filtered (top-k at or above V filters nothing, found at run time):
  // the workspace then holds the CUDA kernel's search for each row's threshold.
  bool sample_filter() const { return top_k > 0 || top_p < 1.0f; }
  int64_t hidden_tiles() const { return tiles(D); }
  int64_t qkv_tiles() const { return tiles(q_dim()) + 2 * tiles(kv_dim()); }
  int64_t mlp_tiles() const { return tiles(I); }
  // The CPU GEMV's splits of K rows, and the floats of its scratch: the GEMV input rows [B][D],
  // the gate projection [B][I] and the largest GEMV's split partial sums [splits][B][N].
  static int64_t cpu_splits(int64_t k_rows) {
    return (k_rows + kDecCpuSplitRows - 1) / kDecCpuSplitRows;
  }
  int64_t cpu_gemv_floats() const {
    const int64_t partials = std::max({cpu_splits(D) * std::max(q_dim(), I),
                                       cpu_splits(q_dim()) * D, cpu_splits(I) * D});
    return B * (D + I + partials);
  }
};

// Byte offsets of the workspace regions (in this order, each aligned to kDecAlign), the first
// group of each stage's counters (StageCounters: two int32 words a group) and the int32 index
// (from `counters`) of the others.
struct DecoderLayout {
  int64_t hidden, row_sumsq, qkv, attn_out, mlp_act, attn_partials, gemv_partials, counters;
  int64_t timeline;  // the timeline (a header, then StageTime [kDecTimelineBlocks][slots])
  int64_t total;  // bytes
  int64_t embed_counters, qkv_counters, o_proj_counters, gate_up_counters, down_counters;
  int64_t attn_counters;
  int64_t sample_counter;  // the blocks done with the sampling pass
  int64_t sample_keys;     // counter index of [B] uint64 argmax keys (sampling_math.h)
  // A filtered draw's (DecoderDims::sample_filter; else empty), counter indices: the arrivals of
  // each pass [kDecSamplePasses], each row's pass flags [B][kDecSamplePasses], its SampleSearch
  // [B], and the histograms' counts [B][kSelectBins] and masses (uint64) [B][kSelectBins].
  int64_t select_arrivals, select_flags, select_states, select_counts, select_masses;
  int64_t num_counters;    // int32 words, all zeroed before each call
};

// One row's top-k / top-p search in the CUDA kernel's workspace (sampling_math.h), written by the
// block that walks the row's histograms after each pass.
struct SampleSearch {
  uint32_t prefix;           // the key digits found so far
  uint32_t need;             // top-k: the rank of the k-th largest score in the prefix's bucket
  uint32_t max_key;          // the order key of the row's largest score (the masses' reference)
  uint32_t floor;            // the smallest key kept so far (0: every key)
  unsigned long long above;  // top-p: the mass of the candidates above the prefix's bucket
  unsigned long long total;  // top-p: the mass of every candidate
};
static_assert(sizeof(SampleSearch) == 32, "8 counter words a row");

// One block's times in one stage of a call with the `timeline` flag, in nanoseconds of one clock
// (the GPU's global timer, the CPU's steady clock): when it entered the stage, when its first
// wait for other blocks' results ended (0: it did not wait), when it left, and the time and
// count of its waits. The CPU handler records its stages as block 0 of a grid of one.
struct StageTime {
  unsigned long long begin, ready, end;
  unsigned waited_ns, waits;
};
static_assert(sizeof(StageTime) == 32, "four 8-byte words");
// The timeline's header, before its records: the blocks that recorded (the grid).
struct TimelineHeader {
  unsigned long long blocks, reserved[3];
};
// The timeline's stages, each a record of every block: the embedding, per layer [q|k|v],
// attention, the O projection, gate/up and down, then the LM head and the draw (recorded in a
// whole-model step only).
enum TimelineStage : int { kTimeQkv, kTimeAttention, kTimeOProj, kTimeGateUp, kTimeDown };
inline constexpr int kTimeStagesPerLayer = 5;
JF_HD int64_t timeline_slot(int64_t layer, int stage) {
  return 1 + kTimeStagesPerLayer * layer + stage;
}
// The LM head's slot after `layers` layers; the draw's is the next, the last.
JF_HD int64_t timeline_head_slot(int64_t layers) { return timeline_slot(layers, 0); }
JF_HD int64_t timeline_slots(int64_t layers) { return timeline_head_slot(layers) + 2; }
// The host's timeline clock (the CPU handler's, and the CUDA-on-CPU emulator's global timer).
inline unsigned long long steady_clock_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline int64_t align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

// Work items of one GEMV partial-sum region: kDecMaxGemvItems, or one per tile of the widest stage.
inline int64_t gemv_region_items(const DecoderDims& d) {
  return std::max({kDecMaxGemvItems, d.qkv_tiles(), d.hidden_tiles(), 2 * d.mlp_tiles()});
}

inline DecoderLayout decoder_layout(const DecoderDims& d) {
  DecoderLayout w{};
  int64_t off = 0;
  auto region = [&](int64_t bytes) {
    const int64_t at = off;
    off = align_up(off + bytes, kDecAlign);
    return at;
  };
  const int64_t f = 4;
  w.hidden = region(d.B * d.D * f);
  w.row_sumsq = region(d.B * d.hidden_tiles() * f);
  w.qkv = region(d.B * d.qkv_dim() * f);
  w.attn_out = region(d.B * d.q_dim() * f);
  w.mlp_act = region(d.B * d.I * f);
  w.attn_partials = region(d.B * d.H * kDecMaxAttnSplits * (d.hd + 2) * f);
  // The CUDA kernel's split-K partials, or the CPU's GEMV scratch, whichever is larger.
  w.gemv_partials = region(
      std::max(2 * gemv_region_items(d) * d.B * d.tile(), d.cpu_gemv_floats()) * f);
  w.embed_counters = 0;
  w.qkv_counters = w.embed_counters + d.hidden_tiles();
  w.o_proj_counters = w.qkv_counters + d.L * d.qkv_tiles();
  w.gate_up_counters = w.o_proj_counters + d.L * d.hidden_tiles();
  w.down_counters = w.gate_up_counters + d.L * d.mlp_tiles();
  w.attn_counters = w.down_counters + d.L * d.hidden_tiles();
  w.sample_counter = 2 * (w.attn_counters + d.L * d.B * d.KV * d.head_chunks());
  w.sample_keys = align_up(w.sample_counter + 1, 2);  // 8-byte aligned
  w.select_arrivals = w.sample_keys + 2 * d.B;
  w.select_flags = w.select_arrivals + kDecSamplePasses;
  w.select_states = align_up(w.select_flags + d.B * kDecSamplePasses, 2);
  w.select_counts = w.select_states + d.B * int64_t(sizeof(SampleSearch) / 4);
  w.select_masses = w.select_counts + d.B * kSelectBins;  // even: 8-byte aligned
  w.num_counters = d.sample_filter() ? w.select_masses + 2 * d.B * kSelectBins : w.select_arrivals;
  w.counters = region(w.num_counters * 4);
  w.timeline = region(d.timeline ? int64_t(sizeof(TimelineHeader)) + kDecTimelineBlocks *
                                       timeline_slots(d.L) * int64_t(sizeof(StageTime))
                                 : 0);
  w.total = off;
  return w;
}

// ---- typed views of the workspace, for the CPU and CUDA run steps ----------------------------

// fp32 rows [rows][width].
struct WorkspaceRows {
  float* data = nullptr;
  int64_t width = 0;

  JF_HD float* row(int64_t r) const { return data + r * width; }
  JF_HD float* at(int64_t r, int64_t i) const { return data + r * width + i; }
};

// Rows of query heads [rows][heads][head_dim].
struct HeadRows : WorkspaceRows {
  int64_t head_dim = 0;

  JF_HD float* head(int64_t r, int64_t h) const { return row(r) + h * head_dim; }
};

// The projections of each batch row, [rows][q heads | k heads | v heads] (before RoPE).
struct QkvRows : HeadRows {
  int64_t q_dim = 0, kv_dim = 0;

  JF_HD float* q(int64_t b, int64_t q_head) const { return head(b, q_head); }
  JF_HD float* k(int64_t b, int64_t kv_head) const { return row(b) + q_dim + kv_head * head_dim; }
  JF_HD float* v(int64_t b, int64_t kv_head) const {
    return row(b) + q_dim + kv_dim + kv_head * head_dim;
  }
  // Column `c` of projection `m` (0: q, 1: k, 2: v) of row b.
  JF_HD float* column(int64_t b, int m, int64_t c) const {
    return row(b) + (m == 0 ? 0 : (m == 1 ? q_dim : q_dim + kv_dim)) + c;
  }
};

// One split's flash-decoding state of one query head: max score m, sum l, output o[head_dim].
struct AttnPartial {
  float* record;

  JF_HD float* m() const { return record; }
  JF_HD float* l() const { return record + 1; }
  JF_HD float* o(int64_t j) const { return record + 2 + j; }
};

// Counters of the CUDA kernel's work groups, zero at the start of each call: per GEMV stage
// [L][tile groups], for attention [L][B][KV][head chunks], for the embedding [hidden tiles]. A
// group's counter is two int32 words: [0] its split items' arrivals, then (GEMV stages at batch
// > 1) its batch rows' finishes, [1] set to 1 once the group is finished (what the items of later
// stages wait for).
struct StageCounters {
  int* data = nullptr;
  int64_t size = 0;  // all stages' counters
  int64_t embed_first = 0, qkv_first = 0, o_proj_first = 0, gate_up_first = 0, down_first = 0;
  int64_t attn_first = 0;
  int64_t sample_counter = 0, sample_keys = 0;
  int64_t select_arrivals = 0, select_flags = 0, select_states = 0, select_counts = 0;
  int64_t select_masses = 0;
  int64_t qkv_tiles = 0, hidden_tiles = 0, mlp_tiles = 0;
  int64_t batch = 0, kv_heads = 0, head_chunks = 0;
};

// Flash-decoding partial results, [B][H][splits] records (m, l, o[head_dim]).
struct AttnPartials {
  float* data = nullptr;
  int64_t heads = 0, head_dim = 0, splits = 0;
};

// Split-K GEMV partial sums, [region][work item][B][tile] (two regions of region_items items).
struct GemvPartials {
  float* data = nullptr;
  int64_t region_items = 0;
  int64_t batch = 0, tile = 0;
};

// The workspace as typed views (decoder_layout's regions). Attention partials are packed for the
// `attn_splits` in use (at most kDecMaxAttnSplits).
struct DecoderWorkspace {
  WorkspaceRows hidden;     // [B][D]: h, the residual stream
  WorkspaceRows row_sumsq;  // [B][hidden tiles]: sum of h^2 per GEMV column tile (for RMSNorm)
  QkvRows qkv;              // [B][q | k | v]
  HeadRows attn_out;        // [B][H][hd]: attention output
  WorkspaceRows mlp_act;    // [B][I]: silu(x @ w_gate) * (x @ w_up)
  AttnPartials attn_partials;
  GemvPartials gemv_partials;
  StageCounters counters;
  TimelineHeader* timeline = nullptr;  // with the `timeline` flag; else null
  int64_t time_slots = 0;  // timeline_slots(L)

  DecoderWorkspace(const DecoderDims& d, char* base, int64_t attn_splits = kDecMaxAttnSplits);

  JF_HD AttnPartial attn_partial(int64_t b, int64_t head, int64_t split) const {
    const AttnPartials& a = attn_partials;
    return {a.data + ((b * a.heads + head) * a.splits + split) * (a.head_dim + 2)};
  }
  JF_HD float* gemv_partial(int region, int64_t item, int64_t b, int64_t column) const {
    const GemvPartials& g = gemv_partials;
    return g.data + ((region * g.region_items + item) * g.batch + b) * g.tile + column;
  }
  JF_HD int* embed_counter(int64_t tile) const { return counter(counters.embed_first, 0, 0, tile); }
  JF_HD int* qkv_counter(int64_t layer, int64_t tile) const {
    return counter(counters.qkv_first, layer, counters.qkv_tiles, tile);
  }
  JF_HD int* o_proj_counter(int64_t layer, int64_t tile) const {
    return counter(counters.o_proj_first, layer, counters.hidden_tiles, tile);
  }
  JF_HD int* gate_up_counter(int64_t layer, int64_t tile) const {
    return counter(counters.gate_up_first, layer, counters.mlp_tiles, tile);
  }
  JF_HD int* down_counter(int64_t layer, int64_t tile) const {
    return counter(counters.down_first, layer, counters.hidden_tiles, tile);
  }
  JF_HD int* attn_counter(int64_t layer, int64_t b, int64_t kv_head, int64_t head_chunk) const {
    const StageCounters& c = counters;
    const int64_t item = (layer * c.batch + b) * c.kv_heads + kv_head;
    return counter(c.attn_first, item, c.head_chunks, head_chunk);
  }
  // Block `block`'s record of timeline slot `slot` (timeline_slot()), or null without a
  // timeline or past its rows.
  JF_HD StageTime* stage_time(int64_t block, int64_t slot) const {
    if (timeline == nullptr || block >= kDecTimelineBlocks) return nullptr;
    return reinterpret_cast<StageTime*>(timeline + 1) + block * time_slots + slot;
  }
  JF_HD int* sample_counter() const { return counters.data + counters.sample_counter; }
  // Row b's best argmax key so far (zero: no candidate yet).
  JF_HD unsigned long long* sample_key(int64_t b) const {
    return reinterpret_cast<unsigned long long*>(counters.data + counters.sample_keys) + b;
  }
  // A filtered draw's: the blocks done with pass `pass`; row b's flag of that pass (set once its
  // search state holds the pass's result); its search; its histograms.
  JF_HD int* select_arrivals(int pass) const {
    return counters.data + counters.select_arrivals + pass;
  }
  JF_HD int* select_flag(int64_t b, int pass) const {
    return counters.data + counters.select_flags + b * kDecSamplePasses + pass;
  }
  JF_HD SampleSearch* select_search(int64_t b) const {
    return reinterpret_cast<SampleSearch*>(counters.data + counters.select_states) + b;
  }
  JF_HD unsigned* select_counts(int64_t b) const {
    return reinterpret_cast<unsigned*>(counters.data + counters.select_counts) + b * kSelectBins;
  }
  JF_HD unsigned long long* select_masses(int64_t b) const {
    return reinterpret_cast<unsigned long long*>(counters.data + counters.select_masses) +
           b * kSelectBins;
  }

 private:
  // Group `index` of row `row` (rows of `width` groups) of the stage starting at group `first`.
  JF_HD int* counter(int64_t first, int64_t row, int64_t width, int64_t index) const {
    return counters.data + 2 * (first + row * width + index);
  }
};

inline DecoderWorkspace::DecoderWorkspace(const DecoderDims& d, char* base,
                                          int64_t attn_splits) {
  const DecoderLayout lay = decoder_layout(d);
  auto floats = [&](int64_t offset) { return reinterpret_cast<float*>(base + offset); };
  hidden = {floats(lay.hidden), d.D};
  row_sumsq = {floats(lay.row_sumsq), d.hidden_tiles()};
  qkv = {{{floats(lay.qkv), d.qkv_dim()}, d.hd}, d.q_dim(), d.kv_dim()};
  attn_out = {{floats(lay.attn_out), d.q_dim()}, d.hd};
  mlp_act = {floats(lay.mlp_act), d.I};
  attn_partials = {floats(lay.attn_partials), d.H, d.hd, attn_splits};
  gemv_partials = {floats(lay.gemv_partials), gemv_region_items(d), d.B, d.tile()};
  counters = {reinterpret_cast<int*>(base + lay.counters), lay.num_counters,
              lay.embed_counters, lay.qkv_counters, lay.o_proj_counters, lay.gate_up_counters,
              lay.down_counters, lay.attn_counters, lay.sample_counter, lay.sample_keys,
              lay.select_arrivals, lay.select_flags, lay.select_states, lay.select_counts,
              lay.select_masses,
              d.qkv_tiles(), d.hidden_tiles(), d.mlp_tiles(),
              d.B, d.KV, d.head_chunks()};
  if (d.timeline) {
    timeline = reinterpret_cast<TimelineHeader*>(base + lay.timeline);
    time_slots = timeline_slots(d.L);
  }
}

// The stacked layer weights, in operand order: X(name, flag, kind, dims...). A weight has shape
// [L, dims...] when `flag` is set and [L, 0] when not (`always` is always set); the names in
// `dims` and `flag` are those of decoder_weight_shapes(). Its dtype is by kind: `model` x's,
// `matrix` the matrices' (x's, or int8 / fp8 when quantized), `scale` float32. This is the one
// list of the weights: the operand names, the FFI binding, DecoderWeights, the shape and dtype
// checks and Python's shapes and dtypes (contract()) are all made from it.
#define JAXFUSE_DECODER_WEIGHTS(X)               \
  X(attn_norm, always, model, D)                 \
  X(wq, always, matrix, D, q_dim)                \
  X(wk, always, matrix, D, kv_dim)               \
  X(wv, always, matrix, D, kv_dim)               \
  X(wo, always, matrix, q_dim, D)                \
  X(mlp_norm, always, model, D)                  \
  X(w_gate, always, matrix, D, I)                \
  X(w_up, always, matrix, D, I)                  \
  X(w_down, always, matrix, I, D)                \
  X(q_bias, qkv_bias, model, q_dim)              \
  X(k_bias, qkv_bias, model, kv_dim)             \
  X(v_bias, qkv_bias, model, kv_dim)             \
  X(q_norm, qk_norm, model, hd)                  \
  X(k_norm, qk_norm, model, hd)                  \
  X(wq_scale, quantized, scale, q_dim)           \
  X(wk_scale, quantized, scale, kv_dim)          \
  X(wv_scale, quantized, scale, kv_dim)          \
  X(wo_scale, quantized, scale, D)               \
  X(w_gate_scale, quantized, scale, I)           \
  X(w_up_scale, quantized, scale, I)             \
  X(w_down_scale, quantized, scale, D)

#define JF_DECODER_WEIGHT_NAME(name, ...) #name,
#define JF_DECODER_WEIGHT_FLAG(name, flag, ...) #flag,
#define JF_DECODER_WEIGHT_KIND(name, flag, kind, ...) #kind,
// Operand and result names in call order; a name in both lists is updated in place.
inline constexpr const char* kDecoderOperands[] = {
    "x", "positions", "rope_inv_freq", JAXFUSE_DECODER_WEIGHTS(JF_DECODER_WEIGHT_NAME)
    "k_cache", "v_cache", "tokens", "embed", "final_norm", "lm_head", "lm_head_scale",
    "sample_key"};
inline constexpr const char* kDecoderResults[] = {"out",    "k_cache",     "v_cache",
                                                  "logits", "next_tokens", "workspace"};
inline constexpr const char* kDecoderWeightFlags[] = {
    JAXFUSE_DECODER_WEIGHTS(JF_DECODER_WEIGHT_FLAG)};
inline constexpr const char* kDecoderWeightKinds[] = {
    JAXFUSE_DECODER_WEIGHTS(JF_DECODER_WEIGHT_KIND)};
#undef JF_DECODER_WEIGHT_KIND
#undef JF_DECODER_WEIGHT_FLAG
#undef JF_DECODER_WEIGHT_NAME
inline constexpr int kDecoderFirstWeight = 3;  // attn_norm
inline constexpr int kDecoderWeights = int(std::size(kDecoderWeightFlags));

// The call's attributes (DecoderConfig), decoded as one struct.
#define JAXFUSE_DECODER_SIZE_ATTRS(X)                                                      \
  X(num_layers) X(hidden_size) X(num_heads) X(num_kv_heads) X(head_dim) X(intermediate_size) \
  X(max_seq_len)
struct DecoderAttrs {
#define JF_DECODER_I64_FIELD(name) int64_t name;
  JAXFUSE_DECODER_SIZE_ATTRS(JF_DECODER_I64_FIELD)
#undef JF_DECODER_I64_FIELD
  float rms_norm_eps;
#define JF_DECODER_FLAG_FIELD(name) bool name;
  JAXFUSE_DECODER_FLAGS(JF_DECODER_FLAG_FIELD)
  JAXFUSE_DECODER_STEP_FLAGS(JF_DECODER_FLAG_FIELD)
#undef JF_DECODER_FLAG_FIELD
  float temperature;
  int64_t top_k;
  float top_p;
};
inline constexpr const char* kDecoderSizeAttrs[] = {JAXFUSE_DECODER_SIZE_ATTRS(JF_VECTOR_NAME)};

// The stacked layer weights' buffers, by name.
struct DecoderWeights {
#define JF_DECODER_WEIGHT_FIELD(name, ...) const void* name;
  JAXFUSE_DECODER_WEIGHTS(JF_DECODER_WEIGHT_FIELD)
#undef JF_DECODER_WEIGHT_FIELD
};

// The shape and dtype each weight must have, in operand order.
struct DecoderWeightShape {
  const char* name;
  std::vector<int64_t> dims;
  DType dtype;
};
inline std::vector<DecoderWeightShape> decoder_weight_shapes(const DecoderDims& d) {
  // The names JAXFUSE_DECODER_WEIGHTS writes its dims, flags and kinds in.
  const int64_t L = d.L, D = d.D, I = d.I, hd = d.hd, q_dim = d.q_dim(), kv_dim = d.kv_dim();
  const bool always = true;
#define JF_DECODER_FLAG_LOCAL(name) const bool name = d.name;
  JAXFUSE_DECODER_FLAGS(JF_DECODER_FLAG_LOCAL)
#undef JF_DECODER_FLAG_LOCAL
  const DType model = d.dtype, matrix = d.wdtype, scale = DType::kF32;
#define JF_DECODER_WEIGHT_SHAPE(name, flag, kind, ...)                                     \
  {#name, flag ? std::vector<int64_t>{L, __VA_ARGS__} : std::vector<int64_t>{L, 0}, kind},
  return {JAXFUSE_DECODER_WEIGHTS(JF_DECODER_WEIGHT_SHAPE)};
#undef JF_DECODER_WEIGHT_SHAPE
}

// Layer `layer` of a stacked weight whose layers hold `layer_size` elements of dtype t.
JF_HD const void* layer_slice(const void* stacked, DType t, int64_t layer, int64_t layer_size) {
  return element_ptr(stacked, t, layer * layer_size);
}

// Layer `layer` of a matrix's per-column scales [L, columns], or null when not quantized.
JF_HD const float* layer_scales(const DecoderDims& d, const void* scales, int64_t layer,
                                int64_t columns) {
  return d.quantized ? static_cast<const float*>(scales) + layer * columns : nullptr;
}

// The operand buffers, by role.
struct DecoderBuffers {
  const void* x;
  const int32_t* positions;
  const float* rope_inv_freq;  // [hd/2]
  DecoderWeights weights;
  // The whole-model step's (model_step; else null): tokens [B], embed [V, D], final_norm [D],
  // the head [V, D] (lm_head, or embed when tied), and a quantized head's row scales [V] (null
  // when the head is in the model's dtype).
  const int32_t* tokens;
  const void* embed;
  const void* final_norm;
  const void* head;
  const float* head_scale;
  const uint32_t* sample_key;  // [2] (sample)
  void* k_cache;               // the results (aliased to the operands)
  void* v_cache;
  void* out;
  float* logits;         // [B, V] (model_step)
  int32_t* next_tokens;  // [B] (sample)
  char* workspace;

  // Whether row b's token is in the vocabulary (a whole-model step's; the others have none).
  JF_HD bool token_valid(int64_t b, int64_t vocab) const {
    return tokens[b] >= 0 && int64_t(tokens[b]) < vocab;
  }
  // Row b's cache position, or -1 (an invalid row: no cache access, NaN output) when its token
  // is outside the vocabulary of a whole-model step.
  JF_HD int32_t row_position(int64_t b, int64_t vocab) const {
    if (tokens != nullptr && !token_valid(b, vocab)) return -1;
    return positions[b];
  }
  // How the next tokens are drawn (the key is device data: read where the sampling runs).
  JF_HD SampleRule sample_rule(float temperature, int64_t top_k, float top_p) const {
    return {temperature == 0.0f, temperature, sample_key[0], sample_key[1], top_k, top_p};
  }
};

namespace decoder_detail {

// Each size in [1, INT32_MAX) (max_seq_len: positions are int32), so that no product of two
// sizes overflows int64: a wrapped product (e.g. num_heads * head_dim) could otherwise match
// the operand shapes and the workspace size and send the kernels far out of bounds.
inline ffi::Error check_attrs(const DecoderAttrs& a) {
  const int64_t sizes[] = {
#define JF_DECODER_SIZE_VALUE(name) a.name,
      JAXFUSE_DECODER_SIZE_ATTRS(JF_DECODER_SIZE_VALUE)
#undef JF_DECODER_SIZE_VALUE
  };
  for (size_t i = 0; i < std::size(sizes); ++i) {
    if (sizes[i] < 1 || sizes[i] >= INT32_MAX) {
      return invalid_argument(kDecoderSizeAttrs[i], "=", sizes[i],
                              " must be a positive integer below ", INT32_MAX);
    }
  }
  if (a.num_heads % a.num_kv_heads != 0) {
    return invalid_argument("num_heads=", a.num_heads, " is not a multiple of num_kv_heads=",
                            a.num_kv_heads);
  }
  if (a.head_dim % 2 != 0) return invalid_argument("head_dim=", a.head_dim, " must be even");
  if (!(a.rms_norm_eps >= 0.0f) || !std::isfinite(a.rms_norm_eps)) {
    return invalid_argument("rms_norm_eps=", a.rms_norm_eps, " must be finite and >= 0");
  }
  if (!(a.temperature >= 0.0f) || !std::isfinite(a.temperature)) {
    return invalid_argument("temperature=", a.temperature, " must be finite and >= 0");
  }
  if (a.sample && !a.model_step) return invalid_argument("sample needs model_step");
  if (a.top_k < 0 || a.top_k >= INT32_MAX) {
    return invalid_argument("top_k=", a.top_k, " must be in [0, ", INT32_MAX, ") (0: off)");
  }
  if (!(a.top_p > 0.0f && a.top_p <= 1.0f)) {
    return invalid_argument("top_p=", a.top_p, " must be in (0, 1] (1: off)");
  }
  if ((a.top_k > 0 || a.top_p < 1.0f) && !(a.sample && a.temperature > 0.0f)) {
    return invalid_argument("top_k and top_p filter a draw: they need sample and temperature > 0");
  }
  return ffi::Error::Success();
}

inline DecoderDims dims_of(const DecoderAttrs& a, int64_t batch, DType dtype) {
  DecoderDims d;
  d.L = a.num_layers;
  d.B = batch;
  d.D = a.hidden_size;
  d.H = a.num_heads;
  d.KV = a.num_kv_heads;
  d.hd = a.head_dim;
  d.I = a.intermediate_size;
  d.S = a.max_seq_len;
  d.eps = a.rms_norm_eps;
#define JF_DECODER_FLAG_COPY(name) d.name = a.name;
  JAXFUSE_DECODER_FLAGS(JF_DECODER_FLAG_COPY)
  JAXFUSE_DECODER_STEP_FLAGS(JF_DECODER_FLAG_COPY)
#undef JF_DECODER_FLAG_COPY
  d.temperature = a.temperature;
  d.top_k = a.top_k;
  d.top_p = a.top_p;
  d.dtype = dtype;
  d.wdtype = dtype;
  return d;
}

// The storage dtype of a buffer: a float dtype of x, or a quantized matrix's.
inline std::optional<DType> storage_dtype(ffi::DataType t) {
  if (t == ffi::DataType::S8) return DType::kI8;
  if (t == ffi::DataType::F8E4M3FN) return DType::kF8E4M3;
  return to_dtype(t);
}

// The matrices' dtype: x's, or with `quantized` wq's, which must be int8 or float8_e4m3fn.
inline ffi::Error matrix_dtype(const DecoderDims& d, const ffi::AnyBuffer& wq, DType* out) {
  *out = d.dtype;
  if (!d.quantized) return ffi::Error::Success();
  const auto t = storage_dtype(wq.element_type());
  if (t != DType::kI8 && t != DType::kF8E4M3) {
    return invalid_argument("wq must be int8 or float8_e4m3fn when quantized is set");
  }
  *out = *t;
  return ffi::Error::Success();
}

// Buffer `name` must have `dtype` and exactly `shape`.
inline ffi::Error check_buffer(const char* name, const ffi::AnyBuffer& b, DType dtype,
                               const std::vector<int64_t>& shape) {
  if (storage_dtype(b.element_type()) != dtype) {
    return invalid_argument(name, " must have dtype ", dtype_name(dtype));
  }
  const auto dims = b.dimensions();
  if (dims.size() == shape.size() && std::equal(shape.begin(), shape.end(), dims.begin())) {
    return ffi::Error::Success();
  }
  std::string want = "[";
  for (int64_t s : shape) want += std::to_string(s) + ",";
  want.back() = ']';
  return invalid_argument(name, " does not have shape ", want);
}

// Each weight has its decoder_weight_shapes() shape.
inline ffi::Error check_weights(const DecoderDims& d, const ffi::AnyBuffer* const* weights) {
  const std::vector<DecoderWeightShape> shapes = decoder_weight_shapes(d);
  for (int i = 0; i < kDecoderWeights; ++i) {
    JF_RETURN_IF_ERROR(check_buffer(shapes[i].name, *weights[i], shapes[i].dtype,
                                    shapes[i].dims));
  }
  return ffi::Error::Success();
}

inline ffi::Error check_caches(const DecoderDims& d, const ffi::AnyBuffer& k_cache,
                               const ffi::AnyBuffer& v_cache, const ffi::AnyBuffer& k_out,
                               const ffi::AnyBuffer& v_out) {
  const std::vector<int64_t> shape = {d.L, d.B, d.S, d.KV, d.hd};
  JF_RETURN_IF_ERROR(check_buffer("k_cache", k_cache, d.dtype, shape));
  JF_RETURN_IF_ERROR(check_buffer("v_cache", v_cache, d.dtype, shape));
  JF_RETURN_IF_ERROR(check_buffer("k_cache result", k_out, d.dtype, shape));
  JF_RETURN_IF_ERROR(check_buffer("v_cache result", v_out, d.dtype, shape));
  if (k_out.untyped_data() != k_cache.untyped_data() ||
      v_out.untyped_data() != v_cache.untyped_data()) {
    return internal_error("k/v cache results are not aliased to their operands "
                          "(operand_output_aliases missing)");
  }
  return ffi::Error::Success();
}

// The LM head's operands: lm_head [V, D] or [0, D] (tied) in the model's dtype and
// lm_head_scale [0]; or, quantized (lm_head_scale [V], only with quantized layers: their
// kernels' format), lm_head [V, D] in the matrices' dtype. Sets *quantized.
inline ffi::Error check_head(const DecoderDims& d, const ffi::AnyBuffer& lm_head,
                             const ffi::AnyBuffer& lm_head_scale, bool* quantized) {
  const auto scale_dims = lm_head_scale.dimensions();
  *quantized = scale_dims.size() == 1 && scale_dims[0] != 0;
  if (*quantized && !d.quantized) {
    return invalid_argument("lm_head_scale is given but the layers are not quantized (a "
                            "quantized LM head takes the layer matrices' int8 or fp8 format)");
  }
  if (*quantized) {
    JF_RETURN_IF_ERROR(check_buffer("lm_head", lm_head, d.wdtype, {d.V, d.D}));
    return check_buffer("lm_head_scale", lm_head_scale, DType::kF32, {d.V});
  }
  const bool tied = lm_head.dimensions().size() == 2 && lm_head.dimensions()[0] == 0;
  JF_RETURN_IF_ERROR(check_buffer("lm_head", lm_head, d.dtype, {tied ? 0 : d.V, d.D}));
  return check_buffer("lm_head_scale", lm_head_scale, DType::kF32, {0});
}

// The whole-model step's operands and results: with model_step, tokens [B], embed [V, D] (V >= 1
// from its shape), final_norm [D], the head (check_head), logits [B, V]; with sample,
// sample_key [2] and next_tokens [B]; the rest empty. Sets d->V and *head_quantized.
inline ffi::Error check_model_step(DecoderDims* d, const TokensBuffer& tokens,
                                   const ffi::AnyBuffer& embed, const ffi::AnyBuffer& final_norm,
                                   const ffi::AnyBuffer& lm_head,
                                   const ffi::AnyBuffer& lm_head_scale,
                                   const SampleKeyBuffer& sample_key,
                                   const ffi::AnyBuffer& logits,
                                   const ffi::AnyBuffer& next_tokens, bool* head_quantized) {
  const auto embed_dims = embed.dimensions();
  d->V = d->model_step && embed_dims.size() == 2 ? embed_dims[0] : 0;
  if (d->model_step && (d->V < 1 || d->V >= INT32_MAX)) {
    return invalid_argument("embed must have shape [V, ", d->D, "] with 1 <= V < ", INT32_MAX);
  }
  const int64_t step = d->model_step ? 1 : 0, sampled = d->sample ? 1 : 0;
  if (tokens.dimensions().size() != 1 || tokens.dimensions()[0] != step * d->B) {
    return invalid_argument("tokens must have shape [", step * d->B, "]");
  }
  JF_RETURN_IF_ERROR(check_buffer("embed", embed, d->dtype, {d->V, d->D}));
  JF_RETURN_IF_ERROR(check_buffer("final_norm", final_norm, d->dtype, {step * d->D}));
  JF_RETURN_IF_ERROR(check_head(*d, lm_head, lm_head_scale, head_quantized));
  if (sample_key.dimensions().size() != 1 || sample_key.dimensions()[0] != 2 * sampled) {
    return invalid_argument("sample_key must have shape [", 2 * sampled, "]");
  }
  JF_RETURN_IF_ERROR(check_buffer("logits", logits, DType::kF32, {d->B, d->V}));
  if (next_tokens.element_type() != ffi::DataType::S32 ||
      next_tokens.dimensions().size() != 1 || next_tokens.dimensions()[0] != sampled * d->B) {
    return invalid_argument("next_tokens must be int32 of shape [", sampled * d->B, "]");
  }
  return ffi::Error::Success();
}

}  // namespace decoder_detail

struct DecoderOp {
  static constexpr const char* kName = "jaxfuse_decoder";

  struct Call {
    DecoderDims dims;
    DecoderBuffers buffers;
  };

  template <typename Context>
  static auto binding() {
#define JF_DECODER_WEIGHT_ARG(name, ...) .template Arg<ffi::AnyBuffer>()
    return ffi::Ffi::Bind()
        .Ctx<Context>()
        .template Arg<ffi::AnyBuffer>()   // x
        .template Arg<PositionsBuffer>()  // positions
        .template Arg<RopeTableBuffer>()  // rope_inv_freq
        JAXFUSE_DECODER_WEIGHTS(JF_DECODER_WEIGHT_ARG)
        .template Arg<ffi::AnyBuffer>()   // k_cache
        .template Arg<ffi::AnyBuffer>()   // v_cache
        .template Arg<TokensBuffer>()     // tokens
        .template Arg<ffi::AnyBuffer>()   // embed
        .template Arg<ffi::AnyBuffer>()   // final_norm
        .template Arg<ffi::AnyBuffer>()   // lm_head
        .template Arg<ffi::AnyBuffer>()   // lm_head_scale
        .template Arg<SampleKeyBuffer>()  // sample_key
        .template Ret<ffi::AnyBuffer>()   // out
        .template Ret<ffi::AnyBuffer>()   // k_cache (aliased)
        .template Ret<ffi::AnyBuffer>()   // v_cache (aliased)
        .template Ret<ffi::AnyBuffer>()   // logits
        .template Ret<ffi::AnyBuffer>()   // next_tokens
        .template Ret<WorkspaceBuffer>()  // workspace
        .template Attrs<DecoderAttrs>();
#undef JF_DECODER_WEIGHT_ARG
  }

#define JF_DECODER_WEIGHT_PARAM(name, ...) ffi::AnyBuffer name,
  static ffi::Error decode(ffi::AnyBuffer x, PositionsBuffer positions,
                           RopeTableBuffer rope_inv_freq,
                           JAXFUSE_DECODER_WEIGHTS(JF_DECODER_WEIGHT_PARAM)
                           ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache, TokensBuffer tokens,
                           ffi::AnyBuffer embed, ffi::AnyBuffer final_norm,
                           ffi::AnyBuffer lm_head, ffi::AnyBuffer lm_head_scale,
                           SampleKeyBuffer sample_key,
                           ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> k_out,
                           ffi::Result<ffi::AnyBuffer> v_out, ffi::Result<ffi::AnyBuffer> logits,
                           ffi::Result<ffi::AnyBuffer> next_tokens,
                           ffi::Result<WorkspaceBuffer> workspace, DecoderAttrs attrs,
                           Call* call) {
#undef JF_DECODER_WEIGHT_PARAM
    using namespace decoder_detail;
    JF_RETURN_IF_ERROR(check_attrs(attrs));
    const auto dtype = to_dtype(x.element_type());
    if (!dtype) return invalid_argument("x must be float32, bfloat16 or float16");
    const auto x_dims = x.dimensions();
    const int64_t x_width = attrs.model_step ? 0 : attrs.hidden_size;  // tokens replace x
    if (x_dims.size() != 2 || x_dims[1] != x_width) {
      return invalid_argument("x must have shape [B, ", x_width, "]");
    }
    DecoderDims d = dims_of(attrs, x_dims[0], *dtype);
    JF_RETURN_IF_ERROR(matrix_dtype(d, wq, &d.wdtype));
    if (positions.dimensions().size() != 1 || positions.dimensions()[0] != d.B) {
      return invalid_argument("positions must have shape [", d.B, "]");
    }
    if (rope_inv_freq.dimensions().size() != 1 || rope_inv_freq.dimensions()[0] != d.hd / 2) {
      return invalid_argument("rope_inv_freq must have shape [", d.hd / 2, "] (head_dim / 2)");
    }
#define JF_DECODER_WEIGHT_ADDRESS(name, ...) &name,
    const ffi::AnyBuffer* const weights[] = {JAXFUSE_DECODER_WEIGHTS(JF_DECODER_WEIGHT_ADDRESS)};
#undef JF_DECODER_WEIGHT_ADDRESS
    JF_RETURN_IF_ERROR(check_weights(d, weights));
    JF_RETURN_IF_ERROR(check_caches(d, k_cache, v_cache, *k_out, *v_out));
    JF_RETURN_IF_ERROR(check_buffer("out", *out, d.dtype, {d.B, d.D}));
    bool head_quantized = false;
    JF_RETURN_IF_ERROR(check_model_step(&d, tokens, embed, final_norm, lm_head, lm_head_scale,
                                        sample_key, *logits, *next_tokens, &head_quantized));
    // Exactly the layout's size (Python sizes it from the same decoder_layout()).
    const int64_t need = decoder_layout(d).total;
    if (workspace->dimensions().size() != 1 || workspace->dimensions()[0] != need) {
      return invalid_argument("workspace has ", workspace->element_count(), " bytes, expected ",
                              need);
    }
    call->dims = d;
    DecoderBuffers& b = call->buffers;
    b = DecoderBuffers{};
    b.x = x.untyped_data();
    b.positions = positions.typed_data();
    b.rope_inv_freq = rope_inv_freq.typed_data();
#define JF_DECODER_WEIGHT_DATA(name, ...) name.untyped_data(),
    b.weights = {JAXFUSE_DECODER_WEIGHTS(JF_DECODER_WEIGHT_DATA)};
#undef JF_DECODER_WEIGHT_DATA
    if (d.model_step) {
      b.tokens = tokens.typed_data();
      b.embed = embed.untyped_data();
      b.final_norm = final_norm.untyped_data();
      b.head = lm_head.element_count() ? lm_head.untyped_data() : embed.untyped_data();
      if (head_quantized) b.head_scale = static_cast<const float*>(lm_head_scale.untyped_data());
      b.logits = static_cast<float*>(logits->untyped_data());
    }
    if (d.sample) {
      b.sample_key = sample_key.typed_data();
      b.next_tokens = static_cast<int32_t*>(next_tokens->untyped_data());
    }
    b.k_cache = k_out->untyped_data();
    b.v_cache = v_out->untyped_data();
    b.out = out->untyped_data();
    b.workspace = reinterpret_cast<char*>(workspace->typed_data());
    return ffi::Error::Success();
  }

  template <typename Platform>
  static ffi::Error run(typename Platform::Arg ctx, const Call& call);

  static Contract contract() {
    Contract c;
    c.names["operands"] = name_list(kDecoderOperands);
    c.names["results"] = name_list(kDecoderResults);
    c.names["weights"] = std::vector<std::string>(
        kDecoderOperands + kDecoderFirstWeight, kDecoderOperands + kDecoderFirstWeight +
        kDecoderWeights);
    c.names["weight_flags"] = name_list(kDecoderWeightFlags);  // "always" or a bool attribute
    c.names["weight_kinds"] = name_list(kDecoderWeightKinds);  // "model", "matrix", "scale"
    c.names["size_attrs"] = name_list(kDecoderSizeAttrs);
    c.names["f32_attrs"] = {"rms_norm_eps"};
    c.names["bool_attrs"] = name_list(kDecoderFlags);
    // The whole-model step's operands (after the caches) and attributes (not config fields).
    c.names["model_operands"] = {"tokens",  "embed",         "final_norm",
                                 "lm_head", "lm_head_scale", "sample_key"};
    c.names["step_bool_attrs"] = name_list(kDecoderStepFlags);
    c.names["step_i64_attrs"] = {"top_k"};
    c.names["step_f32_attrs"] = {"temperature", "top_p"};
    // workspace(batch=, dtype_bytes=, sample_filter=, timeline=, <size attrs>=) ->
    // numbers["bytes"], and the timeline's place and shape
    c.functions["workspace"] = [](const std::map<std::string, int64_t>& args) {
      // The layout depends on the dtype only through its width (f16 and bf16 lay out alike),
      // and on the draw only through whether it is filtered.
      const DType dtype = contract_arg(args, "dtype_bytes") == 4 ? DType::kF32 : DType::kBF16;
      DecoderDims d = decoder_detail::dims_of(contract_attrs(args),
                                              contract_arg(args, "batch"), dtype);
      d.top_k = contract_arg(args, "sample_filter") != 0 ? 1 : 0;  // any filter lays out alike
      d.timeline = contract_arg(args, "timeline") != 0;
      const DecoderLayout layout = decoder_layout(d);
      ContractValues v;
      v.numbers["bytes"] = layout.total;
      // With `timeline`: where it starts, its rows and slots, and its records' fields (the
      // StageTime words, then the header's).
      v.numbers["timeline"] = layout.timeline;
      v.numbers["timeline_blocks"] = kDecTimelineBlocks;
      v.numbers["timeline_slots"] = timeline_slots(d.L);
      v.numbers["timeline_header_bytes"] = sizeof(TimelineHeader);
      v.numbers["timeline_record_bytes"] = sizeof(StageTime);
      return v;
    };
    // weight_shapes(<size attrs>=, <bool attrs>=) -> shapes[weight name]
    c.functions["weight_shapes"] = [](const std::map<std::string, int64_t>& args) {
      DecoderAttrs a = contract_attrs(args);
#define JF_DECODER_READ_FLAG(name) a.name = contract_arg(args, #name) != 0;
      JAXFUSE_DECODER_FLAGS(JF_DECODER_READ_FLAG)
#undef JF_DECODER_READ_FLAG
      ContractValues v;
      for (const DecoderWeightShape& s :
           decoder_weight_shapes(decoder_detail::dims_of(a, 0, DType::kF32))) {
        v.shapes[s.name] = s.dims;
      }
      return v;
    };
    return c;
  }

  // The position of operand `name` in kDecoderOperands.
  static size_t operand_index(std::string_view name) {
    for (size_t i = 0; i < std::size(kDecoderOperands); ++i) {
      if (name == kDecoderOperands[i]) return i;
    }
    throw std::invalid_argument(str_cat("jaxfuse_decoder has no operand ", name));
  }

  // The size attributes among a contract function's arguments (the others zero).
  static DecoderAttrs contract_attrs(const std::map<std::string, int64_t>& args) {
    DecoderAttrs a{};
    a.top_p = 1.0f;
#define JF_DECODER_READ_ARG(name) a.name = contract_arg(args, #name);
    JAXFUSE_DECODER_SIZE_ATTRS(JF_DECODER_READ_ARG)
#undef JF_DECODER_READ_ARG
    return a;
  }

  // A memset of the stage counters and one cooperative kernel (cuda/decoder.cu); nothing for
  // an empty batch. Reads x, positions, every weight and the caches, counted as if attention
  // read every cache position (at most: it reads positions 0..p of each row), and in a
  // whole-model step the head (lm_head and its scales, or the tied embedding) and B rows of the
  // embedding; writes out, one K and V row per layer and batch row, the logits and next tokens,
  // and the workspace (at most, its full size).
  static CallCost cost(const CallShape& shape) {
    CallCost c;
    const int64_t batch = shape.operands.at(1).elements();  // positions
    if (batch == 0) return c;
    c.cuda_kernels = 1;
    c.cuda_memsets = 1;
    c.bytes_upper_bound = true;
    c.bytes_read = CallShape::total_bytes(shape.operands);
    const CallShape::Buffer& embed = shape.operands.at(operand_index("embed"));
    if (shape.operands.at(operand_index("lm_head")).elements() > 0 && embed.dims.size() == 2) {
      const int64_t gathered = std::min(embed.dims[0], batch) * embed.dims[1];
      c.bytes_read -= (embed.elements() - gathered) * embed.element_bytes;
    }
    const int64_t new_kv = 2 * contract_arg(shape.attrs, "num_layers") * batch *
                           contract_arg(shape.attrs, "num_kv_heads") *
                           contract_arg(shape.attrs, "head_dim") *
                           shape.operands.at(0).element_bytes;
    c.bytes_written = new_kv;
    for (size_t r : {0, 3, 4, 5}) c.bytes_written += shape.results.at(r).bytes();
    return c;
  }
};

}  // namespace jaxfuse

// Members in DecoderAttrs order (the struct is built from them in order).
#define JF_DECODER_I64_MEMBER(name) ::xla::ffi::StructMember<int64_t>(#name),
#define JF_DECODER_BOOL_MEMBER(name) ::xla::ffi::StructMember<bool>(#name),
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(::jaxfuse::DecoderAttrs,
                                      JAXFUSE_DECODER_SIZE_ATTRS(JF_DECODER_I64_MEMBER)
                                      ::xla::ffi::StructMember<float>("rms_norm_eps"),
                                      JAXFUSE_DECODER_FLAGS(JF_DECODER_BOOL_MEMBER)
                                      JAXFUSE_DECODER_STEP_FLAGS(JF_DECODER_BOOL_MEMBER)
                                      ::xla::ffi::StructMember<float>("temperature"),
                                      ::xla::ffi::StructMember<int64_t>("top_k"),
                                      ::xla::ffi::StructMember<float>("top_p"));
#undef JF_DECODER_BOOL_MEMBER
#undef JF_DECODER_I64_MEMBER
