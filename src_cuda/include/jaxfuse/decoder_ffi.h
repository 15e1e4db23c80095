// The jaxfuse_decoder FFI call, shared by its CPU and CUDA handlers: operand layout, workspace
// layout and validation. The element math is in decoder_math.h.
//
// Operands (all float operands share one dtype T: f32, bf16 or f16):
//   0 x          T[B, D]
//   1 positions  s32[B]
//   2 attn_norm  T[L, D]
//   3 wq         T[L, D, H*hd]
//   4 wk         T[L, D, KV*hd]
//   5 wv         T[L, D, KV*hd]
//   6 wo         T[L, H*hd, D]
//   7 mlp_norm   T[L, D]
//   8 w_gate     T[L, D, I]
//   9 w_up       T[L, D, I]
//  10 w_down     T[L, I, D]
//  11 k_cache    T[L, B, S, KV, hd]
//  12 v_cache    T[L, B, S, KV, hd]
// Results:
//   0 out        T[B, D]
//   1 k_cache    aliased to operand 11 (updated in place at [l, b, positions[b]])
//   2 v_cache    aliased to operand 12
//   3 workspace  u8[decoder_workspace_bytes(...)]: fp32 activations, partial sums and counters.
// Attributes: num_layers, hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size,
// max_seq_len (i64), rms_norm_eps (f32), rope_theta (f64).
//
// The workspace layout is mirrored by jaxfuse/decoder.py (_workspace_bytes); keep them in step.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "jaxfuse/decoder_math.h"
#include "jaxfuse/ffi_util.h"

namespace jaxfuse {

using PositionsBuffer = ffi::Buffer<ffi::S32, 1>;
using WorkspaceBuffer = ffi::Buffer<ffi::U8, 1>;

// Constants of the workspace layout (shared with Python).
inline constexpr int64_t kDecMaxGemvItems = 1024;  // partial-sum slots per GEMV stage
inline constexpr int64_t kDecMaxAttnSplits = 64;   // flash-decoding splits of the cache length
inline constexpr int64_t kDecHeadChunk = 4;        // query heads per attention work item
inline constexpr int64_t kDecAlign = 256;          // byte alignment of workspace regions

struct DecoderDims {
  int64_t L = 0, B = 0, D = 0, H = 0, KV = 0, hd = 0, I = 0, S = 0;
  float eps = 0.f;
  double theta = 0.0;
  DType dtype = DType::kF32;

  int64_t q_dim() const { return H * hd; }
  int64_t kv_dim() const { return KV * hd; }
  int64_t group() const { return H / KV; }  // query heads per kv head
  // GEMV column tile: one 16-byte vector per lane of a warp.
  int64_t vec() const { return 16 / dtype_bytes(dtype); }
  int64_t tile() const { return 32 * vec(); }
  int64_t tiles(int64_t n) const { return (n + tile() - 1) / tile(); }
  int64_t head_chunks() const { return (group() + kDecHeadChunk - 1) / kDecHeadChunk; }
};

// Byte offsets of the workspace regions.
struct DecoderLayout {
  int64_t h, ss, qkv, attn, act, attn_part, gemv_part, counters, total;
  int64_t num_counters;
  // counter bases (in int32 units from `counters`)
  int64_t c_qkv, c_o, c_gu, c_down, c_attn;
};

inline int64_t align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

inline DecoderLayout decoder_layout(const DecoderDims& d) {
  DecoderLayout w{};
  int64_t off = 0;
  auto region = [&](int64_t bytes) {
    const int64_t at = off;
    off = align_up(off + bytes, kDecAlign);
    return at;
  };
  const int64_t f = 4;
  const int64_t nt_d = d.tiles(d.D);
  const int64_t nt_qkv = d.tiles(d.q_dim()) + 2 * d.tiles(d.kv_dim());
  const int64_t nt_i = d.tiles(d.I);
  const int64_t max_tiles = std::max({nt_qkv, nt_d, 2 * nt_i});
  w.h = region(d.B * d.D * f);
  w.ss = region(d.B * nt_d * f);
  w.qkv = region(d.B * (d.q_dim() + 2 * d.kv_dim()) * f);
  w.attn = region(d.B * d.q_dim() * f);
  w.act = region(d.B * d.I * f);
  w.attn_part = region(d.B * d.H * kDecMaxAttnSplits * (d.hd + 2) * f);
  w.gemv_part = region(std::max(kDecMaxGemvItems, max_tiles) * d.B * d.tile() * f);
  w.c_qkv = 0;
  w.c_o = w.c_qkv + d.L * nt_qkv;
  w.c_gu = w.c_o + d.L * nt_d;
  w.c_down = w.c_gu + d.L * nt_i;
  w.c_attn = w.c_down + d.L * nt_d;
  w.num_counters = w.c_attn + d.L * d.B * d.KV * d.head_chunks();
  w.counters = region(w.num_counters * 4);
  w.total = off;
  return w;
}

// The call's attributes (DecoderConfig), decoded as one struct.
struct DecoderAttrs {
  int64_t num_layers, hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size,
      max_seq_len;
  float rms_norm_eps;
  double rope_theta;
};

// Decodes and checks every operand against the attributes. On success fills `dims`.
inline ffi::Error decode_decoder_call(ffi::AnyBuffer x, PositionsBuffer positions,
                                      const ffi::AnyBuffer* weights /*9*/, ffi::AnyBuffer k_cache,
                                      ffi::AnyBuffer v_cache, ffi::AnyBuffer out,
                                      ffi::AnyBuffer k_out, ffi::AnyBuffer v_out,
                                      WorkspaceBuffer workspace, const DecoderAttrs& attrs,
                                      DecoderDims* dims) {
  const char* op = "jaxfuse_decoder: ";
  const int64_t num_layers = attrs.num_layers, hidden_size = attrs.hidden_size;
  const int64_t num_heads = attrs.num_heads, num_kv_heads = attrs.num_kv_heads;
  const int64_t head_dim = attrs.head_dim, intermediate_size = attrs.intermediate_size;
  const int64_t max_seq_len = attrs.max_seq_len;
  const float eps = attrs.rms_norm_eps;
  const double theta = attrs.rope_theta;
  // Each size in [1, INT32_MAX) (max_seq_len: positions are int32), so that no product of two
  // sizes overflows int64: a wrapped product (e.g. num_heads * head_dim) could otherwise match
  // the operand shapes and the workspace size and send the kernels far out of bounds.
  const std::pair<const char*, int64_t> sizes[7] = {
      {"num_layers", num_layers}, {"hidden_size", hidden_size},
      {"num_heads", num_heads},   {"num_kv_heads", num_kv_heads},
      {"head_dim", head_dim},     {"intermediate_size", intermediate_size},
      {"max_seq_len", max_seq_len}};
  for (const auto& [name, value] : sizes) {
    if (value < 1 || value >= INT32_MAX) {
      return invalid_argument(op, name, "=", value, " must be a positive integer below ",
                              INT32_MAX);
    }
  }
  if (num_heads % num_kv_heads != 0) {
    return invalid_argument(op, "num_heads=", num_heads, " is not a multiple of num_kv_heads=",
                            num_kv_heads);
  }
  if (head_dim % 2 != 0) return invalid_argument(op, "head_dim=", head_dim, " must be even");
  if (!(eps >= 0.0f) || !std::isfinite(eps)) {
    return invalid_argument(op, "rms_norm_eps=", eps, " must be finite and >= 0");
  }
  if (!(theta > 0.0) || !std::isfinite(theta)) {
    return invalid_argument(op, "rope_theta=", theta, " must be finite and > 0");
  }
  auto dt = to_dtype(x.element_type());
  if (!dt) return invalid_argument(op, "x must be float32, bfloat16 or float16");
  auto x_dims = x.dimensions();
  if (x_dims.size() != 2 || x_dims[1] != hidden_size) {
    return invalid_argument(op, "x must have shape [B, ", hidden_size, "]");
  }
  DecoderDims d;
  d.L = num_layers;
  d.B = x_dims[0];
  d.D = hidden_size;
  d.H = num_heads;
  d.KV = num_kv_heads;
  d.hd = head_dim;
  d.I = intermediate_size;
  d.S = max_seq_len;
  d.eps = eps;
  d.theta = theta;
  d.dtype = *dt;
  if (positions.dimensions().size() != 1 || positions.dimensions()[0] != d.B) {
    return invalid_argument(op, "positions must have shape [", d.B, "]");
  }
  auto check = [&](const char* name, ffi::AnyBuffer b,
                   std::initializer_list<int64_t> shape) -> ffi::Error {
    if (b.element_type() != x.element_type()) {
      return invalid_argument(op, name, " has a different dtype than x (", dtype_name(d.dtype), ")");
    }
    auto bd = b.dimensions();
    bool ok = bd.size() == shape.size();
    size_t i = 0;
    for (int64_t s : shape) {
      if (!ok) break;
      ok = bd[i++] == s;
    }
    if (!ok) {
      std::string want = "[";
      for (int64_t s : shape) want += std::to_string(s) + ",";
      want.back() = ']';
      return invalid_argument(op, name, " does not have shape ", want);
    }
    return ffi::Error::Success();
  };
  const char* names[9] = {"attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"};
  const std::initializer_list<int64_t> shapes[9] = {
      {d.L, d.D},           {d.L, d.D, d.q_dim()}, {d.L, d.D, d.kv_dim()},
      {d.L, d.D, d.kv_dim()}, {d.L, d.q_dim(), d.D}, {d.L, d.D},
      {d.L, d.D, d.I},      {d.L, d.D, d.I},       {d.L, d.I, d.D}};
  for (int i = 0; i < 9; ++i) JF_RETURN_IF_ERROR(check(names[i], weights[i], shapes[i]));
  JF_RETURN_IF_ERROR(check("k_cache", k_cache, {d.L, d.B, d.S, d.KV, d.hd}));
  JF_RETURN_IF_ERROR(check("v_cache", v_cache, {d.L, d.B, d.S, d.KV, d.hd}));
  JF_RETURN_IF_ERROR(check("out", out, {d.B, d.D}));
  JF_RETURN_IF_ERROR(check("k_cache result", k_out, {d.L, d.B, d.S, d.KV, d.hd}));
  JF_RETURN_IF_ERROR(check("v_cache result", v_out, {d.L, d.B, d.S, d.KV, d.hd}));
  if (k_out.untyped_data() != k_cache.untyped_data() ||
      v_out.untyped_data() != v_cache.untyped_data()) {
    return internal_error(op, "k/v cache results are not aliased to their operands "
                              "(operand_output_aliases missing)");
  }
  const DecoderLayout lay = decoder_layout(d);
  // Exactly the layout's size: a different size means jaxfuse/decoder.py (_workspace_bytes) and
  // decoder_layout() no longer agree.
  if (workspace.dimensions().size() != 1 || workspace.dimensions()[0] != lay.total) {
    return invalid_argument(op, "workspace has ", workspace.element_count(), " bytes, expected ",
                            lay.total);
  }
  *dims = d;
  return ffi::Error::Success();
}

// The handler signature, shared by the CPU and CUDA handlers (`Ctx`: the platform context).
template <typename Ctx>
auto decoder_binding() {
  return ffi::Ffi::Bind()
      .Ctx<Ctx>()
      .template Arg<ffi::AnyBuffer>()   // x
      .template Arg<PositionsBuffer>()  // positions
      .template Arg<ffi::AnyBuffer>()   // attn_norm
      .template Arg<ffi::AnyBuffer>()   // wq
      .template Arg<ffi::AnyBuffer>()   // wk
      .template Arg<ffi::AnyBuffer>()   // wv
      .template Arg<ffi::AnyBuffer>()   // wo
      .template Arg<ffi::AnyBuffer>()   // mlp_norm
      .template Arg<ffi::AnyBuffer>()   // w_gate
      .template Arg<ffi::AnyBuffer>()   // w_up
      .template Arg<ffi::AnyBuffer>()   // w_down
      .template Arg<ffi::AnyBuffer>()   // k_cache
      .template Arg<ffi::AnyBuffer>()   // v_cache
      .template Ret<ffi::AnyBuffer>()   // out
      .template Ret<ffi::AnyBuffer>()   // k_cache (aliased)
      .template Ret<ffi::AnyBuffer>()   // v_cache (aliased)
      .template Ret<WorkspaceBuffer>()  // workspace
      .template Attrs<DecoderAttrs>();
}

}  // namespace jaxfuse

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(::jaxfuse::DecoderAttrs,
                                      ::xla::ffi::StructMember<int64_t>("num_layers"),
                                      ::xla::ffi::StructMember<int64_t>("hidden_size"),
                                      ::xla::ffi::StructMember<int64_t>("num_heads"),
                                      ::xla::ffi::StructMember<int64_t>("num_kv_heads"),
                                      ::xla::ffi::StructMember<int64_t>("head_dim"),
                                      ::xla::ffi::StructMember<int64_t>("intermediate_size"),
                                      ::xla::ffi::StructMember<int64_t>("max_seq_len"),
                                      ::xla::ffi::StructMember<float>("rms_norm_eps"),
                                      ::xla::ffi::StructMember<double>("rope_theta"));

