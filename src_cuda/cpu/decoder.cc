// jaxfuse_decoder, CPU: one decode step of an L-layer Llama-style decoder (RMSNorm, GQA attention
// with RoPE over a KV cache, SwiGLU MLP), in one FFI call. DecodeStep runs the stages of the CUDA
// kernel (decoder.cu) in the same order, without its split of the work: per layer rmsnorm + QKV,
// RoPE + KV append, attention, O projection, MLP. The GEMVs and the attention heads are spread
// over XLA's intra-op thread pool; all arithmetic is fp32 (decoder_math.h, shared with the CUDA
// kernel); temporaries live in the workspace result (DecoderWorkspace), so the handler allocates
// nothing per layer. Operand layout: decoder.h.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "jaxfuse/decoder.h"

#include "cpu_common.h"

namespace jaxfuse {
namespace {

constexpr int64_t kColBlock = 128;  // most output columns per GEMV work item
constexpr int64_t kMinColBlock = 16;
// Below this many multiply-adds a stage runs on the calling thread: handing work to the pool
// costs more than it saves for small models.
constexpr int64_t kMinParallelWork = int64_t(1) << 17;

ffi::ThreadPool* pool_for(ffi::ThreadPool* pool, int64_t work) {
  return work >= kMinParallelWork ? pool : nullptr;
}

// acc[b, 0:len] = sum_k a[b, k] * W[k, n0:n0+len] for the B rows of `a` (fp32, row stride lda),
// W [K, N] in storage `dtype`; acc has row stride kColBlock. Compiled per ISA level.
JF_CPU_MULTIVERSION
void gemv_block(int64_t B, const float* a, int64_t lda, const void* W, DType dtype, int64_t K,
                int64_t N, int64_t n0, int64_t len, float* __restrict__ acc) {
  alignas(64) float w[kColBlock];
  std::fill(acc, acc + B * kColBlock, 0.0f);
  for (int64_t k = 0; k < K; ++k) {
    // fp32 weights are read in place; 16-bit ones are widened into `w` first.
    const float* wk = dtype == DType::kF32 ? static_cast<const float*>(W) + k * N + n0 : w;
    if (dtype != DType::kF32) load_tile(W, dtype, k * N + n0, len, w);
    for (int64_t b = 0; b < B; ++b) {
      const float ab = a[b * lda + k];
      float* __restrict__ y = acc + b * kColBlock;
      for (int64_t i = 0; i < len; ++i) y[i] += ab * wk[i];
    }
  }
}

// y[b, n] = sum_k a[b, k] * W[k, n] for the B rows of `a` (fp32, row stride lda), W [K, N] in
// storage `dtype`. Column blocks are spread over the pool; epilogue(b, n0, len, y) receives each
// finished block of a row (fp32).
template <typename Epilogue>
void gemv(ffi::ThreadPool* pool, int64_t B, const float* a, int64_t lda, const void* W,
          DType dtype, int64_t K, int64_t N, const Epilogue& epilogue) {
  pool = pool_for(pool, B * K * N);
  // Column blocks: at least ~4 per thread when N allows, so small projections still spread.
  const int64_t threads = (pool == nullptr ? 0 : pool->num_threads()) + 1;
  int64_t width = (N + 4 * threads - 1) / (4 * threads);
  width = std::clamp<int64_t>((width + kMinColBlock - 1) / kMinColBlock * kMinColBlock,
                              kMinColBlock, kColBlock);
  const int64_t blocks = (N + width - 1) / width;
  parallel_for(pool, blocks, [&](int64_t blk) {
    const int64_t n0 = blk * width;
    const int64_t len = std::min(width, N - n0);
    std::vector<float> acc(B * kColBlock);
    gemv_block(B, a, lda, W, dtype, K, N, n0, len, acc.data());
    for (int64_t b = 0; b < B; ++b) epilogue(b, n0, len, acc.data() + b * kColBlock);
  });
}

// sum_i a[i] * b[i] over the 8 independent lanes of F32x8, then the lanes in order. A plain
// serial sum would be one dependent add per element.
JF_CPU_MULTIVERSION
float dot(const float* a, const float* b, int64_t n) {
  F32x8 acc = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    F32x8 va, vb;
    std::memcpy(&va, a + i, 32);
    std::memcpy(&vb, b + i, 32);
    acc += va * vb;
  }
  float sum = 0.0f;
  for (int j = 0; j < 8; ++j) sum += acc[j];
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// Normalized rows: out[b, :] = rmsnorm(h[b, :]) * w (fp32).
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

// RoPE on one head vector in place, at position p, with the frequencies inv_freq[hd/2].
void rope_head(float* v, int64_t hd, int32_t p, const float* inv_freq) {
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < half; ++i) {
    float c, s;
    rope_cos_sin(rope_angle(p, inv_freq[i]), &c, &s);
    rope_rotate(v[i], v[i + half], c, s);
  }
}

// RMSNorm of one head vector in place (Qwen3's q_norm / k_norm), weights w[hd] in `dtype`.
void rmsnorm_head(float* v, int64_t hd, const void* w, DType dtype, float eps) {
  float ss = 0.0f;
  for (int64_t i = 0; i < hd; ++i) ss += v[i] * v[i];
  const float r = rms_inv(ss, hd, eps);
  for (int64_t i = 0; i < hd; ++i) v[i] = rms_apply(v[i], r, load_as_float(w, dtype, i));
}

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
  std::vector<float> heap;  // normed and gate, when the workspace cannot hold them

  DecodeStep(ffi::ThreadPool* thread_pool, const DecoderDims& dims, const DecoderBuffers& buffers)
      : pool(thread_pool), d(dims), io(buffers), w(buffers.weights), dtype(dims.dtype),
        ws(dims, buffers.workspace), attn_scale(1.0f / std::sqrt(float(dims.hd))) {
    // `normed` and `gate` live in the GEMV partial-sum region (the CUDA kernel's; unused here),
    // which holds >= 1024 * B * 128 floats; heap only if it cannot.
    float* scratch = ws.gemv_partials.data;
    if ((d.D + d.I) * d.B > ws.gemv_partials.capacity) {
      heap.resize((d.D + d.I) * d.B);
      scratch = heap.data();
    }
    normed = {scratch, d.D};
    gate = {scratch + d.B * d.D, d.I};
  }

  void run() {
    load_tile(io.x, dtype, 0, d.B * d.D, ws.hidden.data);  // h = float(x)
    for (int64_t l = 0; l < d.L; ++l) {
      rmsnorm_qkv(l);
      rope_append_kv(l);
      attention(l);
      o_proj(l);
      mlp(l);
    }
    write_output();
  }

  // Layer l of stacked weight `stacked` ([L, layer_size]).
  const void* layer(const void* stacked, int64_t l, int64_t layer_size) const {
    return layer_slice(stacked, dtype, l, layer_size);
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
  void rmsnorm_qkv(int64_t l) {
    rmsnorm_rows(d, ws.hidden, layer(w.attn_norm, l, d.D), normed);
    const int64_t q_dim = d.q_dim(), kv_dim = d.kv_dim();
    const void* matrices[3] = {layer(w.wq, l, d.D * q_dim), layer(w.wk, l, d.D * kv_dim),
                               layer(w.wv, l, d.D * kv_dim)};
    // Only with qkv_bias: otherwise the bias operands are empty (possibly null) buffers.
    const void* biases[3] = {nullptr, nullptr, nullptr};
    if (d.qkv_bias) {
      biases[0] = layer(w.q_bias, l, q_dim);
      biases[1] = layer(w.k_bias, l, kv_dim);
      biases[2] = layer(w.v_bias, l, kv_dim);
    }
    const int64_t columns[3] = {q_dim, kv_dim, kv_dim};
    for (int m = 0; m < 3; ++m) {
      gemv(pool, d.B, normed.data, d.D, matrices[m], dtype, d.D, columns[m],
           [&](int64_t b, int64_t n0, int64_t len, const float* y) {
             float* out = ws.qkv.column(b, m, n0);
             for (int64_t i = 0; i < len; ++i) {
               out[i] = d.qkv_bias ? y[i] + load_as_float(biases[m], dtype, n0 + i) : y[i];
             }
           });
    }
  }

  // Per-head q/k RMSNorm (qk_norm) and RoPE on q and k, then k and v appended (rounded to the
  // cache dtype) at [l, b, p].
  void rope_append_kv(int64_t l) {
    const float* inv_freq = io.rope_inv_freq;
    for (int64_t b = 0; b < d.B; ++b) {
      const int32_t p = io.positions[b];
      if (!position_valid(p, d.S)) continue;
      for (int64_t head = 0; head < d.H; ++head) {
        float* q = ws.qkv.q(b, head);
        if (d.qk_norm) rmsnorm_head(q, d.hd, layer(w.q_norm, l, d.hd), dtype, d.eps);
        rope_head(q, d.hd, p, inv_freq);
      }
      for (int64_t kv_head = 0; kv_head < d.KV; ++kv_head) {
        float* k = ws.qkv.k(b, kv_head);
        if (d.qk_norm) rmsnorm_head(k, d.hd, layer(w.k_norm, l, d.hd), dtype, d.eps);
        rope_head(k, d.hd, p, inv_freq);
      }
      const int64_t at = cache_index(l, b, p, 0);
      const float* k = ws.qkv.k(b, 0);
      const float* v = ws.qkv.v(b, 0);
      for (int64_t i = 0; i < d.kv_dim(); ++i) {
        store_from_float(io.k_cache, dtype, at + i, k[i]);
        store_from_float(io.v_cache, dtype, at + i, v[i]);
      }
    }
  }

  // One work item per (batch row, query head).
  void attention(int64_t l) {
    int64_t work = 0;  // multiply-adds of this layer's attention
    for (int64_t b = 0; b < d.B; ++b) {
      work += 2 * d.H * d.hd * (int64_t(std::max(io.positions[b], 0)) + 1);
    }
    parallel_for(pool_for(pool, work), d.B * d.H,
                 [&](int64_t item) { attend_head(l, item / d.H, item % d.H); });
  }

  // Online softmax of query head `head` of row b over the cache positions 0..p.
  void attend_head(int64_t l, int64_t b, int64_t head) const {
    float* o = ws.attn_out.head(b, head);
    std::fill(o, o + d.hd, 0.0f);
    const int32_t p = io.positions[b];
    if (!position_valid(p, d.S)) return;
    const float* q = ws.qkv.q(b, head);
    const int64_t kv_head = head / d.group();
    std::vector<float> kv_row(2 * d.hd);
    float m = neg_inf_f32(), lsum = 0.0f;
    for (int64_t s = 0; s <= p; ++s) {
      const int64_t at = cache_index(l, b, s, kv_head);
      // An fp32 cache is read in place; a 16-bit one is widened into kv_row first.
      const float* kf = kv_row.data();
      const float* vf = kf + d.hd;
      if (dtype == DType::kF32) {
        kf = static_cast<const float*>(io.k_cache) + at;
        vf = static_cast<const float*>(io.v_cache) + at;
      } else {
        load_tile(io.k_cache, dtype, at, d.hd, kv_row.data());
        load_tile(io.v_cache, dtype, at, d.hd, kv_row.data() + d.hd);
      }
      float pw;
      const float alpha = online_softmax_step(m, lsum, dot(q, kf, d.hd) * attn_scale, &pw);
      for (int64_t i = 0; i < d.hd; ++i) o[i] = o[i] * alpha + pw * vf[i];
    }
    const float inv = 1.0f / lsum;
    for (int64_t i = 0; i < d.hd; ++i) o[i] *= inv;
  }

  // h += attn_out @ wo
  void o_proj(int64_t l) {
    const int64_t q_dim = d.q_dim();
    gemv(pool, d.B, ws.attn_out.data, q_dim, layer(w.wo, l, q_dim * d.D), dtype, q_dim, d.D,
         add_to_hidden());
  }

  // h += (silu(m @ w_gate) * (m @ w_up)) @ w_down, m = rmsnorm(h) * mlp_norm
  void mlp(int64_t l) {
    rmsnorm_rows(d, ws.hidden, layer(w.mlp_norm, l, d.D), normed);
    const int64_t size = d.D * d.I;
    gemv(pool, d.B, normed.data, d.D, layer(w.w_gate, l, size), dtype, d.D, d.I,
         [&](int64_t b, int64_t n0, int64_t len, const float* y) {
           std::copy_n(y, len, gate.at(b, n0));
         });
    gemv(pool, d.B, normed.data, d.D, layer(w.w_up, l, size), dtype, d.D, d.I,
         [&](int64_t b, int64_t n0, int64_t len, const float* y) {
           const float* g = gate.at(b, n0);
           float* a = ws.mlp_act.at(b, n0);
           for (int64_t i = 0; i < len; ++i) a[i] = swiglu(g[i], y[i]);
         });
    gemv(pool, d.B, ws.mlp_act.data, d.I, layer(w.w_down, l, size), dtype, d.I, d.D,
         add_to_hidden());
  }

  // out = h, or NaN for rows whose position is out of range.
  void write_output() {
    for (int64_t b = 0; b < d.B; ++b) {
      const int64_t first = b * d.D;  // of out's row b
      if (position_valid(io.positions[b], d.S)) {
        store_tile(io.out, dtype, first, d.D, ws.hidden.row(b));
      } else {
        for (int64_t i = 0; i < d.D; ++i) store_from_float(io.out, dtype, first + i, quiet_nan_f32());
      }
    }
  }
};

}  // namespace

template <>
ffi::Error DecoderOp::run<Cpu>(ffi::ThreadPool pool, const Call& call) {
  if (call.dims.B == 0) return ffi::Error::Success();
  DecodeStep(&pool, call.dims, call.buffers).run();
  return ffi::Error::Success();
}

JAXFUSE_REGISTER_OP(DecoderOp, Cpu);

}  // namespace jaxfuse
