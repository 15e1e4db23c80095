// jaxfuse_schedule_free, CPU: the optimizer driver (optimizer.h) with the schedule-free element
// loop, its flags (AdamW or SGD base, weight decay) hoisted out so that each variant vectorizes.
#include "optim/cpu/optimizer.h"

#include "optim/families/schedule_free.h"

namespace jaxfuse {
namespace {

template <bool kAdam, bool kDecay, typename Real>
__attribute__((always_inline)) inline void schedule_free_loop(ScheduleFreeStep<Real> step,
                                                              int64_t n, const Real* g,
                                                              const Real* p, Real* z, Real* nu,
                                                              Real* u) {
  step.adam = kAdam;  // constant in this instantiation: the loops have no branches
  step.decay = kDecay;
  schedule_free_elements(step, n, g, p, z, nu, u);
}

template <typename Real>
__attribute__((always_inline)) inline void schedule_free_cpu_elements(
    const ScheduleFreeStep<Real>& step, int64_t n, uint8_t, const Real* g, const Real* p,
    Real* z, Real* nu, Real*, Real* u) {
  if (step.adam) {
    step.decay ? schedule_free_loop<true, true>(step, n, g, p, z, nu, u)
               : schedule_free_loop<true, false>(step, n, g, p, z, nu, u);
  } else {
    step.decay ? schedule_free_loop<false, true>(step, n, g, p, z, nu, u)
               : schedule_free_loop<false, false>(step, n, g, p, z, nu, u);
  }
}

}  // namespace

JAXFUSE_CPU_OPTIMIZER(ScheduleFree, schedule_free_cpu_elements);

}  // namespace jaxfuse
