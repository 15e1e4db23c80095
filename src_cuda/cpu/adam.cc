// jaxfuse_adam, CPU: every leaf's Adam/AdamW update in one FFI call, chunks spread over XLA's
// intra-op thread pool. A chunk goes through adam_group() (adam_math.h, the GPU's program too)
// in L1-sized fp32 tiles: converting loads, one vectorizable loop of adam_element(), converting
// stores. All-fp32 tensors without a master copy take a shortcut: the same element loop in
// place on their buffers, with no tile copies.
#include "jaxfuse/adam.h"

#include "cpu_common.h"

namespace jaxfuse {
namespace {

constexpr int64_t kChunk = 1 << 16;  // elements per parallel work item
constexpr int64_t kTile = 512;       // elements per fp32 scratch tile

template <bool kNesterov, bool kDecay>
__attribute__((always_inline)) inline void adam_loop(AdamStep step, int64_t len,
                                                     const float* __restrict__ g,
                                                     const float* __restrict__ p,
                                                     float* __restrict__ m, float* __restrict__ v,
                                                     float* __restrict__ u) {
  step.nesterov = kNesterov;  // constant in this instantiation: the loop has no branches
  for (int64_t i = 0; i < len; ++i) u[i] = adam_element(step, g[i], p[i], kDecay, m[i], v[i]);
}

// The element loop of a tile, with the per-call choices hoisted out so that each variant
// vectorizes; compiled per ISA level. m and v are updated in place; u receives the update.
JF_CPU_MULTIVERSION
void adam_tile(const AdamStep& step, bool decay, int64_t len, const float* g, const float* p,
               float* m, float* v, float* u) {
  if (step.nesterov) {
    decay ? adam_loop<true, true>(step, len, g, p, m, v, u)
          : adam_loop<true, false>(step, len, g, p, m, v, u);
  } else {
    decay ? adam_loop<false, true>(step, len, g, p, m, v, u)
          : adam_loop<false, false>(step, len, g, p, m, v, u);
  }
}

JF_CPU_MULTIVERSION
void scale_tile(const GradScaling& s, int64_t len, float* g) { scale_group(s, len, g); }

JF_CPU_MULTIVERSION
void add_into(int64_t len, float* __restrict__ p, const float* __restrict__ u) {
  for (int64_t i = 0; i < len; ++i) p[i] = p[i] + u[i];
}

// adam_group()'s view of one tile [start, start + len) of tensor t.
struct Tile {
  using Values = float[kTile];
  const TensorLists& tensors;
  int64_t t, start, len;
  bool decay;

  int64_t size() const { return len; }
  void load(int list, float* x) const {
    load_tile(tensors.ptr[t][list], tensors.dtype[t][list], start, len, x);
  }
  void store(int list, const float* x) const {
    store_tile(tensors.ptr[t][list], tensors.dtype[t][list], start, len, x);
  }
  void update(const AdamStep& s, const float* g, const float* p, float* m, float* v,
              float* u) const {
    adam_tile(s, decay, len, g, p, m, v, u);
  }
};

bool all_f32_in_place(const AdamOp::Call& call, int64_t t) {
  if (call.lists.master >= 0) return false;
  for (int k = 0; k < call.lists.count(); ++k) {
    if (call.tensors.dtype[t][k] != DType::kF32) return false;
  }
  return true;
}

// The shortcut for an all-fp32 tile: adam_group()'s program for that case, on the buffers.
void adam_tile_f32(const AdamOp::Call& call, const AdamStep& step, const Tile& tile,
                   float* scratch_g, float* scratch_u) {
  const auto& ptr = call.tensors.ptr[tile.t];
  const int64_t off = tile.start;
  const float* g = static_cast<const float*>(ptr[kGrads]) + off;
  if (step.grad.scale || step.grad.clip) {
    std::copy(g, g + tile.len, scratch_g);
    scale_tile(step.grad, tile.len, scratch_g);
    g = scratch_g;
  }
  float* p = static_cast<float*>(ptr[kParams]) + off;
  const int ul = call.lists.updates;
  float* u = ul >= 0 ? static_cast<float*>(ptr[ul]) + off : scratch_u;
  adam_tile(step, tile.decay, tile.len, g, p, static_cast<float*>(ptr[kMu]) + off,
            static_cast<float*>(ptr[kNu]) + off, u);
  if (ul < 0) add_into(tile.len, p, u);
}

void adam_chunk(const AdamOp::Call& call, const AdamStep& step, int64_t t, int64_t start,
                int64_t n) {
  const bool direct = !step.grad.skip && all_f32_in_place(call, t);
  alignas(64) float g[kTile], u[kTile];
  for (int64_t off = start; off < start + n; off += kTile) {
    const Tile tile{call.tensors, t, off, std::min(kTile, start + n - off),
                    call.tensors.mask[t] != 0};
    if (direct) {
      adam_tile_f32(call, step, tile, g, u);
    } else {
      adam_group(step, call.lists, tile);
    }
  }
}

}  // namespace

template <>
ffi::Error AdamOp::run<Cpu>(ffi::ThreadPool pool, const Call& call) {
  const AdamStep step = make_adam_step(call.hyper, call.grad_ctrl, *call.count, call.nesterov);
  *call.new_count = adam_next_count(*call.count, step.grad.skip);
  if (step.grad.skip && call.lists.updates < 0) return ffi::Error::Success();  // state stays
  const ChunkIndex chunks(call.tensors, kChunk);
  for_each_chunk(&pool, call.tensors, chunks, [&](int64_t t, int64_t start, int64_t n, int64_t) {
    adam_chunk(call, step, t, start, n);
  });
  return ffi::Error::Success();
}

JAXFUSE_REGISTER_OP(AdamOp, Cpu);

}  // namespace jaxfuse
