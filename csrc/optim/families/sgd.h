// SGD with optional (Nesterov) momentum: the element math and the family of the optimizer op
// (optimizer.h), shared by the CPU handler and the CUDA kernel. optax.sgd is
// trace(momentum, nesterov) -> scale_by_learning_rate; the math follows its operation order.
// `Real` is the compute type: float, or double for calls with float64 storage.
#pragma once

#include <cstdint>

#include "optim/optimizer.h"

namespace jaxfuse {

// The hyperparameter vector built in JAX (device scalars: schedules and inject_hyperparams work
// without recompiling). `momentum` is 0 and unread when the optimizer keeps no trace.
#define JAXFUSE_SGD_HYPER_FIELDS(X) X(learning_rate) X(momentum)
JF_DEFINE_VECTOR_LAYOUT(SgdHyper, JAXFUSE_SGD_HYPER_FIELDS);

template <typename Real>
struct SgdStep {
  Real lr, momentum;
  bool trace;     // momentum on: one state list, the trace
  bool nesterov;  // the update looks one momentum step ahead
};

// One scalar (a real element, or one part of a complex one: the math is linear): the trace t
// updated in place, returns the update. optax: t = g + momentum * t; u = nesterov ? g + momentum
// * t : t (the new trace before it is rounded to its storage type); u = -lr * u.
template <typename Real>
JF_HD Real sgd_momentum_element(const SgdStep<Real>& s, Real g, Real& t) {
  t = g + s.momentum * t;
  const Real u = s.nesterov ? g + s.momentum * t : t;
  return -s.lr * u;
}

// The element loop over n scalars. Each loop is branch-free inside and its arrays do not alias,
// so the CPU's vectorizes; without momentum there is no trace (t is null).
template <typename Real, typename Count>
JF_HD void sgd_elements(const SgdStep<Real>& s, Count n, const Real* __restrict__ g,
                        Real* __restrict__ t, Real* __restrict__ u) {
  if (s.trace) {
    for (Count i = 0; i < n; ++i) u[i] = sgd_momentum_element(s, g[i], t[i]);
  } else {
    for (Count i = 0; i < n; ++i) u[i] = -s.lr * g[i];
  }
}

// The SGD family of the optimizer op: state `trace` with momentum, none without.
struct Sgd {
  static constexpr const char* kName = "jaxfuse_sgd";
  using Hyper = SgdHyper;
  enum Flag : uint32_t { kMomentum = 1, kNesterov = 2 };
  static constexpr const char* kFlagNames[] = {"momentum", "nesterov"};
  // No per-tensor flags; C++ has no empty arrays, so one name that is never set.
  static constexpr const char* kTensorFlagNames[] = {"unused"};
  static constexpr bool kComplex = true;
  static constexpr int kMaxStates = 1;
  static constexpr bool allows_states(int k) { return k == 0 || k == 1; }
  static constexpr int num_states(uint32_t flags) { return (flags & kMomentum) ? 1 : 0; }
  static const char* state_name(uint32_t, int) { return "trace"; }

  template <typename Real>
  using Step = SgdStep<Real>;

  template <typename Real>
  static JF_HD Step<Real> make_step(ScalarVector hyper, int32_t, uint32_t flags, bool) {
    Step<Real> s;
    s.lr = Real(hyper[SgdHyper::learning_rate]);
    s.momentum = Real(hyper[SgdHyper::momentum]);
    s.trace = (flags & kMomentum) != 0;
    s.nesterov = (flags & kNesterov) != 0;
    return s;
  }

  template <typename Real, typename Count>
  static JF_HD void update(const Step<Real>& s, Count n, uint8_t, const Real* __restrict__ g,
                           const Real* __restrict__, Real* __restrict__ trace, Real* __restrict__,
                           Real* __restrict__, Real* __restrict__ u) {
    sgd_elements(s, n, g, trace, u);
  }
};

}  // namespace jaxfuse
