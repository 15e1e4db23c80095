// LAMB (You et al., 2019, https://arxiv.org/abs/1904.00962): the element math and the family of
// the optimizer op (optimizer.h), a trust-ratio family. optax.lamb is scale_by_adam ->
// add_decayed_weights -> scale_by_trust_ratio -> scale_by_learning_rate; per tensor the direction
// is Adam's bias-corrected m / (sqrt(v) + eps) plus wd * p, scaled by ||p|| / ||direction||.
// `Real` is the compute type: float, or double for float64 calls.
#pragma once

#include <cstdint>

#include "optim/families/adam.h"

namespace jaxfuse {

template <typename Real>
struct LambStep : AdamStep<Real> {
  Real trust_ratio = Real(1);  // the tensor's (tensor_step())
};

// The LAMB family: Adam's states (mu, nu) and hyperparameters, no nesterov; `decay` marks the
// tensors with weight decay. Complex tensors as Adam's (its complex nu); their norms are those of
// the (re, im) scalars, optax's |x| norms.
struct Lamb {
  static constexpr const char* kName = "jaxfuse_lamb";
  static constexpr const char* kTrustSumsName = "jaxfuse_lamb_trust_sums";
  static constexpr bool kTrustRatio = true;
  static constexpr int kDirectionStates = 2;  // the moments
  using Hyper = AdamHyper;
  // LAMB has no call flags, but C++ has no empty arrays: one placeholder bit, never set.
  static constexpr const char* kFlagNames[] = {"none"};
  static constexpr const char* kTensorFlagNames[] = {"decay"};
  static constexpr bool kComplex = true;
  static constexpr int kMaxStates = 2;
  static constexpr bool allows_states(int k) { return k == 2; }
  static constexpr int num_states(uint32_t) { return 2; }
  static const char* state_name(uint32_t, int k) { return k == 0 ? "mu" : "nu"; }

  template <typename Real>
  using Step = LambStep<Real>;

  template <typename Real>
  static JF_HD Step<Real> make_step(ScalarVector hyper, int32_t count, uint32_t, bool complex) {
    Step<Real> s;
    static_cast<AdamStep<Real>&>(s) = make_adam_step<Real>(hyper, count, false, complex);
    return s;
  }

  // scale_by_trust_ratio() with its defaults: trust coefficient 1, eps 0.
  template <typename Real>
  static JF_HD Real trust_ratio(const Step<Real>&, uint8_t, double param_sumsq,
                                double direction_sumsq) {
    return optax_trust_ratio(Real(1), Real(0), param_sumsq, direction_sumsq);
  }

  // The direction from the moments this step would write (they stay as they are).
  template <typename Real, typename Count>
  static JF_HD void direction(const Step<Real>& s, Count n, uint8_t tensor_flags,
                              const Real* __restrict__ g, const Real* __restrict__ p,
                              const Real* __restrict__ mu, const Real* __restrict__ nu,
                              const Real* __restrict__, Real* __restrict__ d) {
    const bool decay = tensor_flags != 0;
    if (s.complex) {
      for (Count i = 0; i < n; i += 2) {
        Real m[2] = {mu[i], mu[i + 1]}, v[2] = {nu[i], nu[i + 1]};
        adam_complex_scaled_moment(s, g + i, p + i, decay, m, v, d + i);
      }
      return;
    }
    for (Count i = 0; i < n; ++i) {
      Real m = mu[i];
      const Real v = adam_second_moment(s, g[i] * g[i], nu[i]);
      d[i] = adam_scaled_moment(s, g[i], p[i], decay, m, v);
    }
  }

  template <typename Real, typename Count>
  static JF_HD void update(const Step<Real>& s, Count n, uint8_t tensor_flags,
                           const Real* __restrict__ g, const Real* __restrict__ p,
                           Real* __restrict__ mu, Real* __restrict__ nu, Real* __restrict__,
                           Real* __restrict__ u) {
    const bool decay = tensor_flags != 0;
    if (s.complex) {
      for (Count i = 0; i < n; i += 2) {
        adam_complex_scaled_moment(s, g + i, p + i, decay, mu + i, nu + i, u + i);
        u[i] = (u[i] * s.trust_ratio) * -s.lr;
        u[i + 1] = (u[i + 1] * s.trust_ratio) * -s.lr;
      }
      return;
    }
    for (Count i = 0; i < n; ++i) {
      nu[i] = adam_second_moment(s, g[i] * g[i], nu[i]);
      u[i] = (adam_scaled_moment(s, g[i], p[i], decay, mu[i], nu[i]) * s.trust_ratio) * -s.lr;
    }
  }
};

}  // namespace jaxfuse
