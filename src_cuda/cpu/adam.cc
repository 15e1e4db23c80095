// jaxfuse_adam, CPU: every leaf's Adam/AdamW update in one FFI call, chunks spread over XLA's
// intra-op thread pool. Each chunk is processed in L1-sized fp32 tiles: converting loads,
// one vectorizable loop of adam_element(), converting stores.
#include "jaxfuse/adam_ffi.h"

namespace jaxfuse {
namespace {

constexpr int64_t kChunk = 1 << 16;  // elements per parallel work item
constexpr int64_t kTile = 512;       // elements per fp32 scratch tile

template <bool kNesterov, bool kDecay>
__attribute__((always_inline)) inline void adam_tile_loop(AdamStep step, int64_t len,
                                                          const float* __restrict__ g,
                                                          const float* __restrict__ p,
                                                          float* __restrict__ m,
                                                          float* __restrict__ v,
                                                          float* __restrict__ u) {
  step.nesterov = kNesterov;  // constant in this instantiation: the loop has no branches
  for (int64_t i = 0; i < len; ++i) u[i] = adam_element(step, g[i], p[i], kDecay, m[i], v[i]);
}

// The element loop of one tile, with the per-call choices hoisted out so that each variant
// vectorizes; compiled per ISA level. m and v are updated in place; u receives the update.
JF_CPU_MULTIVERSION
void adam_tile(const AdamStep& step, bool decay, int64_t len, const float* g, const float* p,
               float* m, float* v, float* u) {
  if (step.nesterov) {
    decay ? adam_tile_loop<true, true>(step, len, g, p, m, v, u)
          : adam_tile_loop<true, false>(step, len, g, p, m, v, u);
  } else {
    decay ? adam_tile_loop<false, true>(step, len, g, p, m, v, u)
          : adam_tile_loop<false, false>(step, len, g, p, m, v, u);
  }
}

// g = GradScaling(g) on a tile (loss scale, clipping).
JF_CPU_MULTIVERSION
void scale_grads(const GradScaling& gs, int64_t len, float* g) {
  if (gs.scale) {
    for (int64_t i = 0; i < len; ++i) g[i] = g[i] / gs.loss_scale;
  }
  if (gs.clip) {
    for (int64_t i = 0; i < len; ++i) g[i] = (g[i] / gs.clip_div) * gs.clip_mul;
  }
}

JF_CPU_MULTIVERSION
void add_into(int64_t len, float* __restrict__ p, const float* __restrict__ u) {
  for (int64_t i = 0; i < len; ++i) p[i] = p[i] + u[i];
}

void adam_chunk(const AdamCall& call, const AdamStep& step, int64_t t, int64_t start, int64_t n) {
  const TensorLists& L = call.lists;
  const auto& ptr = L.ptr[t];
  const auto& dt = L.dtype[t];
  const bool decay = L.flag[t] != 0;
  const int ul = call.updates_list();
  const int ml = call.master_list();
  // The param value the math sees: fp32 master copy when present.
  const int pl = ml >= 0 ? ml : kParams;
  const bool scale = step.grad.scale || step.grad.clip;
  // All-fp32 tensors (the common case) are updated in place in their buffers; other dtypes go
  // through fp32 scratch tiles with converting loads and stores.
  const bool direct = ml < 0 && dt[kGrads] == DType::kF32 && dt[kParams] == DType::kF32 &&
                      dt[kMu] == DType::kF32 && dt[kNu] == DType::kF32 &&
                      (ul < 0 || dt[ul] == DType::kF32);
  alignas(64) float g[kTile], p[kTile], m[kTile], v[kTile], u[kTile];
  for (int64_t off = start; off < start + n; off += kTile) {
    const int64_t len = std::min(kTile, start + n - off);
    if (step.grad.skip) {
      // Non-finite step: the state stays as it is; the optax path reports a zero update.
      if (ul >= 0) {
        std::fill(u, u + len, 0.0f);
        store_tile(ptr[ul], dt[ul], off, len, u);
      }
      continue;
    }
    if (direct) {
      const float* gp = static_cast<const float*>(ptr[kGrads]) + off;
      if (scale) {
        std::copy(gp, gp + len, g);
        scale_grads(step.grad, len, g);
        gp = g;
      }
      float* pp = static_cast<float*>(ptr[kParams]) + off;
      float* up = ul >= 0 ? static_cast<float*>(ptr[ul]) + off : u;
      adam_tile(step, decay, len, gp, pp, static_cast<float*>(ptr[kMu]) + off,
                static_cast<float*>(ptr[kNu]) + off, up);
      if (ul < 0) add_into(len, pp, u);
      continue;
    }
    load_tile(ptr[kGrads], dt[kGrads], off, len, g);
    if (scale) scale_grads(step.grad, len, g);
    load_tile(ptr[pl], dt[pl], off, len, p);
    load_tile(ptr[kMu], dt[kMu], off, len, m);
    load_tile(ptr[kNu], dt[kNu], off, len, v);
    adam_tile(step, decay, len, g, p, m, v, u);
    store_tile(ptr[kMu], dt[kMu], off, len, m);
    store_tile(ptr[kNu], dt[kNu], off, len, v);
    if (ul >= 0) {
      if (ml >= 0) {
        // Update that moves the low-precision params onto the new master value.
        load_tile(ptr[kParams], dt[kParams], off, len, g);
        for (int64_t i = 0; i < len; ++i) {
          p[i] = p[i] + u[i];
          u[i] = p[i] - g[i];
        }
        store_tile(ptr[ml], DType::kF32, off, len, p);
      }
      store_tile(ptr[ul], dt[ul], off, len, u);
    } else {
      add_into(len, p, u);
      if (ml >= 0) store_tile(ptr[ml], DType::kF32, off, len, p);
      store_tile(ptr[kParams], dt[kParams], off, len, p);
    }
  }
}

ffi::Error AdamCpu(ffi::ThreadPool pool, CountBuffer count,
                   HyperBuffer hyper, HyperBuffer ctrl,
                   ffi::RemainingArgs args, ffi::Result<CountBuffer> new_count,
                   ffi::RemainingRets rets, int64_t num_tensors, bool nesterov,
                   bool write_updates, bool master, ffi::Span<const uint8_t> decay_mask) {
  AdamCall call;
  JF_RETURN_IF_ERROR(decode_adam_call(count, hyper, ctrl, args, new_count, rets, num_tensors,
                                      nesterov, write_updates, master, decay_mask, &call));
  const AdamStep step = make_adam_step(call.hyper, call.ctrl, *call.count, nesterov);
  *call.new_count = adam_next_count(*call.count, step.grad.skip);
  if (step.grad.skip && !write_updates) return ffi::Error::Success();  // state stays in place
  for_each_chunk(&pool, call.lists, kChunk, [&](int64_t t, int64_t start, int64_t n) {
    adam_chunk(call, step, t, start, n);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseAdamCpu, AdamCpu, adam_binding<ffi::ThreadPool>());

}  // namespace jaxfuse
