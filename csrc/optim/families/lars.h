// LARS (You et al., 2017, https://arxiv.org/abs/1708.03888): the element math and the family of
// the optimizer op (optimizer.h), a trust-ratio family. optax.lars is add_decayed_weights ->
// masked(scale_by_trust_ratio) -> scale_by_learning_rate -> trace; per tensor the direction is
// g + wd * p, scaled by trust_coefficient * ||p|| / (||direction|| + eps) where the trust mask
// says, then by -lr, then through momentum. `Real` is the compute type.
#pragma once

#include <cstdint>

#include "optim/optimizer.h"

namespace jaxfuse {

#define JAXFUSE_LARS_HYPER_FIELDS(X) \
  X(learning_rate) X(weight_decay) X(trust_coefficient) X(eps) X(momentum)
JF_DEFINE_VECTOR_LAYOUT(LarsHyper, JAXFUSE_LARS_HYPER_FIELDS);

template <typename Real>
struct LarsStep {
  Real lr, weight_decay, trust_coefficient, eps, momentum;
  bool nesterov;
  Real trust_ratio = Real(1);  // the tensor's (tensor_step())
};

// The LARS family: one state list, trace (optax.trace's momentum, which it keeps even at 0);
// per tensor `decay` (the weight-decay mask) and `trust` (the trust-ratio mask). Every step is
// per scalar with a real ratio, so a complex tensor is its (re, im) scalars, and their norms
// optax's |x| norms.
struct Lars {
  static constexpr const char* kName = "jaxfuse_lars";
  static constexpr const char* kTrustSumsName = "jaxfuse_lars_trust_sums";
  static constexpr bool kTrustRatio = true;
  static constexpr int kDirectionStates = 0;  // g + wd * p: the trace is not read
  using Hyper = LarsHyper;
  enum Flag : uint32_t { kNesterov = 1 };
  enum TensorFlag : uint8_t { kDecay = 1, kTrust = 2 };
  static constexpr const char* kFlagNames[] = {"nesterov"};
  static constexpr const char* kTensorFlagNames[] = {"decay", "trust"};
  static constexpr bool kComplex = true;
  static constexpr int kMaxStates = 1;
  static constexpr bool allows_states(int k) { return k == 1; }
  static constexpr int num_states(uint32_t) { return 1; }
  static const char* state_name(uint32_t, int) { return "trace"; }

  template <typename Real>
  using Step = LarsStep<Real>;

  template <typename Real>
  static JF_HD Step<Real> make_step(ScalarVector hyper, int32_t, uint32_t flags, bool) {
    Step<Real> s;
    s.lr = Real(hyper[LarsHyper::learning_rate]);
    s.weight_decay = Real(hyper[LarsHyper::weight_decay]);
    s.trust_coefficient = Real(hyper[LarsHyper::trust_coefficient]);
    s.eps = Real(hyper[LarsHyper::eps]);
    s.momentum = Real(hyper[LarsHyper::momentum]);
    s.nesterov = (flags & kNesterov) != 0;
    return s;
  }

  template <typename Real>
  static JF_HD Real trust_ratio(const Step<Real>& s, uint8_t tensor_flags, double param_sumsq,
                                double direction_sumsq) {
    if (!(tensor_flags & kTrust)) return Real(1);
    return optax_trust_ratio(s.trust_coefficient, s.eps, param_sumsq, direction_sumsq);
  }

  template <typename Real, typename Count>
  static JF_HD void direction(const Step<Real>& s, Count n, uint8_t tensor_flags,
                              const Real* __restrict__ g, const Real* __restrict__ p,
                              const Real* __restrict__, const Real* __restrict__,
                              const Real* __restrict__, Real* __restrict__ d) {
    if (tensor_flags & kDecay) {
      for (Count i = 0; i < n; ++i) d[i] = g[i] + s.weight_decay * p[i];
    } else {
      for (Count i = 0; i < n; ++i) d[i] = g[i];
    }
  }

  // optax's order: x = -lr * (ratio * direction); trace = x + momentum * trace;
  // u = nesterov ? x + momentum * trace : trace.
  template <typename Real, typename Count>
  static JF_HD void update(const Step<Real>& s, Count n, uint8_t tensor_flags,
                           const Real* __restrict__ g, const Real* __restrict__ p,
                           Real* __restrict__ trace, Real* __restrict__, Real* __restrict__,
                           Real* __restrict__ u) {
    const bool decay = (tensor_flags & kDecay) != 0;
    for (Count i = 0; i < n; ++i) {
      const Real d = decay ? g[i] + s.weight_decay * p[i] : g[i];
      const Real x = -s.lr * (d * s.trust_ratio);
      const Real t = x + s.momentum * trace[i];
      trace[i] = t;
      u[i] = s.nesterov ? x + s.momentum * t : t;
    }
  }
};

}  // namespace jaxfuse
