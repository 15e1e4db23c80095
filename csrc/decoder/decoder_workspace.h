// The jaxfuse_decoder op's workspace: the layout of its regions (decoder_layout(), the size
// Python allocates, read from the contract) and its typed views (DecoderWorkspace), which the
// CPU twin and both CUDA schedules use: fp32 activations, the split partial sums, the work
// groups' counters and, with the `timeline` flag, every block's times in every stage.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>

#include "decoder/decoder_plan.h"

namespace jaxfuse {

inline constexpr int64_t kDecAlign = 256;  // byte alignment of workspace regions
// The CUDA kernel's passes over the logits before a filtered draw: top-k's radix passes, a pass
// for the largest score (when top-k does not find it), top-p's radix passes.
inline constexpr int64_t kDecSamplePasses = 2 * kSelectPasses + 1;
// A timeline's rows: blocks past the first kDecTimelineBlocks record nothing.
inline constexpr int64_t kDecTimelineBlocks = 1024;

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
// The host's timeline clock (the CPU handler's, and the CUDA-on-CPU emulator's global timer).
inline unsigned long long steady_clock_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline int64_t align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

// Work items of one GEMV partial-sum region: kDecMaxGemvItems, or one per tile of the widest stage.
inline int64_t gemv_region_items(const DecoderDims& d) {
  return std::max({kDecMaxGemvItems, qkv_tiles(d), hidden_tiles(d), 2 * mlp_tiles(d)});
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
  w.row_sumsq = region(d.B * hidden_tiles(d) * f);
  w.qkv = region(d.B * d.qkv_dim() * f);
  w.attn_out = region(d.B * d.q_dim() * f);
  w.mlp_act = region(d.B * d.I * f);
  w.attn_partials = region(d.B * d.H * kDecMaxAttnSplits * (d.hd + 2) * f);
  // The CUDA kernel's split-K partials, or the CPU's GEMV scratch, whichever is larger.
  w.gemv_partials = region(
      std::max(2 * gemv_region_items(d) * d.B * gemv_tile(d), cpu_gemv_floats(d)) * f);
  w.embed_counters = 0;
  w.qkv_counters = w.embed_counters + hidden_tiles(d);
  w.o_proj_counters = w.qkv_counters + d.L * qkv_tiles(d);
  w.gate_up_counters = w.o_proj_counters + d.L * hidden_tiles(d);
  w.down_counters = w.gate_up_counters + d.L * mlp_tiles(d);
  w.attn_counters = w.down_counters + d.L * hidden_tiles(d);
  w.sample_counter = 2 * (w.attn_counters + d.L * d.B * d.KV * head_chunks(d));
  w.sample_keys = align_up(w.sample_counter + 1, 2);  // 8-byte aligned
  w.select_arrivals = w.sample_keys + 2 * d.B;
  w.select_flags = w.select_arrivals + kDecSamplePasses;
  w.select_states = align_up(w.select_flags + d.B * kDecSamplePasses, 2);
  w.select_counts = w.select_states + d.B * int64_t(sizeof(SampleSearch) / 4);
  w.select_masses = w.select_counts + d.B * kSelectBins;  // even: 8-byte aligned
  w.num_counters = d.sample_filter() ? w.select_masses + 2 * d.B * kSelectBins : w.select_arrivals;
  w.counters = region(w.num_counters * 4);
  w.timeline = region(d.timeline ? int64_t(sizeof(TimelineHeader)) + kDecTimelineBlocks *
                                       stage_slots(d.L) * int64_t(sizeof(StageTime))
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
  int64_t time_slots = 0;  // stage_slots(L)

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
  // Block `block`'s record of timeline slot `slot` (stage_slot()), or null without a
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
  row_sumsq = {floats(lay.row_sumsq), hidden_tiles(d)};
  qkv = {{{floats(lay.qkv), d.qkv_dim()}, d.hd}, d.q_dim(), d.kv_dim()};
  attn_out = {{floats(lay.attn_out), d.q_dim()}, d.hd};
  mlp_act = {floats(lay.mlp_act), d.I};
  attn_partials = {floats(lay.attn_partials), d.H, d.hd, attn_splits};
  gemv_partials = {floats(lay.gemv_partials), gemv_region_items(d), d.B, gemv_tile(d)};
  counters = {reinterpret_cast<int*>(base + lay.counters), lay.num_counters,
              lay.embed_counters, lay.qkv_counters, lay.o_proj_counters, lay.gate_up_counters,
              lay.down_counters, lay.attn_counters, lay.sample_counter, lay.sample_keys,
              lay.select_arrivals, lay.select_flags, lay.select_states, lay.select_counts,
              lay.select_masses,
              qkv_tiles(d), hidden_tiles(d), mlp_tiles(d),
              d.B, d.KV, head_chunks(d)};
  if (d.timeline) {
    timeline = reinterpret_cast<TimelineHeader*>(base + lay.timeline);
    time_slots = stage_slots(d.L);
  }
}

}  // namespace jaxfuse
