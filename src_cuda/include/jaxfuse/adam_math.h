// Adam / AdamW element math and the per-group program of the Adam kernel, one definition
// compiled for the host (CPU handler) and the device (CUDA kernel), as PyTorch shares its
// adam_math between its drivers. `Real` is the compute type: float, or double for calls with
// float64 storage.
#pragma once

#include <cmath>
#include <cstdint>

#include "jaxfuse/norm_math.h"

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
  GradScaling<Real> grad;
  bool nesterov;
  bool complex;  // elements are (re, im) pairs sharing one second moment
};

// optax.safe_increment on an int32 count: saturates at INT32_MAX.
JF_HD int32_t safe_increment(int32_t count) { return count < INT32_MAX ? count + 1 : count; }

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
JF_HD AdamStep<Real> make_adam_step(ScalarVector hyper, ScalarVector grad_ctrl, int32_t count,
                                    bool nesterov, bool complex) {
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
  s.grad = make_grad_scaling<Real>(grad_ctrl);
  s.nesterov = nesterov;
  s.complex = complex;
  return s;
}

// The count written back: advanced unless the step is skipped.
JF_HD int32_t adam_next_count(int32_t count, bool skip) {
  return skip ? count : safe_increment(count);
}

// ---- element math (optax's scale_by_adam -> add_decayed_weights -> scale_by_learning_rate,
// with optax's operation order) ----------------------------------------------------------------

// The new second moment from the squared magnitude of the gradient.
template <typename Real>
JF_HD Real adam_second_moment(const AdamStep<Real>& s, Real g_squared, Real v) {
  return s.one_minus_b2 * g_squared + s.b2 * v;
}

// Updates the first moment m and returns the update
// u = -lr * (m_hat / (sqrt(v_hat + eps_root) + eps) + wd * p) from the new second moment v.
template <typename Real>
JF_HD Real adam_direction(const AdamStep<Real>& s, Real g, Real p, bool decay, Real& m, Real v) {
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
  return u * -s.lr;
}

// One real element: updates m and v in place, returns the update.
template <typename Real>
JF_HD Real adam_element(const AdamStep<Real>& s, Real g, Real p, bool decay, Real& m, Real& v) {
  v = adam_second_moment(s, g * g, v);
  return adam_direction(s, g, p, decay, m, v);
}

// One complex element, (re, im) at [0], [1] of each array, as optax does it: the first moment
// per part, the second from |g|^2 = re^2 + im^2, kept as the real part of a complex nu whose
// imaginary part is 0.
template <typename Real>
JF_HD void adam_complex_element(const AdamStep<Real>& s, const Real* g, const Real* p,
                                bool decay, Real* m, Real* v, Real* u) {
  v[0] = adam_second_moment(s, g[0] * g[0] + g[1] * g[1], v[0]);
  v[1] = Real(0);
  u[0] = adam_direction(s, g[0], p[0], decay, m[0], v[0]);
  u[1] = adam_direction(s, g[1], p[1], decay, m[1], v[0]);
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

// ---- the per-group program ------------------------------------------------------------------

// The tensor lists of an Adam call in kernel order. The optional lists (params, absent only in
// the optax protocol called without params; updates, in the optax protocol; master params, with
// master_weights) take the next free slots when present.
enum AdamList : int { kGrads = 0, kMu = 1, kNu = 2, kAdamFixedLists = 3 };

// Where the optional lists are in one call (-1: absent).
struct AdamLists {
  int params = -1;
  int updates = -1;
  int master = -1;

  // constexpr: the CUDA kernels take a layout as compile-time constants (adam.cu).
  static constexpr AdamLists of(bool write_updates, bool master, bool params) {
    AdamLists l;
    int next = kAdamFixedLists;
    l.params = params ? next++ : -1;
    l.updates = write_updates ? next++ : -1;
    l.master = master ? next++ : -1;
    return l;
  }
  constexpr int count() const {
    return kAdamFixedLists + int(params >= 0) + int(updates >= 0) + int(master >= 0);
  }
  // The param value the math reads: the master copy when present (-1: no params).
  constexpr int param_source() const { return master >= 0 ? master : params; }
};

// The end of adam_group() when params are present: the new (master) params p + u, stored in
// place, or the update stored (`scratch` is free for reuse).
template <typename Group, typename Lists, typename Values>
JF_HD void adam_store_params(const Lists& lists, const Group& group, Values& p, Values& u,
                             Values& scratch) {
  const auto n = group.size();
  for (decltype(+n) i = 0; i < n; ++i) p[i] = p[i] + u[i];
  if (lists.master >= 0) group.store(lists.master, p);
  if (lists.updates < 0) {
    group.store(lists.params, p);
    return;
  }
  if (lists.master >= 0) {
    // The update that moves the low-precision params exactly onto the rounding of the new master
    // value: both are values of the params' dtype, so the difference is exact when they are
    // within a factor 2 of each other (Sterbenz), and optax.apply_updates lands on it.
    group.load(lists.params, scratch);
    group.round(lists.params, p);
    for (decltype(+n) i = 0; i < n; ++i) u[i] = p[i] - scratch[i];
  }
  group.store(lists.updates, u);
}

// One group of elements through an Adam step. `Group` is the platform's group (the GPU: 4
// scalars of one thread, in registers; the CPU: a tile of a chunk, in scratch); it provides
// `Values` (an array of Real), size(), load(list, x), store(list, x), round(list, x) (x as list's
// dtype holds it) and update(step, g, p, m, v, u), the element loop adam_elements(). `Lists` is
// an AdamLists or a type with the same members as compile-time constants. The skipped
// (non-finite) step leaves the state as it is and reports a zero update.
template <typename Real, typename Group, typename Lists>
JF_HD void adam_group(const AdamStep<Real>& step, const Lists& lists, const Group& group) {
  typename Group::Values g, p, m, v, u;
  const auto n = group.size();
  if (step.grad.skip) {
    if (lists.updates >= 0) {
      for (decltype(+n) i = 0; i < n; ++i) u[i] = Real(0);
      group.store(lists.updates, u);
    }
    return;
  }
  group.load(kGrads, g);
  scale_group(step.grad, n, g);
  if (lists.param_source() >= 0) group.load(lists.param_source(), p);
  group.load(kMu, m);
  group.load(kNu, v);
  // Without params nothing reads them (no weight decay): g stands in.
  group.update(step, g, lists.param_source() >= 0 ? p : g, m, v, u);
  group.store(kMu, m);
  group.store(kNu, v);
  if (lists.params >= 0) {
    adam_store_params(lists, group, p, u, g);
  } else {  // the optax protocol without params: the update is all there is
    group.store(lists.updates, u);
  }
}

}  // namespace jaxfuse
