// jaxfuse_adam, CPU: the optimizer driver (optimizer.h) with Adam's element loop, its flags
// (nesterov, weight decay) hoisted out so that each of the four variants vectorizes.
#include "optim/cpu/optimizer.h"

#include "optim/families/adam.h"

namespace jaxfuse {
namespace {

template <bool kNesterov, bool kDecay, typename Real>
__attribute__((always_inline)) inline void adam_loop(AdamStep<Real> step, int64_t n,
                                                     const Real* __restrict__ g,
                                                     const Real* __restrict__ p,
                                                     Real* __restrict__ m, Real* __restrict__ v,
                                                     Real* __restrict__ u) {
  step.nesterov = kNesterov;  // constant in this instantiation: the loops have no branches
  adam_elements(step, n, kDecay, g, p, m, v, u);
}

template <typename Real>
__attribute__((always_inline)) inline void adam_cpu_elements(const AdamStep<Real>& step,
                                                             int64_t n, uint8_t decay,
                                                             const Real* g, const Real* p,
                                                             Real* m, Real* v, Real*, Real* u) {
  if (step.nesterov) {
    decay ? adam_loop<true, true>(step, n, g, p, m, v, u)
          : adam_loop<true, false>(step, n, g, p, m, v, u);
  } else {
    decay ? adam_loop<false, true>(step, n, g, p, m, v, u)
          : adam_loop<false, false>(step, n, g, p, m, v, u);
  }
}

}  // namespace

JAXFUSE_CPU_OPTIMIZER(Adam, adam_cpu_elements);

}  // namespace jaxfuse
