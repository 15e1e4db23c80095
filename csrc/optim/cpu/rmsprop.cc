// jaxfuse_rmsprop, CPU: the optimizer driver (optimizer.h) with RMSprop's element loop, its
// configuration (centered, momentum, nesterov, eps in the square root) hoisted out so that
// each variant's loop vectorizes with no branches.
#include "optim/cpu/optimizer.h"

#include "optim/families/rmsprop.h"

namespace jaxfuse {
namespace {

template <bool kCentered, bool kMomentum, bool kNesterov, bool kEpsInSqrt, typename Real>
__attribute__((always_inline)) inline void rmsprop_loop(RmspropStep<Real> step, int64_t n,
                                                        const Real* g, Real* s0, Real* s1,
                                                        Real* s2, Real* u) {
  // Constant in this instantiation: the loop has no branches.
  step.centered = kCentered;
  step.has_momentum = kMomentum;
  step.nesterov = kNesterov;
  step.eps_in_sqrt = kEpsInSqrt;
  kCentered ? rmsprop_elements(step, n, g, s0, s1, s2, u)
            : rmsprop_elements(step, n, g, static_cast<Real*>(nullptr), s0, s1, u);
}

template <bool kCentered, bool kEpsInSqrt, typename Real>
__attribute__((always_inline)) inline void rmsprop_momentum(const RmspropStep<Real>& step,
                                                            int64_t n, const Real* g, Real* s0,
                                                            Real* s1, Real* s2, Real* u) {
  if (!step.has_momentum) {
    rmsprop_loop<kCentered, false, false, kEpsInSqrt>(step, n, g, s0, s1, s2, u);
  } else if (step.nesterov) {
    rmsprop_loop<kCentered, true, true, kEpsInSqrt>(step, n, g, s0, s1, s2, u);
  } else {
    rmsprop_loop<kCentered, true, false, kEpsInSqrt>(step, n, g, s0, s1, s2, u);
  }
}

template <typename Real>
__attribute__((always_inline)) inline void rmsprop_cpu_elements(const RmspropStep<Real>& step,
                                                                int64_t n, uint8_t,
                                                                const Real* g, const Real*,
                                                                Real* s0, Real* s1, Real* s2,
                                                                Real* u) {
  if (step.centered) {
    step.eps_in_sqrt ? rmsprop_momentum<true, true>(step, n, g, s0, s1, s2, u)
                     : rmsprop_momentum<true, false>(step, n, g, s0, s1, s2, u);
  } else {
    step.eps_in_sqrt ? rmsprop_momentum<false, true>(step, n, g, s0, s1, s2, u)
                     : rmsprop_momentum<false, false>(step, n, g, s0, s1, s2, u);
  }
}

}  // namespace

JAXFUSE_CPU_OPTIMIZER(Rmsprop, rmsprop_cpu_elements);

}  // namespace jaxfuse
