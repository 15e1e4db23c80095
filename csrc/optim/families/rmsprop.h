// RMSprop (Tieleman & Hinton, 2012; centered: Graves, 2013, https://arxiv.org/abs/1308.0850): the
// element math and the family of the optimizer op (optimizer.h), one definition compiled for the
// host (CPU handler) and the device (CUDA kernel). `Real` is the compute type: float, or double
// for float64 calls.
#pragma once

#include <cstdint>

#include "optim/families/adam.h"  // bias_correction(): optax's 1 - decay^t, shared with Adam
#include "optim/optimizer.h"

namespace jaxfuse {

// The hyperparameter vector, built in JAX. one_minus_decay is computed by the caller as optax
// computes it, so that rounding matches.
#define JAXFUSE_RMSPROP_HYPER_FIELDS(X) \
  X(learning_rate) X(decay) X(one_minus_decay) X(eps) X(momentum)
JF_DEFINE_VECTOR_LAYOUT(RmspropHyper, JAXFUSE_RMSPROP_HYPER_FIELDS);

// Per-step scalars in the compute type, and the configuration.
template <typename Real>
struct RmspropStep {
  Real lr, decay, one_minus_decay, eps, momentum;
  Real bc;  // 1 - decay^t with bias correction, else 1 (dividing by 1 is exact: no flag needed)
  bool centered, has_momentum, nesterov, eps_in_sqrt;
  bool complex;  // elements are (re, im) pairs
};

// The reciprocal of the denominator from the variance estimate.
template <typename Real>
JF_HD Real rmsprop_scaling(const RmspropStep<Real>& s, Real var) {
  return s.eps_in_sqrt ? Real(1) / jf_sqrt(var + s.eps) : Real(1) / (jf_sqrt(var) + s.eps);
}

// One scalar's update from its scaled gradient: -lr times it, through the momentum trace tr[i].
template <typename Real>
JF_HD Real rmsprop_update(const RmspropStep<Real>& s, Real scaled, Real* __restrict__ tr,
                          int64_t i) {
  Real v = scaled * -s.lr;
  if (s.has_momentum) {
    tr[i] = v + s.momentum * tr[i];
    v = s.nesterov ? v + s.momentum * tr[i] : tr[i];
  }
  return v;
}

// One complex element at i, i + 1 (re, im), as optax does it: nu from |g|^2, its imaginary part
// (0 from init) decayed; mu per part; the variance nu_hat - |mu_hat|^2 real.
template <typename Real>
JF_HD void rmsprop_complex_element(const RmspropStep<Real>& s, int64_t i,
                                   const Real* __restrict__ g, Real* __restrict__ mu,
                                   Real* __restrict__ nu, Real* __restrict__ tr,
                                   Real* __restrict__ u) {
  nu[i] = s.one_minus_decay * (g[i] * g[i] + g[i + 1] * g[i + 1]) + s.decay * nu[i];
  nu[i + 1] = s.decay * nu[i + 1];
  Real var = nu[i] / s.bc;
  if (s.centered) {
    mu[i] = s.one_minus_decay * g[i] + s.decay * mu[i];
    mu[i + 1] = s.one_minus_decay * g[i + 1] + s.decay * mu[i + 1];
    const Real re = mu[i] / s.bc, im = mu[i + 1] / s.bc;
    var = var - (re * re + im * im);
  }
  const Real scaling = rmsprop_scaling(s, var);
  u[i] = rmsprop_update(s, scaling * g[i], tr, i);
  u[i + 1] = rmsprop_update(s, scaling * g[i + 1], tr, i + 1);
}

// optax's scale_by_rms / scale_by_stddev -> scale_by_learning_rate -> trace, in its operation
// order, over n scalars (n even for complex tensors): the states (mu only when centered, trace
// only with momentum) updated in place, u the update. The configuration is uniform over the loop.
template <typename Real, typename Count>
JF_HD void rmsprop_elements(const RmspropStep<Real>& s, Count n, const Real* __restrict__ g,
                            Real* __restrict__ mu, Real* __restrict__ nu, Real* __restrict__ tr,
                            Real* __restrict__ u) {
  if (s.complex) {
    for (Count i = 0; i < n; i += 2) rmsprop_complex_element(s, i, g, mu, nu, tr, u);
    return;
  }
  for (Count i = 0; i < n; ++i) {
    nu[i] = s.one_minus_decay * (g[i] * g[i]) + s.decay * nu[i];
    Real var = nu[i] / s.bc;
    if (s.centered) {
      mu[i] = s.one_minus_decay * g[i] + s.decay * mu[i];
      const Real mu_hat = mu[i] / s.bc;
      var = var - mu_hat * mu_hat;
    }
    u[i] = rmsprop_update(s, rmsprop_scaling(s, var) * g[i], tr, i);
  }
}

// The RMSprop family of the optimizer op: state lists [mu,] nu[, trace] in optax's order.
struct Rmsprop {
  static constexpr const char* kName = "jaxfuse_rmsprop";
  using Hyper = RmspropHyper;
  enum Flag : uint32_t {
    kCentered = 1,
    kMomentum = 2,
    kNesterov = 4,
    kEpsInSqrt = 8,
    kBiasCorrection = 16
  };
  static constexpr const char* kFlagNames[] = {"centered", "momentum", "nesterov", "eps_in_sqrt",
                                               "bias_correction"};
  // No per-tensor flags, but C++ has no empty arrays: one placeholder bit, never set.
  static constexpr const char* kTensorFlagNames[] = {"none"};
  static constexpr bool kComplex = true;
  static constexpr int kMaxStates = 3;
  static constexpr bool allows_states(int k) { return k >= 1 && k <= 3; }
  static constexpr int num_states(uint32_t flags) {
    return 1 + ((flags & kCentered) ? 1 : 0) + ((flags & kMomentum) ? 1 : 0);
  }
  static const char* state_name(uint32_t flags, int k) {
    if (flags & kCentered) {
      if (k == 0) return "mu";
      --k;
    }
    return k == 0 ? "nu" : "trace";
  }

  template <typename Real>
  using Step = RmspropStep<Real>;

  template <typename Real>
  static JF_HD Step<Real> make_step(ScalarVector hyper, int32_t count, uint32_t flags,
                                    bool complex) {
    Step<Real> s;
    s.lr = Real(hyper[RmspropHyper::learning_rate]);
    s.decay = Real(hyper[RmspropHyper::decay]);
    s.one_minus_decay = Real(hyper[RmspropHyper::one_minus_decay]);
    s.eps = Real(hyper[RmspropHyper::eps]);
    s.momentum = Real(hyper[RmspropHyper::momentum]);
    s.bc = (flags & kBiasCorrection)
               ? bias_correction<Real>(hyper, RmspropHyper::decay, safe_increment(count))
               : Real(1);
    s.centered = (flags & kCentered) != 0;
    s.has_momentum = (flags & kMomentum) != 0;
    s.nesterov = (flags & kNesterov) != 0;
    s.eps_in_sqrt = (flags & kEpsInSqrt) != 0;
    s.complex = complex;
    return s;
  }

  // The state lists by role: s0.. hold [mu,] nu[, trace].
  template <typename Real, typename Count>
  static JF_HD void update(const Step<Real>& s, Count n, uint8_t, const Real* __restrict__ g,
                           const Real* __restrict__, Real* __restrict__ s0,
                           Real* __restrict__ s1, Real* __restrict__ s2, Real* __restrict__ u) {
    if (s.centered) {
      rmsprop_elements(s, n, g, s0, s1, s2, u);
    } else {
      rmsprop_elements(s, n, g, static_cast<Real*>(nullptr), s0, s1, u);
    }
  }
};

}  // namespace jaxfuse
