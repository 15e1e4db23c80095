// The jaxfuse_decoder op's operands and their contract: the attributes, the stacked layer weights
// (one X-macro list), the operand buffers by role, and their validation (decoder_detail), shared
// by the CPU and CUDA handlers. The stage plan (which stages, their work items) is
// decoder_plan.h, the workspace decoder_workspace.h, the op itself decoder.h.
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
//   call's model_step, sample, timeline, stage_kernels, temperature, top_k (0: off) and top_p
//   (1: off)).
// Python reads all of these names and the workspace size from DecoderOp::contract().
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/op.h"
#include "core/vector_layout.h"
#include "decoder/decoder_math.h"
#include "decoder/sampling_math.h"

namespace jaxfuse {

using PositionsBuffer = ffi::Buffer<ffi::S32, 1>;
using RopeTableBuffer = ffi::Buffer<ffi::F32, 1>;
using WorkspaceBuffer = ffi::Buffer<ffi::U8, 1>;
using TokensBuffer = ffi::Buffer<ffi::S32, 1>;
using SampleKeyBuffer = ffi::Buffer<ffi::U32, 1>;

// The bool attributes, each a field of DecoderAttrs and DecoderDims and a name in the contract.
// The config's (DecoderConfig fields; JAXFUSE_DECODER_WEIGHTS names them as the flags of the
// optional weights):
//   qkv_bias    the q/k/v projections add a bias
//   qk_norm     per-head RMSNorm of q and k before RoPE
//   quantized   the matrices are int8 or fp8 with per-column scales
// The call's (set by persistent_decoder's callers, not config fields):
//   model_step     tokens in, embedding gathered, final norm and LM head of V rows after the
//                  last layer (V = 0 otherwise)
//   sample         the next tokens drawn in the same call
//   timeline       each block's times in each stage recorded in the workspace (StageTime)
//   stage_kernels  the CUDA kernel's stage-kernel schedule: one launch per stage, chained by
//                  programmatic dependent launch, instead of one persistent launch
//                  (decoder_plan.h; the CPU twin has one schedule)
#define JAXFUSE_DECODER_FLAGS(X) X(qkv_bias) X(qk_norm) X(quantized)
#define JAXFUSE_DECODER_STEP_FLAGS(X) X(model_step) X(sample) X(timeline) X(stage_kernels)
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
  // Whether a draw may be filtered (top-k at or above V filters nothing, found at run time):
  // the workspace then holds the CUDA kernel's search for each row's threshold.
  bool sample_filter() const { return top_k > 0 || top_p < 1.0f; }
};

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
