// Lion (Chen et al., 2023, https://arxiv.org/abs/2302.06675): the element math and the family of
// the optimizer op (optimizer.h), one definition compiled for the host (CPU handler) and the
// device (CUDA kernel). `Real` is the compute type: float, or double for float64 calls.
#pragma once

#include <cstdint>

#include "optim/optimizer.h"

namespace jaxfuse {

// The hyperparameter vector, built in JAX (schedules and inject_hyperparams need no recompile).
// The (1 - b) terms are computed by the caller as optax computes them, so that rounding matches.
#define JAXFUSE_LION_HYPER_FIELDS(X) \
  X(learning_rate) X(b1) X(one_minus_b1) X(b2) X(one_minus_b2) X(weight_decay)
JF_DEFINE_VECTOR_LAYOUT(LionHyper, JAXFUSE_LION_HYPER_FIELDS);

// Per-step scalars in the compute type.
template <typename Real>
struct LionStep {
  Real lr, b1, one_minus_b1, b2, one_minus_b2, weight_decay;
};

// XLA's sign: +-1, and x itself for +-0 and NaN. Selects, not branches: the loop vectorizes.
template <typename Real>
JF_HD Real lion_sign(Real x) {
  return x > Real(0) ? Real(1) : (x < Real(0) ? Real(-1) : x);
}

// optax's scale_by_lion -> add_decayed_weights -> scale_by_learning_rate, in its operation
// order, over n scalars: m updated in place, u the update. `decay` is uniform over the loop.
template <typename Real, typename Count>
JF_HD void lion_elements(const LionStep<Real>& s, Count n, bool decay, const Real* __restrict__ g,
                         const Real* __restrict__ p, Real* __restrict__ m, Real* __restrict__ u) {
  for (Count i = 0; i < n; ++i) {
    Real d = lion_sign(s.one_minus_b1 * g[i] + s.b1 * m[i]);
    m[i] = s.one_minus_b2 * g[i] + s.b2 * m[i];
    if (decay) d = d + s.weight_decay * p[i];
    u[i] = d * -s.lr;
  }
}

// The Lion family of the optimizer op: one state list, mu; `decay` marks the tensors with weight
// decay. Real tensors only: the sign of a complex number is not Lion's update.
struct Lion {
  static constexpr const char* kName = "jaxfuse_lion";
  using Hyper = LionHyper;
  // Lion has no call flags, but C++ has no empty arrays: one placeholder bit, never set.
  static constexpr const char* kFlagNames[] = {"none"};
  static constexpr const char* kTensorFlagNames[] = {"decay"};
  static constexpr bool kComplex = false;
  static constexpr int kMaxStates = 1;
  static constexpr bool allows_states(int k) { return k == 1; }
  static constexpr int num_states(uint32_t) { return 1; }
  static const char* state_name(uint32_t, int) { return "mu"; }

  template <typename Real>
  using Step = LionStep<Real>;

  template <typename Real>
  static JF_HD Step<Real> make_step(ScalarVector hyper, int32_t, uint32_t, bool) {
    return {Real(hyper[LionHyper::learning_rate]), Real(hyper[LionHyper::b1]),
            Real(hyper[LionHyper::one_minus_b1]),  Real(hyper[LionHyper::b2]),
            Real(hyper[LionHyper::one_minus_b2]),  Real(hyper[LionHyper::weight_decay])};
  }

  template <typename Real, typename Count>
  static JF_HD void update(const Step<Real>& s, Count n, uint8_t tensor_flags,
                           const Real* __restrict__ g, const Real* __restrict__ p,
                           Real* __restrict__ mu, Real* __restrict__, Real* __restrict__,
                           Real* __restrict__ u) {
    lion_elements(s, n, tensor_flags != 0, g, p, mu, u);
  }
};

}  // namespace jaxfuse
