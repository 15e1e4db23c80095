// Schedule-free AdamW and SGD (Defazio et al., 2024, https://arxiv.org/abs/2405.15682): the
// element math and the family of the optimizer op (optimizer.h), shared by the CPU handler and
// the CUDA kernel. optax.contrib.schedule_free keeps z (the base optimizer's iterate) and the
// base optimizer's state; the params are y, the point the gradient is taken at, and x (the
// average, the point to evaluate) is recomputed from y and z. Per element, in optax's
// operation order (schedule_free_adamw's base: scale_by_rms with bias correction ->
// add_decayed_weights -> scale_by_learning_rate; schedule_free_sgd's: add_decayed_weights ->
// sgd):
//
//   nu = (1 - b2) g^2 + b2 nu;  d = g / (sqrt(nu / bc) + eps)     (AdamW; SGD: d = g)
//   d = (d + wd y) * -lr;  z' = z + d
//   x = (y - (1 - b1) z) / b1;  x' = (1 - ck) x + ck z';  y' = b1 x' + (1 - b1) z'
//   u = y' - y
//
// ck, the averaging weight, is computed in JAX from the state's weight sum and largest
// learning rate (they are scalars of the state, advanced there). `Real` is the compute type:
// float, or double for float64 calls.
#pragma once

#include <cstdint>

#include "optim/families/adam.h"  // bias_correction(): optax's 1 - decay^t
#include "optim/optimizer.h"

namespace jaxfuse {

// The hyperparameter vector, built in JAX: learning_rate is the base optimizer's at its count,
// ck and the (1 - b) terms computed as optax computes them, so that rounding matches.
#define JAXFUSE_SCHEDULE_FREE_HYPER_FIELDS(X)                                                 \
  X(learning_rate) X(b1) X(one_minus_b1) X(b2) X(one_minus_b2) X(eps) X(weight_decay) X(ck) \
  X(one_minus_ck)
JF_DEFINE_VECTOR_LAYOUT(ScheduleFreeHyper, JAXFUSE_SCHEDULE_FREE_HYPER_FIELDS);

template <typename Real>
struct ScheduleFreeStep {
  Real lr, b1, one_minus_b1, b2, one_minus_b2, eps, weight_decay, ck, one_minus_ck;
  Real bc;      // 1 - b2^t (AdamW's second moment, bias-corrected)
  bool adam;    // the base is AdamW (a second moment nu), else SGD
  bool decay;   // the base adds weight decay
};

// The base optimizer's step d (the second moment updated in place), then z, x and y: returns
// the update u = y' - y and stores z'.
template <typename Real>
JF_HD Real schedule_free_element(const ScheduleFreeStep<Real>& s, Real g, Real y, Real& z,
                                 Real* __restrict__ nu) {
  Real d = g;
  if (s.adam) {
    *nu = s.one_minus_b2 * (g * g) + s.b2 * *nu;
    d = (Real(1) / (jf_sqrt(*nu / s.bc) + s.eps)) * g;
  }
  if (s.decay) d = d + s.weight_decay * y;
  d = d * -s.lr;
  const Real z_old = z;
  z = z_old + d;
  const Real x = (y - s.one_minus_b1 * z_old) / s.b1;
  const Real x_new = s.one_minus_ck * x + s.ck * z;
  return (s.b1 * x_new + s.one_minus_b1 * z) - y;
}

// The element loop over n scalars: z (s0) and, for AdamW, nu (s1) updated in place.
template <typename Real, typename Count>
JF_HD void schedule_free_elements(const ScheduleFreeStep<Real>& s, Count n,
                                  const Real* __restrict__ g, const Real* __restrict__ p,
                                  Real* __restrict__ z, Real* __restrict__ nu,
                                  Real* __restrict__ u) {
  for (Count i = 0; i < n; ++i) {
    u[i] = schedule_free_element(s, g[i], p[i], z[i], s.adam ? nu + i : nullptr);
  }
}

// The schedule-free family: state lists z, then nu with the AdamW base.
struct ScheduleFree {
  static constexpr const char* kName = "jaxfuse_schedule_free";
  using Hyper = ScheduleFreeHyper;
  enum Flag : uint32_t { kAdam = 1, kDecay = 2 };
  static constexpr const char* kFlagNames[] = {"adam", "decay"};
  // No per-tensor flags; C++ has no empty arrays, so one name that is never set.
  static constexpr const char* kTensorFlagNames[] = {"unused"};
  static constexpr bool kComplex = false;
  static constexpr int kMaxStates = 2;
  static constexpr bool allows_states(int k) { return k == 1 || k == 2; }
  static constexpr int num_states(uint32_t flags) { return (flags & kAdam) ? 2 : 1; }
  static const char* state_name(uint32_t, int k) { return k == 0 ? "z" : "nu"; }

  template <typename Real>
  using Step = ScheduleFreeStep<Real>;

  template <typename Real>
  static JF_HD Step<Real> make_step(ScalarVector hyper, int32_t count, uint32_t flags, bool) {
    Step<Real> s;
    s.lr = Real(hyper[ScheduleFreeHyper::learning_rate]);
    s.b1 = Real(hyper[ScheduleFreeHyper::b1]);
    s.one_minus_b1 = Real(hyper[ScheduleFreeHyper::one_minus_b1]);
    s.b2 = Real(hyper[ScheduleFreeHyper::b2]);
    s.one_minus_b2 = Real(hyper[ScheduleFreeHyper::one_minus_b2]);
    s.eps = Real(hyper[ScheduleFreeHyper::eps]);
    s.weight_decay = Real(hyper[ScheduleFreeHyper::weight_decay]);
    s.ck = Real(hyper[ScheduleFreeHyper::ck]);
    s.one_minus_ck = Real(hyper[ScheduleFreeHyper::one_minus_ck]);
    s.adam = (flags & kAdam) != 0;
    s.decay = (flags & kDecay) != 0;
    s.bc = s.adam ? bias_correction<Real>(hyper, ScheduleFreeHyper::b2, safe_increment(count))
                  : Real(1);
    return s;
  }

  template <typename Real, typename Count>
  static JF_HD void update(const Step<Real>& s, Count n, uint8_t, const Real* __restrict__ g,
                           const Real* __restrict__ p, Real* __restrict__ z,
                           Real* __restrict__ nu, Real* __restrict__, Real* __restrict__ u) {
    schedule_free_elements(s, n, g, p, z, nu, u);
  }
};

}  // namespace jaxfuse
