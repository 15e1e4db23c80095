// The CPU decoder's decode step (DecodeStep): the stages of the CUDA kernel (decoder.cu) in the
// same order, without its split of the work. The GEMV stages are decoder.cc, the RoPE, cache
// append and attention stages decoder_attention.cc.
#pragma once

#include <cmath>

#include "decoder/decoder.h"

#include "core/cpu/common.h"
#include "decoder/cpu/decoder_gemv.h"

namespace jaxfuse::cpu_decoder {

// Normalized rows: out[b, :] = rmsnorm(h[b, :]) * w (fp32), w [D] in d.dtype (decoder.cc).
void rmsnorm_rows(const DecoderDims& d, const WorkspaceRows& h, const void* w,
                  const WorkspaceRows& out);

// One decode step: the stages below, layer by layer, each over all batch rows.
struct DecodeStep {
  ffi::ThreadPool* pool;
  const DecoderDims& d;
  const DecoderBuffers& io;
  const DecoderWeights& w;
  const DType dtype;
  DecoderWorkspace ws;
  const float attn_scale;
  WorkspaceRows normed;  // [B][D]: the current RMSNorm's output, the GEMV input
  WorkspaceRows gate;    // [B][I]: the gate projection
  float* gemv_partials;  // the GEMVs' split partial sums

  DecodeStep(ffi::ThreadPool* thread_pool, const DecoderDims& dims, const DecoderBuffers& buffers)
      : pool(thread_pool), d(dims), io(buffers), w(buffers.weights), dtype(dims.dtype),
        ws(dims, buffers.workspace), attn_scale(1.0f / std::sqrt(float(dims.hd))) {
    // The GEMV region of the workspace (the CUDA kernel's partials) is sized for these too.
    float* scratch = ws.gemv_partials.data;
    normed = {scratch, d.D};
    gate = {scratch + d.B * d.D, d.I};
    gemv_partials = scratch + d.B * (d.D + d.I);
  }

  void run() {
    timed(0, [&] {
      if (d.model_step) {
        embed_tokens();
      } else {
        load_tile(io.x, dtype, 0, d.B * d.D, ws.hidden.data);  // h = float(x)
      }
    });
    for (int64_t l = 0; l < d.L; ++l) {
      for (int s = 0; s < kLayerStages; ++s) {
        const LayerStage stage = LayerStage(s);
        timed(stage_slot(l, stage), [&] { run_layer_stage(l, stage); });
      }
    }
    write_output();
    if (d.model_step) timed(head_slot(d.L), [&] { lm_head(); });
    if (d.sample) timed(sample_slot(d.L), [&] { sample_tokens(); });
    if (d.timeline) ws.timeline->blocks = 1;
  }

  // Layer l's stage `stage` (decoder_plan.h's order).
  void run_layer_stage(int64_t l, LayerStage stage) {
    switch (stage) {
      case LayerStage::kQkv: return rmsnorm_qkv(l);
      case LayerStage::kAttention:
        rope_append_kv(l);
        return attention(l);
      case LayerStage::kOProj: return o_proj(l);
      case LayerStage::kGateUp: return gate_up(l);
      case LayerStage::kDown: return down(l);
    }
  }

  // Runs `stage`, recorded as timeline slot `slot` (block 0's, no waits) in a call with the
  // `timeline` flag.
  template <typename Stage>
  void timed(int64_t slot, const Stage& stage) {
    const unsigned long long begin = d.timeline ? steady_clock_ns() : 0;
    stage();
    if (StageTime* record = ws.stage_time(0, slot)) {
      *record = StageTime{begin, 0, steady_clock_ns(), 0, 0};
    }
  }

  // Row b's cache position (-1 for a token outside the vocabulary: decoder.h).
  int32_t position(int64_t b) const { return io.row_position(b, d.V); }

  // Layer l of stacked weight `stacked` ([L, layer_size]).
  const void* layer(const void* stacked, int64_t l, int64_t layer_size) const {
    return layer_slice(stacked, dtype, l, layer_size);
  }

  // Layer l of a stacked matrix [L, K, N] and its per-column scales [L, N] (when quantized).
  GemvWeights matrix(const void* stacked, const void* scales, int64_t l, int64_t K,
                     int64_t N) const {
    return {layer_slice(stacked, d.wdtype, l, K * N), d.wdtype, layer_scales(d, scales, l, N),
            K, N};
  }

  // Element index of kv head `kv_head` at `position` of the caches [L, B, S, KV, hd].
  int64_t cache_index(int64_t l, int64_t b, int64_t position, int64_t kv_head) const {
    return ((l * d.B + b) * d.S + position) * d.kv_dim() + kv_head * d.hd;
  }

  // The residual GEMV epilogue: h += y.
  auto add_to_hidden() const {
    return [this](int64_t b, int64_t n0, int64_t len, const float* y) {
      float* hb = ws.hidden.at(b, n0);
      for (int64_t i = 0; i < len; ++i) hb[i] += y[i];
    };
  }

  // [q | k | v] = (rmsnorm(h) * attn_norm) @ [wq | wk | wv] (+ [q_bias | k_bias | v_bias])
  void rmsnorm_qkv(int64_t l);
  // Per-head q/k RMSNorm (qk_norm) and RoPE on q and k, then k and v appended (rounded to the
  // cache dtype) at [l, b, p].
  void rope_append_kv(int64_t l);
  // One work item per (batch row, kv head, chunk of its query heads).
  void attention(int64_t l);
  // Online softmax of query heads first .. first + heads - 1 (all on kv head `kv_head`) of row b
  // over the cache positions 0..p, as the CUDA kernel's work item: each K and V row is read (and
  // widened from a 16-bit cache) once for all the chunk's heads.
  void attend_heads(int64_t l, int64_t b, int64_t kv_head, int64_t first, int64_t heads) const;
  // h += attn_out @ wo
  void o_proj(int64_t l);
  // mlp_act = silu(m @ w_gate) * (m @ w_up), m = rmsnorm(h) * mlp_norm
  void gate_up(int64_t l);
  // h += mlp_act @ w_down
  void down(int64_t l);
  // out = h, or NaN for rows whose position is out of range.
  void write_output();
  // The whole-model step (decoder_head.cc): h = embed[tokens[b]] (zero for a token outside the
  // vocabulary); logits = (rmsnorm(h) * final_norm, rounded to the model's dtype) @ head^T,
  // times a quantized head's row scales;
  // next_tokens = the argmax of each row's sampling scores (sampling_math.h).
  void embed_tokens();
  void lm_head();
  void sample_tokens();
};

}  // namespace jaxfuse::cpu_decoder
