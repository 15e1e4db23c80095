// jaxfuse_sgd, CPU: the optimizer driver (optimizer.h) with SGD's element loop, its flags
// (momentum, nesterov) hoisted out so that each of the three variants vectorizes.
#include "optim/cpu/optimizer.h"

#include "optim/families/sgd.h"

namespace jaxfuse {
namespace {

template <bool kTrace, bool kNesterov, typename Real>
__attribute__((always_inline)) inline void sgd_loop(SgdStep<Real> step, int64_t n,
                                                    const Real* __restrict__ g,
                                                    Real* __restrict__ t, Real* __restrict__ u) {
  step.trace = kTrace;  // constant in this instantiation: the loops have no branches
  step.nesterov = kNesterov;
  sgd_elements(step, n, g, t, u);
}

template <typename Real>
__attribute__((always_inline)) inline void sgd_cpu_elements(const SgdStep<Real>& step, int64_t n,
                                                            uint8_t, const Real* g, const Real*,
                                                            Real* t, Real*, Real*, Real* u) {
  if (!step.trace) {
    sgd_loop<false, false>(step, n, g, t, u);
  } else if (step.nesterov) {
    sgd_loop<true, true>(step, n, g, t, u);
  } else {
    sgd_loop<true, false>(step, n, g, t, u);
  }
}

}  // namespace

JAXFUSE_CPU_OPTIMIZER(Sgd, sgd_cpu_elements);

}  // namespace jaxfuse
