// The CPU driver of the optimizer op (optimizer.h), one for every family: chunks of every
// tensor spread over XLA's intra-op thread pool, each chunk through optimizer_group() (the GPU's
// program too) in L1-sized tiles of the compute type (float, or double for float64 calls):
// converting loads, one vectorizable element loop of the family, converting stores. Tensors
// stored in the compute type without a master copy take a shortcut: the same element loop in
// place on their buffers, with no tile copies.
//
// A family's CPU file is one line, JAXFUSE_CPU_OPTIMIZER(Family, elements): `elements` is the
// element loop as the family wants it compiled (e.g. with its flags hoisted into template
// arguments so that each variant vectorizes); the macro compiles it once per ISA level and
// registers the op.
#pragma once

#include <algorithm>

#include "optim/cpu/chunks.h"
#include "optim/optimizer.h"

namespace jaxfuse {
namespace cpu_optimizer {

constexpr int64_t kChunk = 1 << 16;  // elements per parallel work item (even: complex pairs)
constexpr int64_t kTile = 512;       // elements per scratch tile (even)

JF_CPU_MULTIVERSION
static void scale_tile(const GradScaling<float>& s, int64_t len, float* g) {
  scale_group(s, len, g);
}

JF_CPU_MULTIVERSION
static void scale_tile(const GradScaling<double>& s, int64_t len, double* g) {
  scale_group(s, len, g);
}

JF_CPU_MULTIVERSION
static void add_into(int64_t len, float* __restrict__ p, const float* __restrict__ u) {
  for (int64_t i = 0; i < len; ++i) p[i] = p[i] + u[i];
}

JF_CPU_MULTIVERSION
static void add_into(int64_t len, double* __restrict__ p, const double* __restrict__ u) {
  for (int64_t i = 0; i < len; ++i) p[i] = p[i] + u[i];
}

// The tile copies per ISA level: at the baseline ISA the 16-bit conversions would take most of
// a step's time.
JF_CPU_MULTIVERSION
static void tile_load(const void* base, DType t, int64_t start, int64_t n, float* out) {
  load_tile(base, t, start, n, out);
}

JF_CPU_MULTIVERSION
static void tile_load(const void* base, DType t, int64_t start, int64_t n, double* out) {
  load_tile(base, t, start, n, out);
}

JF_CPU_MULTIVERSION
static void tile_store(void* base, DType t, int64_t start, int64_t n, const float* in) {
  store_tile(base, t, start, n, in);
}

JF_CPU_MULTIVERSION
static void tile_store(void* base, DType t, int64_t start, int64_t n, const double* in) {
  store_tile(base, t, start, n, in);
}

// Stochastic rounding of a tile's params (rounding.h), per ISA level.
JF_CPU_MULTIVERSION
static void round_tile(DType t, uint32_t stream, int64_t first, int64_t n, float* x) {
  stochastic_round_run(t, stream, first, n, x);
}

JF_CPU_MULTIVERSION
static void round_tile(DType t, uint32_t stream, int64_t first, int64_t n, double* x) {
  stochastic_round_run(t, stream, first, n, x);
}

// 8-bit states of a tile (moment_codes.h), whole blocks: tiles start on block boundaries, and
// quantized tensors hold whole blocks. Each format's loop is compiled on its own.
template <bool kSigned, typename Real>
__attribute__((always_inline)) inline void load_code_blocks(const uint8_t* codes,
                                                            const float* scales, int64_t n,
                                                            Real* out) {
  for (int64_t b = 0; b < n; b += kMomentBlock) {
    const float scale = scales[b / kMomentBlock];
    for (int64_t i = b; i < b + kMomentBlock; ++i) {
      out[i] = Real(decode_moment(codes[i], scale, kSigned));
    }
  }
}

template <bool kSigned, typename Real>
__attribute__((always_inline)) inline void store_code_blocks(uint8_t* codes, float* scales,
                                                             int64_t n, const Real* in) {
  for (int64_t b = 0; b < n; b += kMomentBlock) {
    uint32_t largest = 0;
    for (int64_t i = b; i < b + kMomentBlock; ++i) {
      largest = std::max(largest, magnitude_bits(float(in[i])));
    }
    const float scale = moment_scale(largest, kSigned);
    scales[b / kMomentBlock] = scale;
    const float inverse = 1.0f / scale;
    uint32_t wide[kMomentBlock];  // codes computed 32 bits wide, then narrowed: both vectorize
    for (int64_t i = 0; i < kMomentBlock; ++i) {
      wide[i] = encode_moment(float(in[b + i]), inverse, kSigned);
    }
    for (int64_t i = 0; i < kMomentBlock; ++i) codes[b + i] = static_cast<uint8_t>(wide[i]);
  }
}

template <typename Real>
__attribute__((always_inline)) inline void load_codes(const uint8_t* codes, bool is_signed,
                                                      const float* scales, int64_t n, Real* out) {
  is_signed ? load_code_blocks<true>(codes, scales, n, out)
            : load_code_blocks<false>(codes, scales, n, out);
}

template <typename Real>
__attribute__((always_inline)) inline void store_codes(uint8_t* codes, bool is_signed,
                                                       float* scales, int64_t n, const Real* in) {
  is_signed ? store_code_blocks<true>(codes, scales, n, in)
            : store_code_blocks<false>(codes, scales, n, in);
}

// Per ISA level for float; float64 calls are refused (the double tiles compile the program).
JF_CPU_MULTIVERSION
static void tile_load_codes(const uint8_t* c, bool is_signed, const float* s, int64_t n, float* x) {
  load_codes(c, is_signed, s, n, x);
}

JF_CPU_MULTIVERSION
static void tile_store_codes(uint8_t* c, bool is_signed, float* s, int64_t n, const float* x) {
  store_codes(c, is_signed, s, n, x);
}

static void tile_load_codes(const uint8_t* c, bool is_signed, const float* s, int64_t n,
                            double* x) {
  load_codes(c, is_signed, s, n, x);
}

static void tile_store_codes(uint8_t* c, bool is_signed, float* s, int64_t n, const double* x) {
  store_codes(c, is_signed, s, n, x);
}

// optimizer_group()'s view of one tile [start, start + len) of tensor t. `tile_elements` is the
// family's per-ISA element loop (JAXFUSE_CPU_OPTIMIZER), found by argument-dependent lookup.
template <typename Family, typename Real>
struct Tile {
  using Values = Real[kTile];
  const TensorLists& tensors;
  int64_t t, start, len;

  int64_t size() const { return len; }
  void load(int list, Real* x) const {
    tile_load(tensors.ptr[t][list], tensors.dtype[t][list], start, len, x);
  }
  void store(int list, const Real* x) const {
    tile_store(tensors.ptr[t][list], tensors.dtype[t][list], start, len, x);
  }
  void load_words(int list, Real* x) const {
    const int16_t* w = static_cast<const int16_t*>(tensors.ptr[t][list]) + start;
    for (int64_t i = 0; i < len; ++i) x[i] = Real(w[i]);
  }
  void store_words(int list, const Real* x) const {
    int16_t* w = static_cast<int16_t*>(tensors.ptr[t][list]) + start;
    for (int64_t i = 0; i < len; ++i) w[i] = static_cast<int16_t>(x[i]);
  }
  void load_codes(int list, int scale_list, Real* x) const {
    tile_load_codes(static_cast<const uint8_t*>(tensors.ptr[t][list]) + start,
                    tensors.dtype[t][list] == DType::kI8,
                    static_cast<const float*>(tensors.ptr[t][scale_list]) + start / kMomentBlock,
                    len, x);
  }
  void store_codes(int list, int scale_list, const Real* x) const {
    tile_store_codes(static_cast<uint8_t*>(tensors.ptr[t][list]) + start,
                     tensors.dtype[t][list] == DType::kI8,
                     static_cast<float*>(tensors.ptr[t][scale_list]) + start / kMomentBlock, len,
                     x);
  }
  void round_stochastically(uint32_t stream, Real* x) const {
    round_tile(tensors.dtype[t][OptimizerLists::kParams], stream, start, len, x);
  }
  void update(const typename Family::template Step<Real>& s, const Real* g, const Real* p,
              Real* s0, Real* s1, Real* s2, Real* u) const {
    tile_elements(Family{}, s, len, tensors.mask[t], g, p, s0, s1, s2, u);
  }
  // Trust-ratio families (trust_sums.h): `tile_direction` is their per-ISA direction loop
  // (JAXFUSE_CPU_TRUST_SUMS).
  void direction(const typename Family::template Step<Real>& s, const Real* g, const Real* p,
                 const Real* s0, const Real* s1, const Real* s2, Real* d) const {
    tile_direction(Family{}, s, len, tensors.mask[t], g, p, s0, s1, s2, d);
  }
};

// Whether tensor t takes the shortcut: every list stored in the compute type, no master copy.
template <typename Real>
bool native_in_place(const TensorLists& tensors, const OptimizerLists& lists, int64_t t) {
  if (lists.master >= 0) return false;
  for (int k = 0; k < lists.count(); ++k) {
    if (tensors.dtype[t][k] != kNativeDType<Real>) return false;
  }
  return true;
}

// The shortcut's view of list `list` of a tile: its buffer (null where the call has no such list).
template <typename Family, typename Real>
Real* on_buffer(const Tile<Family, Real>& tile, const OptimizerLists& lists, int list) {
  return list < lists.count() ? static_cast<Real*>(tile.tensors.ptr[tile.t][list]) + tile.start
                              : nullptr;
}

// The shortcut's gradients of a tile as the step sees them: the buffer, or scaled into `scratch`.
template <typename Family, typename Real>
const Real* scaled_grads(const GradScaling<Real>& scaling, const OptimizerLists& lists,
                         const Tile<Family, Real>& tile, Real* scratch) {
  const Real* g = on_buffer(tile, lists, OptimizerLists::kGrads);
  if (!scaling.scale && !scaling.clip) return g;
  std::copy(g, g + tile.len, scratch);
  scale_tile(scaling, tile.len, scratch);
  return scratch;
}

// The shortcut for a tile: optimizer_group()'s program for that case, on the buffers.
template <typename Family, typename Real>
void native_tile(const OptimizerStep<Family, Real>& step, const OptimizerLists& lists,
                 const Tile<Family, Real>& tile, Real* scratch_g, Real* scratch_u) {
  auto at = [&](int list) { return on_buffer(tile, lists, list); };
  const Real* g = scaled_grads(step.grad, lists, tile, scratch_g);
  Real* p = at(OptimizerLists::kParams);
  tile.update(step.math, g, p, at(OptimizerLists::state(0)), at(OptimizerLists::state(1)),
              at(OptimizerLists::state(2)), scratch_u);
  add_into(tile.len, p, scratch_u);
}

template <typename Family, typename Real>
void run_chunk(const OptimizerStep<Family, Real>& call_step,
               const typename OptimizerOp<Family>::Call& call, int64_t t, int64_t start,
               int64_t n) {
  const auto step = tensor_step(call_step, call.trust_sums, t, call.tensors.mask[t]);
  const bool native = native_in_place<Real>(call.tensors, call.lists, t);
  alignas(64) Real g[kTile], u[kTile];
  for (int64_t off = start; off < start + n; off += kTile) {
    const Tile<Family, Real> tile{call.tensors, t, off, std::min(kTile, start + n - off)};
    if (native) {
      native_tile(step, call.lists, tile, g, u);
    } else {
      optimizer_group(step, call.lists, tile);
    }
  }
}

template <typename Family, typename Real>
void run(ffi::ThreadPool* pool, const typename OptimizerOp<Family>::Call& call) {
  const auto step = make_optimizer_step<Family, Real>(call.hyper, call.grad_ctrl, *call.count,
                                                      call.flags, call.complex, call.rounding_keys);
  *call.new_count = next_count(*call.count, step.grad.skip);
  if (step.grad.skip) return;  // the state stays as it is
  const ChunkIndex chunks(call.tensors, kChunk);
  for_each_chunk(pool, call.tensors, chunks, [&](int64_t t, int64_t start, int64_t n, int64_t) {
    run_chunk<Family, Real>(step, call, t, start, n);
  });
}

}  // namespace cpu_optimizer

// Compiles `elements(step, n, tensor_flags, g, p, s0, s1, s2, u)` (a template over the compute
// type, inlined) per ISA level for float and double, and registers Family's CPU handler.
#define JAXFUSE_CPU_OPTIMIZER(Family, elements)                                                  \
  JF_CPU_MULTIVERSION void tile_elements(Family, const Family::Step<float>& s, int64_t n,         \
                                         uint8_t tensor_flags, const float* g, const float* p,    \
                                         float* s0, float* s1, float* s2, float* u) {             \
    elements(s, n, tensor_flags, g, p, s0, s1, s2, u);                                           \
  }                                                                                              \
  JF_CPU_MULTIVERSION void tile_elements(Family, const Family::Step<double>& s, int64_t n,        \
                                         uint8_t tensor_flags, const double* g, const double* p,  \
                                         double* s0, double* s1, double* s2, double* u) {         \
    elements(s, n, tensor_flags, g, p, s0, s1, s2, u);                                           \
  }                                                                                              \
  template <>                                                                                    \
  template <>                                                                                    \
  ffi::Error OptimizerOp<Family>::run<Cpu>(ffi::ThreadPool pool, const Call& call) {             \
    if (call.f64) {                                                                              \
      cpu_optimizer::run<Family, double>(&pool, call);                                           \
    } else {                                                                                     \
      cpu_optimizer::run<Family, float>(&pool, call);                                            \
    }                                                                                            \
    return ffi::Error::Success();                                                                \
  }                                                                                              \
  JAXFUSE_REGISTER_OP(OptimizerOp<Family>, Cpu)

}  // namespace jaxfuse
