// jaxfuse_lion, CPU: the optimizer driver (optimizer.h) with Lion's element loop, the weight
// decay flag hoisted out so that each of the two variants vectorizes.
#include "optim/cpu/optimizer.h"

#include "optim/families/lion.h"

namespace jaxfuse {
namespace {

template <typename Real>
__attribute__((always_inline)) inline void lion_cpu_elements(const LionStep<Real>& step,
                                                             int64_t n, uint8_t decay,
                                                             const Real* g, const Real* p,
                                                             Real* m, Real*, Real*, Real* u) {
  decay ? lion_elements(step, n, true, g, p, m, u) : lion_elements(step, n, false, g, p, m, u);
}

}  // namespace

JAXFUSE_CPU_OPTIMIZER(Lion, lion_cpu_elements);

}  // namespace jaxfuse
