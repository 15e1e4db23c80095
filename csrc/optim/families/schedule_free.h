// Schedule-free AdamW and SGD (Defazio et al., 2024, https://arxiv.org/abs/2405.15682): the
// element math and the families of the optimizer op (optimizer.h), one per base, shared by the
// CPU handlers and the CUDA kernels. optax.contrib.schedule_free keeps z (the base optimizer's iterate) and the
// base optimizer's state; the params are y, the point the gradient is taken at, and x (the
// average, the point to evaluate) is recomputed from y and z. Per element, in optax's
// operation order (schedule_free_adamw's base: scale_by_rms with bias correction ->
// add_decayed_weights -> scale_by_learning_rate; schedule_free_sgd's: add_decayed_weights ->
// sgd):
//
//   nu = (1 - b2) g^2 + b2 nu;  d = (1 / (sqrt(nu / bc) + eps)) g   (AdamW; SGD: d = g)
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
  bool decay;   // the base adds weight decay
};

// From the base optimizer's direction d (before weight decay and the learning rate): z updated
// in place, returns the update u = y' - y.
template <typename Real>
JF_HD Real schedule_free_element(const ScheduleFreeStep<Real>& s, Real d, Real y, Real& z) {
  if (s.decay) d = d + s.weight_decay * y;
  d = d * -s.lr;
  const Real z_old = z;
  z = z_old + d;
  const Real x = (y - s.one_minus_b1 * z_old) / s.b1;
  const Real x_new = s.one_minus_ck * x + s.ck * z;
  return (s.b1 * x_new + s.one_minus_b1 * z) - y;
}

// The element loop over n scalars: z and, on AdamW's base, nu updated in place.
template <bool kAdam, typename Real, typename Count>
JF_HD void schedule_free_elements(const ScheduleFreeStep<Real>& s, Count n,
                                  const Real* __restrict__ g, const Real* __restrict__ p,
                                  Real* __restrict__ z, Real* __restrict__ nu,
                                  Real* __restrict__ u) {
  for (Count i = 0; i < n; ++i) {
    Real d = g[i];
    if constexpr (kAdam) {
      nu[i] = s.one_minus_b2 * (g[i] * g[i]) + s.b2 * nu[i];
      d = (Real(1) / (jf_sqrt(nu[i] / s.bc) + s.eps)) * d;
    }
    u[i] = schedule_free_element(s, d, p[i], z[i]);
  }
}

// The names of the families' call flags and per-tensor flags (outside the template: nvcc
// deduces no array bound from a class template's static member). No per-tensor flags; C++ has
// no empty arrays, so one name that is never set.
inline constexpr const char* kScheduleFreeFlagNames[] = {"decay"};
inline constexpr const char* kScheduleFreeTensorFlagNames[] = {"unused"};

// The schedule-free families, one op per base (each kernel holds its base's math alone, in
// registers): state lists z, then on AdamW's base nu.
template <bool kAdam>
struct ScheduleFree {
  static constexpr const char* kName =
      kAdam ? "jaxfuse_schedule_free_adamw" : "jaxfuse_schedule_free_sgd";
  using Hyper = ScheduleFreeHyper;
  enum Flag : uint32_t { kDecay = 1 };
  static constexpr const auto& kFlagNames = kScheduleFreeFlagNames;
  static constexpr const auto& kTensorFlagNames = kScheduleFreeTensorFlagNames;
  static constexpr bool kComplex = false;
  static constexpr bool kQuantizedStates = false;  // z is the params' other copy
  static constexpr int kStates = kAdam ? 2 : 1;
  static constexpr int kMaxStates = kStates;
  static constexpr bool allows_states(int k) { return k == kStates; }
  static constexpr int num_states(uint32_t) { return kStates; }
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
    s.decay = (flags & kDecay) != 0;
    s.bc = kAdam ? bias_correction<Real>(hyper, ScheduleFreeHyper::b2, safe_increment(count))
                 : Real(1);
    return s;
  }

  template <typename Real, typename Count>
  static JF_HD void update(const Step<Real>& s, Count n, uint8_t, const Real* __restrict__ g,
                           const Real* __restrict__ p, Real* __restrict__ z,
                           Real* __restrict__ nu, Real* __restrict__, Real* __restrict__ u) {
    schedule_free_elements<kAdam>(s, n, g, p, z, nu, u);
  }
};

// Named types, so that the kernels' names (and the kernel report's budgets) read as the others'.
struct ScheduleFreeAdamw : ScheduleFree<true> {};
struct ScheduleFreeSgd : ScheduleFree<false> {};

}  // namespace jaxfuse
