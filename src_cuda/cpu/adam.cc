// jaxfuse_adam, CPU: every leaf's Adam/AdamW update in one FFI call, chunks spread over XLA's
// intra-op thread pool. A chunk goes through adam_group() (adam_math.h, the GPU's program too)
// in L1-sized tiles of the compute type (float, or double for float64 calls): converting loads,
// one vectorizable loop of adam_elements(), converting stores. Tensors stored in the compute type
// without a master copy take a shortcut: the same element loop in place on their buffers, with
// no tile copies.
#include "jaxfuse/adam.h"

#include "cpu_common.h"

namespace jaxfuse {
namespace {

constexpr int64_t kChunk = 1 << 16;  // elements per parallel work item (even: complex pairs)
constexpr int64_t kTile = 512;       // elements per scratch tile (even)

template <bool kNesterov, bool kDecay, typename Real>
__attribute__((always_inline)) inline void adam_loop(AdamStep<Real> step, int64_t len,
                                                     const Real* __restrict__ g,
                                                     const Real* __restrict__ p,
                                                     Real* __restrict__ m, Real* __restrict__ v,
                                                     Real* __restrict__ u) {
  step.nesterov = kNesterov;  // constant in this instantiation: the loops have no branches
  adam_elements(step, len, kDecay, g, p, m, v, u);
}

// The element loop of a tile, with the per-call choices hoisted out so that each variant
// vectorizes. m and v are updated in place; u receives the update.
template <typename Real>
__attribute__((always_inline)) inline void adam_tile_impl(const AdamStep<Real>& step, bool decay,
                                                          int64_t len, const Real* g,
                                                          const Real* p, Real* m, Real* v,
                                                          Real* u) {
  if (step.nesterov) {
    decay ? adam_loop<true, true>(step, len, g, p, m, v, u)
          : adam_loop<true, false>(step, len, g, p, m, v, u);
  } else {
    decay ? adam_loop<false, true>(step, len, g, p, m, v, u)
          : adam_loop<false, false>(step, len, g, p, m, v, u);
  }
}

// Per compute type, compiled per ISA level (multiversioned functions cannot be templates).
JF_CPU_MULTIVERSION
void adam_tile(const AdamStep<float>& step, bool decay, int64_t len, const float* g,
               const float* p, float* m, float* v, float* u) {
  adam_tile_impl(step, decay, len, g, p, m, v, u);
}

JF_CPU_MULTIVERSION
void adam_tile(const AdamStep<double>& step, bool decay, int64_t len, const double* g,
               const double* p, double* m, double* v, double* u) {
  adam_tile_impl(step, decay, len, g, p, m, v, u);
}

JF_CPU_MULTIVERSION
void scale_tile(const GradScaling<float>& s, int64_t len, float* g) { scale_group(s, len, g); }

JF_CPU_MULTIVERSION
void scale_tile(const GradScaling<double>& s, int64_t len, double* g) { scale_group(s, len, g); }

JF_CPU_MULTIVERSION
void add_into(int64_t len, float* __restrict__ p, const float* __restrict__ u) {
  for (int64_t i = 0; i < len; ++i) p[i] = p[i] + u[i];
}

JF_CPU_MULTIVERSION
void add_into(int64_t len, double* __restrict__ p, const double* __restrict__ u) {
  for (int64_t i = 0; i < len; ++i) p[i] = p[i] + u[i];
}

// adam_group()'s view of one tile [start, start + len) of tensor t.
template <typename Real>
struct Tile {
  using Values = Real[kTile];
  const TensorLists& tensors;
  int64_t t, start, len;
  bool decay;

  int64_t size() const { return len; }
  void load(int list, Real* x) const {
    load_tile(tensors.ptr[t][list], tensors.dtype[t][list], start, len, x);
  }
  void store(int list, const Real* x) const {
    store_tile(tensors.ptr[t][list], tensors.dtype[t][list], start, len, x);
  }
  void round(int list, Real* x) const {
    const DType dtype = tensors.dtype[t][list];
    for (int64_t i = 0; i < len; ++i) x[i] = round_to(dtype, x[i]);
  }
  void update(const AdamStep<Real>& s, const Real* g, const Real* p, Real* m, Real* v,
              Real* u) const {
    adam_tile(s, decay, len, g, p, m, v, u);
  }
};

template <typename Real>
Real* list_ptr(const AdamOp::Call& call, int64_t t, int list, int64_t offset) {
  return static_cast<Real*>(call.tensors.ptr[t][list]) + offset;
}

// Whether tensor t takes the shortcut: every list stored in the compute type, no master copy,
// params present.
template <typename Real>
bool native_in_place(const AdamOp::Call& call, int64_t t) {
  if (call.lists.master >= 0 || call.lists.params < 0) return false;
  for (int k = 0; k < call.lists.count(); ++k) {
    if (call.tensors.dtype[t][k] != kNativeDType<Real>) return false;
  }
  return true;
}

// The shortcut for a tile: adam_group()'s program for that case, on the buffers.
template <typename Real>
void adam_tile_native(const AdamOp::Call& call, const AdamStep<Real>& step, const Tile<Real>& tile,
                      Real* scratch_g, Real* scratch_u) {
  const int64_t t = tile.t, off = tile.start;
  const Real* g = list_ptr<Real>(call, t, kGrads, off);
  if (step.grad.scale || step.grad.clip) {
    std::copy(g, g + tile.len, scratch_g);
    scale_tile(step.grad, tile.len, scratch_g);
    g = scratch_g;
  }
  Real* p = list_ptr<Real>(call, t, call.lists.params, off);
  const int ul = call.lists.updates;
  Real* u = ul >= 0 ? list_ptr<Real>(call, t, ul, off) : scratch_u;
  adam_tile(step, tile.decay, tile.len, g, p, list_ptr<Real>(call, t, kMu, off),
            list_ptr<Real>(call, t, kNu, off), u);
  if (ul < 0) add_into(tile.len, p, u);
}

template <typename Real>
void adam_chunk(const AdamOp::Call& call, const AdamStep<Real>& step, int64_t t, int64_t start,
                int64_t n) {
  const bool native = !step.grad.skip && native_in_place<Real>(call, t);
  alignas(64) Real g[kTile], u[kTile];
  for (int64_t off = start; off < start + n; off += kTile) {
    const Tile<Real> tile{call.tensors, t, off, std::min(kTile, start + n - off),
                          call.tensors.mask[t] != 0};
    if (native) {
      adam_tile_native(call, step, tile, g, u);
    } else {
      adam_group(step, call.lists, tile);
    }
  }
}

template <typename Real>
void run_adam(ffi::ThreadPool* pool, const AdamOp::Call& call) {
  const AdamStep<Real> step =
      make_adam_step<Real>(call.hyper, call.grad_ctrl, *call.count, call.nesterov, call.complex);
  *call.new_count = adam_next_count(*call.count, step.grad.skip);
  if (step.grad.skip && call.lists.updates < 0) return;  // the state stays as it is
  const ChunkIndex chunks(call.tensors, kChunk);
  for_each_chunk(pool, call.tensors, chunks, [&](int64_t t, int64_t start, int64_t n, int64_t) {
    adam_chunk(call, step, t, start, n);
  });
}

}  // namespace

template <>
ffi::Error AdamOp::run<Cpu>(ffi::ThreadPool pool, const Call& call) {
  if (call.f64) {
    run_adam<double>(&pool, call);
  } else {
    run_adam<float>(&pool, call);
  }
  return ffi::Error::Success();
}

JAXFUSE_REGISTER_OP(AdamOp, Cpu);

}  // namespace jaxfuse
