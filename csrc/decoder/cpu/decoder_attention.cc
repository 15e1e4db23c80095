// The CPU decoder's RoPE, cache append and attention stages (DecodeStep, decoder_step.h).
#include <algorithm>
#include <cstring>
#include <vector>

#include "decoder/cpu/decoder_gemv.h"
#include "decoder/cpu/decoder_step.h"

namespace jaxfuse::cpu_decoder {
namespace {

// sum_i a[i] * b[i]: 8-element chunk c into F32x8 accumulator c % 4, then the accumulators and
// the 8 lanes added pairwise. Attention calls this once per head and cache position with
// n = head_dim; at 64, one accumulator and a lane-by-lane sum were a chain of 16 dependent adds,
// this order is 7. The lanes are F32x8's on every ISA level, so the result is the same
// everywhere.
JF_CPU_MULTIVERSION
float dot(const float* a, const float* b, int64_t n) {
  const auto add_chunk = [&](F32x8& acc, int64_t i) {  // acc += a[i:i+8] * b[i:i+8]
    F32x8 va, vb;
    std::memcpy(&va, a + i, sizeof(va));
    std::memcpy(&vb, b + i, sizeof(vb));
    acc += va * vb;
  };
  F32x8 acc0 = {}, acc1 = {}, acc2 = {}, acc3 = {};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    add_chunk(acc0, i);
    add_chunk(acc1, i + 8);
    add_chunk(acc2, i + 16);
    add_chunk(acc3, i + 24);
  }
  if (i + 8 <= n) add_chunk(acc0, i), i += 8;
  if (i + 8 <= n) add_chunk(acc1, i), i += 8;
  if (i + 8 <= n) add_chunk(acc2, i), i += 8;
  const F32x8 s = (acc0 + acc1) + (acc2 + acc3);
  float sum = ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
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

}  // namespace

void DecodeStep::rope_append_kv(int64_t l) {
  const float* inv_freq = io.rope_inv_freq;
  for (int64_t b = 0; b < d.B; ++b) {
    const int32_t p = position(b);
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

void DecodeStep::attention(int64_t l) {
  int64_t work = 0;  // multiply-adds of this layer's attention
  for (int64_t b = 0; b < d.B; ++b) {
    work += 2 * d.H * d.hd * (int64_t(std::max(position(b), 0)) + 1);
  }
  const int64_t chunks = head_chunks(d);  // of <= kDecHeadChunk query heads per kv head
  parallel_for(pool_for(pool, work), d.B * d.KV * chunks, [&](int64_t item) {
    const int64_t chunk = item % chunks, kv_head = item / chunks % d.KV, b = item / chunks / d.KV;
    const int64_t first = kv_head * d.group() + chunk * kDecHeadChunk;
    attend_heads(l, b, kv_head, first, std::min(kDecHeadChunk, (kv_head + 1) * d.group() - first));
  });
}

void DecodeStep::attend_heads(int64_t l, int64_t b, int64_t kv_head, int64_t first,
                              int64_t heads) const {
  for (int64_t g = 0; g < heads; ++g) std::fill_n(ws.attn_out.head(b, first + g), d.hd, 0.0f);
  const int32_t p = position(b);
  if (!position_valid(p, d.S)) return;
  std::vector<float> kv_row(2 * d.hd);
  float m[kDecHeadChunk], lsum[kDecHeadChunk];
  std::fill_n(m, heads, neg_inf_f32());
  std::fill_n(lsum, heads, 0.0f);
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
    for (int64_t g = 0; g < heads; ++g) {
      float* o = ws.attn_out.head(b, first + g);
      float pw;
      const float score = dot(ws.qkv.q(b, first + g), kf, d.hd) * attn_scale;
      const float alpha = online_softmax_step(m[g], lsum[g], score, &pw);
      for (int64_t i = 0; i < d.hd; ++i) o[i] = o[i] * alpha + pw * vf[i];
    }
  }
  for (int64_t g = 0; g < heads; ++g) {
    float* o = ws.attn_out.head(b, first + g);
    const float inv = 1.0f / lsum[g];
    for (int64_t i = 0; i < d.hd; ++i) o[i] *= inv;
  }
}

}  // namespace jaxfuse::cpu_decoder
