// Adam / AdamW (and NAdam, NAdamW): the element math and the family of the optimizer op
// (optimizer.h), one definition compiled for the host (CPU handler) and the device (CUDA
// kernel), as PyTorch shares its adam_math between its drivers. `Real` is the compute type:
// float, or double for calls with float64 storage.
#pragma once

#include <cmath>
#include <cstdint>

#include "optim/optimizer.h"

namespace jaxfuse {

// The hyperparameter vector (AdamHyper::kSize scalars on device, a ScalarVector) built in JAX,
// so schedules, inject_hyperparams and traced values all work without recompiling. The (1 - b)
// terms are computed by the caller the way optax computes them, so that rounding matches optax.
#define JAXFUSE_ADAM_HYPER_FIELDS(X) \
  X(learning_rate) X(b1) X(one_minus_b1) X(b2) X(one_minus_b2) X(eps) X(eps_root) X(weight_decay)
JF_DEFINE_VECTOR_LAYOUT(AdamHyper, JAXFUSE_ADAM_HYPER_FIELDS);

// Per-step scalars in the compute type, resolved once per thread block (GPU) or call (CPU).
template <typename Real>
struct AdamStep {
  Real lr, b1, one_minus_b1, b2, one_minus_b2, eps, eps_root, weight_decay;
  Real bc1;       // 1 - b1^t
  Real bc1_next;  // 1 - b1^(t+1), for nesterov
  Real bc2;       // 1 - b2^t
  bool nesterov;
  bool complex;  // elements are (re, im) pairs sharing one second moment
};

// 1 - b^t as optax computes it, in JAX's default float type (float64 under jax_enable_x64, when
// the vector is float64, else float32), then rounded to the compute type.
template <typename Real>
JF_HD Real bias_correction(ScalarVector hyper, int field, int32_t t) {
  if (hyper.f64) return Real(1.0 - pow(hyper[field], double(t)));
  return Real(1.0f - powf(float(hyper[field]), float(t)));
}

// Resolve the per-step scalars. `count` is the state count *before* this step (optax increments
// first, then bias-corrects with the new count).
template <typename Real>
JF_HD AdamStep<Real> make_adam_step(ScalarVector hyper, int32_t count, bool nesterov,
                                    bool complex) {
  AdamStep<Real> s;
  s.lr = Real(hyper[AdamHyper::learning_rate]);
  s.b1 = Real(hyper[AdamHyper::b1]);
  s.one_minus_b1 = Real(hyper[AdamHyper::one_minus_b1]);
  s.b2 = Real(hyper[AdamHyper::b2]);
  s.one_minus_b2 = Real(hyper[AdamHyper::one_minus_b2]);
  s.eps = Real(hyper[AdamHyper::eps]);
  s.eps_root = Real(hyper[AdamHyper::eps_root]);
  s.weight_decay = Real(hyper[AdamHyper::weight_decay]);
  const int32_t t = safe_increment(count);
  s.bc1 = bias_correction<Real>(hyper, AdamHyper::b1, t);
  s.bc1_next = bias_correction<Real>(hyper, AdamHyper::b1, safe_increment(t));
  s.bc2 = bias_correction<Real>(hyper, AdamHyper::b2, t);
  s.nesterov = nesterov;
  s.complex = complex;
  return s;
}

// ---- element math (optax's scale_by_adam -> add_decayed_weights -> scale_by_learning_rate,
// with optax's operation order) ----------------------------------------------------------------

// The new second moment from the squared magnitude of the gradient.
template <typename Real>
JF_HD Real adam_second_moment(const AdamStep<Real>& s, Real g_squared, Real v) {
  return s.one_minus_b2 * g_squared + s.b2 * v;
}

// Updates the first moment m and returns the direction
// m_hat / (sqrt(v_hat + eps_root) + eps) + wd * p from the new second moment v (LAMB scales it
// by its trust ratio before the learning rate).
template <typename Real>
JF_HD Real adam_scaled_moment(const AdamStep<Real>& s, Real g, Real p, bool decay, Real& m,
                              Real v) {
  m = s.one_minus_b1 * g + s.b1 * m;
  Real m_hat;
  if (s.nesterov) {
    m_hat = s.b1 * (m / s.bc1_next) + s.one_minus_b1 * (g / s.bc1);
  } else {
    m_hat = m / s.bc1;
  }
  const Real v_hat = v / s.bc2;
  Real u = m_hat / (jf_sqrt(v_hat + s.eps_root) + s.eps);
  if (decay) u = u + s.weight_decay * p;
  return u;
}

// Updates the first moment m and returns the update
// u = -lr * (m_hat / (sqrt(v_hat + eps_root) + eps) + wd * p) from the new second moment v.
template <typename Real>
JF_HD Real adam_direction(const AdamStep<Real>& s, Real g, Real p, bool decay, Real& m, Real v) {
  return adam_scaled_moment(s, g, p, decay, m, v) * -s.lr;
}

// One real element: updates m and v in place, returns the update.
template <typename Real>
JF_HD Real adam_element(const AdamStep<Real>& s, Real g, Real p, bool decay, Real& m, Real& v) {
  v = adam_second_moment(s, g * g, v);
  return adam_direction(s, g, p, decay, m, v);
}

// One complex element, (re, im) at [0], [1] of each array, as optax does it: the first moment
// per part, the second from |g|^2 = re^2 + im^2, kept as the real part of a complex nu whose
// imaginary part is 0. Writes both parts' directions before the learning rate to d.
template <typename Real>
JF_HD void adam_complex_scaled_moment(const AdamStep<Real>& s, const Real* g, const Real* p,
                                      bool decay, Real* m, Real* v, Real* d) {
  v[0] = adam_second_moment(s, g[0] * g[0] + g[1] * g[1], v[0]);
  v[1] = Real(0);
  d[0] = adam_scaled_moment(s, g[0], p[0], decay, m[0], v[0]);
  d[1] = adam_scaled_moment(s, g[1], p[1], decay, m[1], v[0]);
}

// One complex element's update: the moments updated in place, u = -lr * direction per part.
template <typename Real>
JF_HD void adam_complex_element(const AdamStep<Real>& s, const Real* g, const Real* p,
                                bool decay, Real* m, Real* v, Real* u) {
  adam_complex_scaled_moment(s, g, p, decay, m, v, u);
  u[0] = u[0] * -s.lr;
  u[1] = u[1] * -s.lr;
}

// The element loop over a group of n scalars (n even for complex tensors): m and v updated in
// place, u the update. Each loop is branch-free inside and its arrays do not alias, so the
// CPU's vectorizes.
template <typename Real, typename Count>
JF_HD void adam_elements(const AdamStep<Real>& s, Count n, bool decay, const Real* __restrict__ g,
                         const Real* __restrict__ p, Real* __restrict__ m, Real* __restrict__ v,
                         Real* __restrict__ u) {
  if (s.complex) {
    for (Count i = 0; i < n; i += 2) adam_complex_element(s, g + i, p + i, decay, m + i, v + i, u + i);
  } else {
    for (Count i = 0; i < n; ++i) u[i] = adam_element(s, g[i], p[i], decay, m[i], v[i]);
  }
}

// The Adam family of the optimizer op (optimizer.h): states mu and nu; `decay` marks the tensors
// with weight decay.
struct Adam {
  static constexpr const char* kName = "jaxfuse_adam";
  using Hyper = AdamHyper;
  enum Flag : uint32_t { kNesterov = 1 };
  static constexpr const char* kFlagNames[] = {"nesterov"};
  static constexpr const char* kTensorFlagNames[] = {"decay"};
  static constexpr bool kComplex = true;
  static constexpr int kMaxStates = 2;
  static constexpr bool allows_states(int k) { return k == 2; }
  static constexpr int num_states(uint32_t) { return 2; }
  static const char* state_name(uint32_t, int k) { return k == 0 ? "mu" : "nu"; }

  template <typename Real>
  using Step = AdamStep<Real>;

  template <typename Real>
  static JF_HD Step<Real> make_step(ScalarVector hyper, int32_t count, uint32_t flags,
                                    bool complex) {
    return make_adam_step<Real>(hyper, count, (flags & kNesterov) != 0, complex);
  }

  template <typename Real, typename Count>
  static JF_HD void update(const Step<Real>& s, Count n, uint8_t tensor_flags,
                           const Real* __restrict__ g, const Real* __restrict__ p,
                           Real* __restrict__ mu, Real* __restrict__ nu, Real* __restrict__,
                           Real* __restrict__ u) {
    adam_elements(s, n, tensor_flags != 0, g, p, mu, nu, u);
  }
};

}  // namespace jaxfuse
