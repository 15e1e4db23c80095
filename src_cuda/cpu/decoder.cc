// jaxfuse_decoder, CPU: one decode step of an L-layer Llama-style decoder (RMSNorm, GQA attention
// with RoPE over a KV cache, SwiGLU MLP), in one FFI call. The GEMVs and the attention heads are
// spread over XLA's intra-op thread pool; all arithmetic is fp32 (decoder_math.h, shared with the
// CUDA kernel); temporaries live in the workspace result, so the handler allocates nothing per
// layer. Operand layout: decoder_ffi.h.
#include <algorithm>
#include <cstring>
#include <vector>

#include "jaxfuse/decoder_ffi.h"
#include "jaxfuse/multi_tensor.h"  // parallel_for

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

// Converts n elements of storage dtype t to fp32.
void to_f32(const void* src, DType t, int64_t n, float* dst) {
  switch (t) {
    case DType::kF32: std::copy_n(static_cast<const float*>(src), n, dst); break;
    case DType::kBF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(s[i]);
      break;
    }
    default: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_float(s[i]);
      break;
    }
  }
}

const void* offset(const void* base, DType t, int64_t elems) {
  return static_cast<const char*>(base) + elems * dtype_bytes(t);
}
void* offset(void* base, DType t, int64_t elems) {
  return static_cast<char*>(base) + elems * dtype_bytes(t);
}

// acc[b, 0:len] = sum_k a[b, k] * W[k, n0:n0+len] for the B rows of `a` (fp32, row stride lda),
// W [K, N] in storage dtype t; acc has row stride kColBlock. Compiled per ISA level.
JF_CPU_MULTIVERSION
void gemv_block(int64_t B, const float* a, int64_t lda, const void* W, DType t, int64_t K,
                int64_t N, int64_t n0, int64_t len, float* __restrict__ acc) {
  alignas(64) float w[kColBlock];
  std::fill(acc, acc + B * kColBlock, 0.0f);
  for (int64_t k = 0; k < K; ++k) {
    // fp32 weights are read in place; 16-bit ones are widened into `w` first.
    const float* wk = t == DType::kF32 ? static_cast<const float*>(W) + k * N + n0 : w;
    if (t != DType::kF32) to_f32(offset(W, t, k * N + n0), t, len, w);
    for (int64_t b = 0; b < B; ++b) {
      const float ab = a[b * lda + k];
      float* __restrict__ y = acc + b * kColBlock;
      for (int64_t i = 0; i < len; ++i) y[i] += ab * wk[i];
    }
  }
}

// y[b, n] = sum_k a[b, k] * W[k, n] for the B rows of `a` (fp32, row stride lda), W [K, N] in
// storage dtype t. Column blocks are spread over the pool; epilogue(b, n0, len, y) receives each
// finished block of a row (fp32).
template <typename Epilogue>
void gemv(ffi::ThreadPool* pool, int64_t B, const float* a, int64_t lda, const void* W, DType t,
          int64_t K, int64_t N, const Epilogue& epilogue) {
  pool = pool_for(pool, B * K * N);
  // Column blocks: at least ~4 per thread when N allows, so small projections still spread.
  const int64_t threads = (pool == nullptr ? 0 : pool->num_threads()) + 1;
  int64_t width = (N + 4 * threads - 1) / (4 * threads);
  width = std::clamp<int64_t>((width + kMinColBlock - 1) / kMinColBlock * kMinColBlock, kMinColBlock,
                              kColBlock);
  const int64_t blocks = (N + width - 1) / width;
  parallel_for(pool, blocks, [&](int64_t blk) {
    const int64_t n0 = blk * width;
    const int64_t len = std::min(width, N - n0);
    std::vector<float> acc(B * kColBlock);
    gemv_block(B, a, lda, W, t, K, N, n0, len, acc.data());
    for (int64_t b = 0; b < B; ++b) epilogue(b, n0, len, acc.data() + b * kColBlock);
  });
}

// sum_i a[i] * b[i] over 8 independent lanes (GCC vector type: full-width SIMD, the same lanes
// and rounding on every ISA), then the lanes in order. A plain serial sum would be one dependent
// add per element.
typedef float F32x8 __attribute__((vector_size(32)));

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
void rmsnorm_rows(const DecoderDims& d, const float* h, const void* w, float* out) {
  std::vector<float> wf(d.D);
  to_f32(w, d.dtype, d.D, wf.data());
  for (int64_t b = 0; b < d.B; ++b) {
    const float* hb = h + b * d.D;
    float ss = 0.0f;
    for (int64_t i = 0; i < d.D; ++i) ss += hb[i] * hb[i];
    const float r = rms_inv(ss, d.D, d.eps);
    for (int64_t i = 0; i < d.D; ++i) out[b * d.D + i] = rms_apply(hb[i], r, wf[i]);
  }
}

// RoPE on one head vector in place, at position p.
void rope_head(float* v, int64_t hd, int32_t p, double theta) {
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < half; ++i) {
    float c, s;
    rope_cos_sin(rope_angle(p, int(i), int(hd), theta), &c, &s);
    rope_rotate(v[i], v[i + half], c, s);
  }
}

struct Weights {
  const void* attn_norm;
  const void* wq;
  const void* wk;
  const void* wv;
  const void* wo;
  const void* mlp_norm;
  const void* w_gate;
  const void* w_up;
  const void* w_down;
};

void decode_step(ffi::ThreadPool* pool, const DecoderDims& d, const void* x, const int32_t* pos,
                 const Weights& W, void* kc, void* vc, void* out, char* ws) {
  const DecoderLayout lay = decoder_layout(d);
  const DType t = d.dtype;
  const int64_t QD = d.q_dim(), KVD = d.kv_dim(), QKV = QD + 2 * KVD;
  float* h = reinterpret_cast<float*>(ws + lay.h);
  float* qkv = reinterpret_cast<float*>(ws + lay.qkv);
  float* attn = reinterpret_cast<float*>(ws + lay.attn);
  float* act = reinterpret_cast<float*>(ws + lay.act);
  // The normalized GEMV inputs and the gate projection live in the GEMV partial-sum region (the
  // CUDA kernel's; unused here), which holds >= 1024 * B * 128 floats; heap only if it cannot.
  std::vector<float> heap;
  float* normed = reinterpret_cast<float*>(ws + lay.gemv_part);
  if ((d.D + d.I) * d.B * 4 > lay.counters - lay.gemv_part) {
    heap.resize((d.D + d.I) * d.B);
    normed = heap.data();
  }
  float* gate = normed + d.B * d.D;

  to_f32(x, t, d.B * d.D, h);
  const float scale = 1.0f / std::sqrt(float(d.hd));
  const int64_t G = d.group();
  const int64_t cache_row = d.KV * d.hd;  // elements per (l, b, position)

  for (int64_t l = 0; l < d.L; ++l) {
    // ---- attention block ----
    rmsnorm_rows(d, h, offset(W.attn_norm, t, l * d.D), normed);
    const int64_t lq = l * d.D * QD, lkv = l * d.D * KVD;
    gemv(pool, d.B, normed, d.D, offset(W.wq, t, lq), t, d.D, QD,
         [&](int64_t b, int64_t n0, int64_t len, const float* y) {
           std::copy_n(y, len, qkv + b * QKV + n0);
         });
    gemv(pool, d.B, normed, d.D, offset(W.wk, t, lkv), t, d.D, KVD,
         [&](int64_t b, int64_t n0, int64_t len, const float* y) {
           std::copy_n(y, len, qkv + b * QKV + QD + n0);
         });
    gemv(pool, d.B, normed, d.D, offset(W.wv, t, lkv), t, d.D, KVD,
         [&](int64_t b, int64_t n0, int64_t len, const float* y) {
           std::copy_n(y, len, qkv + b * QKV + QD + KVD + n0);
         });
    // RoPE, then append k and v (rounded to the cache dtype) at [l, b, p].
    for (int64_t b = 0; b < d.B; ++b) {
      const int32_t p = pos[b];
      if (!position_valid(p, d.S)) continue;
      float* qb = qkv + b * QKV;
      for (int64_t hh = 0; hh < d.H; ++hh) rope_head(qb + hh * d.hd, d.hd, p, d.theta);
      for (int64_t kh = 0; kh < d.KV; ++kh) rope_head(qb + QD + kh * d.hd, d.hd, p, d.theta);
      const int64_t at = ((l * d.B + b) * d.S + p) * cache_row;
      for (int64_t i = 0; i < KVD; ++i) {
        store_from_float(kc, t, at + i, qb[QD + i]);
        store_from_float(vc, t, at + i, qb[QD + KVD + i]);
      }
    }
    // Attention: one work item per (batch row, query head), online softmax over 0..p.
    int64_t attn_work = 0;  // multiply-adds of this layer's attention
    for (int64_t b = 0; b < d.B; ++b) attn_work += 2 * d.H * d.hd * (int64_t(std::max(pos[b], 0)) + 1);
    parallel_for(pool_for(pool, attn_work), d.B * d.H, [&](int64_t item) {
      const int64_t b = item / d.H, hh = item % d.H;
      float* o = attn + b * QD + hh * d.hd;
      std::fill(o, o + d.hd, 0.0f);
      const int32_t p = pos[b];
      if (!position_valid(p, d.S)) return;
      const float* q = qkv + b * QKV + hh * d.hd;
      const int64_t kh = hh / G;
      std::vector<float> kv_row(2 * d.hd);
      float m = neg_inf_f32(), lsum = 0.0f;
      for (int64_t s = 0; s <= p; ++s) {
        const int64_t at = ((l * d.B + b) * d.S + s) * cache_row + kh * d.hd;
        // An fp32 cache is read in place; a 16-bit one is widened into kv_row first.
        const float* kf = kv_row.data();
        const float* vf = kf + d.hd;
        if (t == DType::kF32) {
          kf = static_cast<const float*>(kc) + at;
          vf = static_cast<const float*>(vc) + at;
        } else {
          to_f32(offset(kc, t, at), t, d.hd, kv_row.data());
          to_f32(offset(vc, t, at), t, d.hd, kv_row.data() + d.hd);
        }
        float pw;
        const float alpha = online_softmax_step(m, lsum, dot(q, kf, d.hd) * scale, &pw);
        for (int64_t i = 0; i < d.hd; ++i) o[i] = o[i] * alpha + pw * vf[i];
      }
      const float inv = 1.0f / lsum;
      for (int64_t i = 0; i < d.hd; ++i) o[i] *= inv;
    });
    // h += attn @ wo
    gemv(pool, d.B, attn, QD, offset(W.wo, t, l * QD * d.D), t, QD, d.D,
         [&](int64_t b, int64_t n0, int64_t len, const float* y) {
           float* hb = h + b * d.D + n0;
           for (int64_t i = 0; i < len; ++i) hb[i] += y[i];
         });
    // ---- MLP block ----
    rmsnorm_rows(d, h, offset(W.mlp_norm, t, l * d.D), normed);
    const int64_t li = l * d.D * d.I;
    gemv(pool, d.B, normed, d.D, offset(W.w_gate, t, li), t, d.D, d.I,
         [&](int64_t b, int64_t n0, int64_t len, const float* y) {
           std::copy_n(y, len, gate + b * d.I + n0);
         });
    gemv(pool, d.B, normed, d.D, offset(W.w_up, t, li), t, d.D, d.I,
         [&](int64_t b, int64_t n0, int64_t len, const float* y) {
           const float* g = gate + b * d.I + n0;
           float* a = act + b * d.I + n0;
           for (int64_t i = 0; i < len; ++i) a[i] = swiglu(g[i], y[i]);
         });
    gemv(pool, d.B, act, d.I, offset(W.w_down, t, li), t, d.I, d.D,
         [&](int64_t b, int64_t n0, int64_t len, const float* y) {
           float* hb = h + b * d.D + n0;
           for (int64_t i = 0; i < len; ++i) hb[i] += y[i];
         });
  }
  for (int64_t b = 0; b < d.B; ++b) {
    const bool valid = position_valid(pos[b], d.S);
    for (int64_t i = 0; i < d.D; ++i) {
      store_from_float(out, t, b * d.D + i, valid ? h[b * d.D + i] : quiet_nan_f32());
    }
  }
}

ffi::Error DecoderCpu(ffi::ThreadPool pool, ffi::AnyBuffer x, PositionsBuffer positions,
                      ffi::AnyBuffer attn_norm, ffi::AnyBuffer wq, ffi::AnyBuffer wk,
                      ffi::AnyBuffer wv, ffi::AnyBuffer wo, ffi::AnyBuffer mlp_norm,
                      ffi::AnyBuffer w_gate, ffi::AnyBuffer w_up, ffi::AnyBuffer w_down,
                      ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                      ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> k_out,
                      ffi::Result<ffi::AnyBuffer> v_out, ffi::Result<WorkspaceBuffer> workspace,
                      DecoderAttrs attrs) {
  const ffi::AnyBuffer weights[9] = {attn_norm, wq, wk, wv, wo, mlp_norm, w_gate, w_up, w_down};
  DecoderDims d;
  JF_RETURN_IF_ERROR(decode_decoder_call(x, positions, weights, k_cache, v_cache, *out, *k_out,
                                         *v_out, *workspace, attrs, &d));
  if (d.B == 0) return ffi::Error::Success();
  const Weights W{attn_norm.untyped_data(), wq.untyped_data(),     wk.untyped_data(),
                  wv.untyped_data(),        wo.untyped_data(),     mlp_norm.untyped_data(),
                  w_gate.untyped_data(),    w_up.untyped_data(),   w_down.untyped_data()};
  decode_step(&pool, d, x.untyped_data(), positions.typed_data(), W, k_out->untyped_data(),
              v_out->untyped_data(), out->untyped_data(),
              reinterpret_cast<char*>(workspace->typed_data()));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseDecoderCpu, DecoderCpu, decoder_binding<ffi::ThreadPool>());

}  // namespace jaxfuse
