// The CPU driver of a trust-ratio family's first pass (trust_sums.h): chunks of every tensor over
// XLA's thread pool, each in tiles through trust_group() (the GPU's program too; tensors stored
// in the compute type are read in place), the squares of
// the params and of the direction added into 16 double lanes; a partial per chunk, added per
// tensor in chunk order, so that the sums do not depend on how the pool ran the chunks.
//
// A family's CPU file adds one line, JAXFUSE_CPU_TRUST_SUMS(Family, direction): `direction` is
// its direction loop, compiled per ISA level like the update's.
#pragma once

#include <algorithm>
#include <cstring>
#include <vector>

#include "optim/trust_sums.h"
#include "optim/cpu/optimizer.h"

namespace jaxfuse {
namespace cpu_trust_sums {

constexpr int kLanes = 16;

// lanes[i % kLanes] += x[i]^2 in double (exact squares; a fixed association that vectorizes).
template <typename T>
__attribute__((always_inline)) inline void add_squares_into(int64_t len, const T* __restrict__ x,
                                                            double* __restrict__ lanes) {
  double acc[kLanes];
  std::memcpy(acc, lanes, sizeof(acc));
  int64_t i = 0;
  for (; i + kLanes <= len; i += kLanes) {
    for (int k = 0; k < kLanes; ++k) {
      const double v = double(x[i + k]);
      acc[k] += v * v;
    }
  }
  for (int k = 0; i < len; ++i, ++k) {
    const double v = double(x[i]);
    acc[k] += v * v;
  }
  std::memcpy(lanes, acc, sizeof(acc));
}

JF_CPU_MULTIVERSION
static void add_squares(int64_t len, const float* x, double* lanes) {
  add_squares_into(len, x, lanes);
}

JF_CPU_MULTIVERSION
static void add_squares(int64_t len, const double* x, double* lanes) {
  add_squares_into(len, x, lanes);
}

// trust_group() for a tile whose lists are all stored in the compute type: read in place (the
// gradients are copied only to be scaled), as the optimizer's shortcut does. `*p` is set to the
// params.
template <typename Family, typename Real>
void native_direction(const OptimizerStep<Family, Real>& step, const OptimizerLists& lists,
                      const cpu_optimizer::Tile<Family, Real>& tile, Real* scratch_g,
                      const Real** p, Real* d) {
  auto at = [&](int list) -> const Real* { return cpu_optimizer::on_buffer(tile, lists, list); };
  const Real* g = cpu_optimizer::scaled_grads(step.grad, lists, tile, scratch_g);
  *p = at(OptimizerLists::kParams);
  tile.direction(step.math, g, *p, at(OptimizerLists::state(0)), at(OptimizerLists::state(1)),
                 at(OptimizerLists::state(2)), d);
}

template <typename Family, typename Real>
TrustSum chunk_sum(const OptimizerStep<Family, Real>& step,
                   const typename TrustSumsOp<Family>::Call& call, int64_t t, int64_t start,
                   int64_t n) {
  using cpu_optimizer::kTile;
  const bool native = cpu_optimizer::native_in_place<Real>(call.tensors, call.lists, t);
  alignas(64) Real g[kTile], p[kTile], d[kTile];
  double param_lanes[kLanes] = {}, direction_lanes[kLanes] = {};
  for (int64_t off = start; off < start + n; off += kTile) {
    const cpu_optimizer::Tile<Family, Real> tile{call.tensors, t, off,
                                                 std::min(kTile, start + n - off)};
    const Real* params = p;
    if (native) {
      native_direction(step, call.lists, tile, g, &params, d);
    } else {
      trust_group(step, call.lists, tile, p, d);
    }
    add_squares(tile.len, params, param_lanes);
    add_squares(tile.len, d, direction_lanes);
  }
  TrustSum sum;
  for (int k = 0; k < kLanes; ++k) sum.add({param_lanes[k], direction_lanes[k]});
  return sum;
}

template <typename Family, typename Real>
void run(ffi::ThreadPool* pool, const typename TrustSumsOp<Family>::Call& call) {
  const auto step = make_optimizer_step<Family, Real>(call.hyper, call.grad_ctrl, *call.count,
                                                      call.flags, call.complex);
  const ChunkIndex chunks(call.tensors, cpu_optimizer::kChunk);
  std::vector<TrustSum> partials(chunks.total());
  for_each_chunk(pool, call.tensors, chunks, [&](int64_t t, int64_t start, int64_t n, int64_t c) {
    partials[c] = chunk_sum<Family, Real>(step, call, t, start, n);
  });
  for (int64_t t = 0; t < call.tensors.num_tensors(); ++t) {
    TrustSum total;
    for (int64_t c = chunks.first[t]; c < chunks.first[t + 1]; ++c) total.add(partials[c]);
    total.store(call.sums + t * kTrustSumWords);
  }
}

}  // namespace cpu_trust_sums

// Compiles `direction(step, n, tensor_flags, g, p, s0, s1, s2, d)` per ISA level for float and
// double, and registers the CPU handler of Family's first pass.
#define JAXFUSE_CPU_TRUST_SUMS(Family, direction)                                                 \
  JF_CPU_MULTIVERSION void tile_direction(Family, const Family::Step<float>& s, int64_t n,        \
                                          uint8_t tensor_flags, const float* g, const float* p,   \
                                          const float* s0, const float* s1, const float* s2,      \
                                          float* d) {                                             \
    direction(s, n, tensor_flags, g, p, s0, s1, s2, d);                                          \
  }                                                                                              \
  JF_CPU_MULTIVERSION void tile_direction(Family, const Family::Step<double>& s, int64_t n,       \
                                          uint8_t tensor_flags, const double* g, const double* p, \
                                          const double* s0, const double* s1, const double* s2,   \
                                          double* d) {                                            \
    direction(s, n, tensor_flags, g, p, s0, s1, s2, d);                                          \
  }                                                                                              \
  template <>                                                                                    \
  template <>                                                                                    \
  ffi::Error TrustSumsOp<Family>::run<Cpu>(ffi::ThreadPool pool, const Call& call) {             \
    if (call.f64) {                                                                              \
      cpu_trust_sums::run<Family, double>(&pool, call);                                          \
    } else {                                                                                     \
      cpu_trust_sums::run<Family, float>(&pool, call);                                           \
    }                                                                                            \
    return ffi::Error::Success();                                                                \
  }                                                                                              \
  JAXFUSE_REGISTER_OP(TrustSumsOp<Family>, Cpu)

}  // namespace jaxfuse
