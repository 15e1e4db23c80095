// Adagrad: the element math and the family of the optimizer op (optimizer.h), shared by the CPU
// handler and the CUDA kernel. optax.adagrad is scale_by_rss -> scale_by_learning_rate; the math
// follows its operation order. `Real` is the compute type: float, or double for float64 calls.
#pragma once

#include <cstdint>

#include "optim/optimizer.h"

namespace jaxfuse {

// The hyperparameter vector built in JAX. initial_accumulator_value only shapes the state that
// init() makes, so the kernel never reads it.
#define JAXFUSE_ADAGRAD_HYPER_FIELDS(X) X(learning_rate) X(eps)
JF_DEFINE_VECTOR_LAYOUT(AdagradHyper, JAXFUSE_ADAGRAD_HYPER_FIELDS);

template <typename Real>
struct AdagradStep {
  Real lr, eps;
  bool complex;  // elements are (re, im) pairs
};

// One element: the sum of squares s updated in place, returns the update. optax: s = g^2 + s;
// u = (s > 0 ? rsqrt(s + eps) : 0) * g; u = -lr * u. The reciprocal square root is IEEE sqrt and
// division (not CUDA's approximate rsqrtf), so that both handlers round alike. Computed for
// every element, then selected: with -fno-trapping-math the CPU loop then vectorizes (a
// conditional sqrt stays a branch: 3.3x slower on the GPT-2 tree).
template <typename Real>
JF_HD Real adagrad_scale(const AdagradStep<Real>& st, Real s) {
  const Real inv_sqrt = Real(1) / jf_sqrt(s + st.eps);
  return s > Real(0) ? inv_sqrt : Real(0);
}

template <typename Real>
JF_HD Real adagrad_element(const AdagradStep<Real>& st, Real g, Real& s) {
  s = g * g + s;
  return -st.lr * (adagrad_scale(st, s) * g);
}

// One complex element, (re, im) at [0], [1]: optax adds |g|^2 = re^2 + im^2 to a complex sum
// whose imaginary part stays as init made it (0), and scales both parts by the real factor.
template <typename Real>
JF_HD void adagrad_complex_element(const AdagradStep<Real>& st, const Real* g, Real* s, Real* u) {
  s[0] = (g[0] * g[0] + g[1] * g[1]) + s[0];
  const Real scale = adagrad_scale(st, s[0]);
  u[0] = -st.lr * (scale * g[0]);
  u[1] = -st.lr * (scale * g[1]);
}

// The element loop over n scalars (n even for complex tensors): branch-free (the select
// vectorizes) with no aliasing.
template <typename Real, typename Count>
JF_HD void adagrad_elements(const AdagradStep<Real>& st, Count n, const Real* __restrict__ g,
                            Real* __restrict__ s, Real* __restrict__ u) {
  if (st.complex) {
    for (Count i = 0; i < n; i += 2) adagrad_complex_element(st, g + i, s + i, u + i);
  } else {
    for (Count i = 0; i < n; ++i) u[i] = adagrad_element(st, g[i], s[i]);
  }
}

// The Adagrad family of the optimizer op: state sum_of_squares (complex for complex tensors, as
// optax's).
struct Adagrad {
  static constexpr const char* kName = "jaxfuse_adagrad";
  using Hyper = AdagradHyper;
  // No flags and no per-tensor flags; C++ has no empty arrays, so one name each that is never set.
  static constexpr const char* kFlagNames[] = {"unused"};
  static constexpr const char* kTensorFlagNames[] = {"unused"};
  static constexpr bool kComplex = true;
  static constexpr int kMaxStates = 1;
  static constexpr bool allows_states(int k) { return k == 1; }
  static constexpr int num_states(uint32_t) { return 1; }
  static const char* state_name(uint32_t, int) { return "sum_of_squares"; }

  template <typename Real>
  using Step = AdagradStep<Real>;

  template <typename Real>
  static JF_HD Step<Real> make_step(ScalarVector hyper, int32_t, uint32_t, bool complex) {
    return {Real(hyper[AdagradHyper::learning_rate]), Real(hyper[AdagradHyper::eps]), complex};
  }

  template <typename Real, typename Count>
  static JF_HD void update(const Step<Real>& s, Count n, uint8_t, const Real* __restrict__ g,
                           const Real* __restrict__, Real* __restrict__ sum_of_squares,
                           Real* __restrict__, Real* __restrict__, Real* __restrict__ u) {
    adagrad_elements(s, n, g, sum_of_squares, u);
  }
};

}  // namespace jaxfuse
