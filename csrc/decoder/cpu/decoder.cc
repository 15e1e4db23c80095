// jaxfuse_decoder, CPU: one decode step of an L-layer Llama-style decoder (RMSNorm, GQA attention
// with RoPE over a KV cache, SwiGLU MLP), in one FFI call. DecodeStep (decoder_step.h) runs the
// stages of the CUDA kernel (decoder.cu) in the same order, without its split of the work: per
// layer rmsnorm + QKV, RoPE + KV append, attention, O projection, gate/up, down (each timed
// in a call with the `timeline` flag). The GEMVs
// (decoder_gemv.h) and the attention heads (decoder_attention.cc) are spread over XLA's intra-op
// thread pool; all arithmetic is fp32 (decoder_math.h, shared with the CUDA kernel); activations
// and partial sums live in the workspace result (DecoderWorkspace): per layer the handler
// allocates only bookkeeping (a norm's weights in fp32, the GEMVs' arrival counters).
// Operand layout: decoder.h. This file: the GEMV stages and the handler.
#include <algorithm>
#include <vector>

#include "decoder/cpu/decoder_gemv.h"
#include "decoder/cpu/decoder_step.h"

namespace jaxfuse::cpu_decoder {

void rmsnorm_rows(const DecoderDims& d, const WorkspaceRows& h, const void* w,
                  const WorkspaceRows& out) {
  std::vector<float> wf(d.D);
  load_tile(w, d.dtype, 0, d.D, wf.data());
  for (int64_t b = 0; b < d.B; ++b) {
    const float* hb = h.row(b);
    float ss = 0.0f;
    for (int64_t i = 0; i < d.D; ++i) ss += hb[i] * hb[i];
    const float r = rms_inv(ss, d.D, d.eps);
    for (int64_t i = 0; i < d.D; ++i) *out.at(b, i) = rms_apply(hb[i], r, wf[i]);
  }
}

void DecodeStep::rmsnorm_qkv(int64_t l) {
  rmsnorm_rows(d, ws.hidden, layer(w.attn_norm, l, d.D), normed);
  const int64_t q_dim = d.q_dim(), kv_dim = d.kv_dim();
  const GemvWeights matrices[3] = {matrix(w.wq, w.wq_scale, l, d.D, q_dim),
                                   matrix(w.wk, w.wk_scale, l, d.D, kv_dim),
                                   matrix(w.wv, w.wv_scale, l, d.D, kv_dim)};
  // Only with qkv_bias: otherwise the bias operands are empty (possibly null) buffers.
  const void* biases[3] = {nullptr, nullptr, nullptr};
  if (d.qkv_bias) {
    biases[0] = layer(w.q_bias, l, q_dim);
    biases[1] = layer(w.k_bias, l, kv_dim);
    biases[2] = layer(w.v_bias, l, kv_dim);
  }
  for (int m = 0; m < 3; ++m) {
    gemv(pool, d.B, normed.data, d.D, matrices[m], gemv_partials,
         [&](int64_t b, int64_t n0, int64_t len, const float* y) {
           float* out = ws.qkv.column(b, m, n0);
           for (int64_t i = 0; i < len; ++i) {
             out[i] = d.qkv_bias ? y[i] + load_as_float(biases[m], dtype, n0 + i) : y[i];
           }
         });
  }
}

void DecodeStep::o_proj(int64_t l) {
  const int64_t q_dim = d.q_dim();
  gemv(pool, d.B, ws.attn_out.data, q_dim, matrix(w.wo, w.wo_scale, l, q_dim, d.D),
       gemv_partials, add_to_hidden());
}

void DecodeStep::gate_up(int64_t l) {
  rmsnorm_rows(d, ws.hidden, layer(w.mlp_norm, l, d.D), normed);
  gemv(pool, d.B, normed.data, d.D, matrix(w.w_gate, w.w_gate_scale, l, d.D, d.I),
       gemv_partials, [&](int64_t b, int64_t n0, int64_t len, const float* y) {
         std::copy_n(y, len, gate.at(b, n0));
       });
  gemv(pool, d.B, normed.data, d.D, matrix(w.w_up, w.w_up_scale, l, d.D, d.I),
       gemv_partials, [&](int64_t b, int64_t n0, int64_t len, const float* y) {
         const float* g = gate.at(b, n0);
         float* a = ws.mlp_act.at(b, n0);
         for (int64_t i = 0; i < len; ++i) a[i] = swiglu(g[i], y[i]);
       });
}

void DecodeStep::down(int64_t l) {
  gemv(pool, d.B, ws.mlp_act.data, d.I, matrix(w.w_down, w.w_down_scale, l, d.I, d.D),
       gemv_partials, add_to_hidden());
}

void DecodeStep::write_output() {
  for (int64_t b = 0; b < d.B; ++b) {
    const int64_t first = b * d.D;  // of out's row b
    if (position_valid(position(b), d.S)) {
      store_tile(io.out, dtype, first, d.D, ws.hidden.row(b));
    } else {
      for (int64_t i = 0; i < d.D; ++i) store_from_float(io.out, dtype, first + i, quiet_nan_f32());
    }
  }
}

}  // namespace jaxfuse::cpu_decoder

namespace jaxfuse {

template <>
ffi::Error DecoderOp::run<Cpu>(ffi::ThreadPool pool, const Call& call) {
  if (call.dims.B == 0) return ffi::Error::Success();
  cpu_decoder::DecodeStep(&pool, call.dims, call.buffers).run();
  return ffi::Error::Success();
}

JAXFUSE_REGISTER_OP(DecoderOp, Cpu);

}  // namespace jaxfuse
