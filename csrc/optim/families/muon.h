// Muon's element pass (Jordan et al., 2024): the family of the optimizer op (optimizer.h) that
// jaxfuse.muon runs over its orthogonalized leaves, one definition for the host (CPU handler)
// and the device (CUDA kernel). The momentum and the Newton-Schulz iterations run before it, in
// XLA (batched by shape: jaxfuse/_optim/newton_schulz.py); the op reads their result, scaled by
// shape, as its gradient, and finishes optax.contrib.muon's chain in its operation order:
// add_decayed_weights, then scale_by_learning_rate. No state list: the momentum is updated
// before the orthogonalization reads it. `Real` is the compute type: float, or double for
// float64 calls; the math is linear, so complex leaves run as pairs of scalars.
#pragma once

#include <cstdint>

#include "optim/optimizer.h"

namespace jaxfuse {

#define JAXFUSE_MUON_HYPER_FIELDS(X) X(learning_rate) X(weight_decay)
JF_DEFINE_VECTOR_LAYOUT(MuonHyper, JAXFUSE_MUON_HYPER_FIELDS);

template <typename Real>
struct MuonStep {
  Real lr, weight_decay;
};

// u = -lr * (o + weight_decay * p) where `decay`, else -lr * o, over n scalars; `decay` is
// uniform over the loop.
template <typename Real, typename Count>
JF_HD void muon_elements(const MuonStep<Real>& s, Count n, bool decay, const Real* __restrict__ o,
                         const Real* __restrict__ p, Real* __restrict__ u) {
  if (decay) {
    for (Count i = 0; i < n; ++i) u[i] = -s.lr * (o[i] + s.weight_decay * p[i]);
  } else {
    for (Count i = 0; i < n; ++i) u[i] = -s.lr * o[i];
  }
}

struct Muon {
  static constexpr const char* kName = "jaxfuse_muon";
  using Hyper = MuonHyper;
  // No call flags; C++ has no empty arrays: one placeholder bit, never set.
  static constexpr const char* kFlagNames[] = {"none"};
  static constexpr const char* kTensorFlagNames[] = {"decay"};
  static constexpr bool kComplex = true;
  static constexpr int kMaxStates = 0;
  static constexpr bool allows_states(int k) { return k == 0; }
  static constexpr int num_states(uint32_t) { return 0; }
  static const char* state_name(uint32_t, int) { return ""; }

  template <typename Real>
  using Step = MuonStep<Real>;

  template <typename Real>
  static JF_HD Step<Real> make_step(ScalarVector hyper, int32_t, uint32_t, bool) {
    return {Real(hyper[MuonHyper::learning_rate]), Real(hyper[MuonHyper::weight_decay])};
  }

  template <typename Real, typename Count>
  static JF_HD void update(const Step<Real>& s, Count n, uint8_t tensor_flags,
                           const Real* __restrict__ o, const Real* __restrict__ p,
                           Real* __restrict__, Real* __restrict__, Real* __restrict__,
                           Real* __restrict__ u) {
    muon_elements(s, n, tensor_flags != 0, o, p, u);
  }
};

}  // namespace jaxfuse
