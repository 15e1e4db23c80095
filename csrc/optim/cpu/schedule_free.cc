// jaxfuse_schedule_free_adamw and jaxfuse_schedule_free_sgd, CPU: the optimizer driver
// (optimizer.h) with the schedule-free element loop, its weight-decay flag hoisted out so that
// each variant vectorizes.
#include "optim/cpu/optimizer.h"

#include "optim/families/schedule_free.h"

namespace jaxfuse {
namespace {

template <bool kAdam, bool kDecay, typename Real>
__attribute__((always_inline)) inline void schedule_free_loop(ScheduleFreeStep<Real> step,
                                                              int64_t n, const Real* g,
                                                              const Real* p, Real* z, Real* nu,
                                                              Real* u) {
  step.decay = kDecay;  // constant in this instantiation: the loop has no branches
  schedule_free_elements<kAdam>(step, n, g, p, z, nu, u);
}

template <bool kAdam, typename Real>
__attribute__((always_inline)) inline void schedule_free_cpu_elements(
    const ScheduleFreeStep<Real>& step, int64_t n, const Real* g, const Real* p, Real* z,
    Real* nu, Real* u) {
  step.decay ? schedule_free_loop<kAdam, true>(step, n, g, p, z, nu, u)
             : schedule_free_loop<kAdam, false>(step, n, g, p, z, nu, u);
}

template <typename Real>
__attribute__((always_inline)) inline void schedule_free_adamw_elements(const ScheduleFreeStep<Real>& step,
                                                          int64_t n, uint8_t, const Real* g,
                                                          const Real* p, Real* z, Real* nu,
                                                          Real*, Real* u) {
  schedule_free_cpu_elements<true>(step, n, g, p, z, nu, u);
}

template <typename Real>
__attribute__((always_inline)) inline void schedule_free_sgd_elements(const ScheduleFreeStep<Real>& step,
                                                        int64_t n, uint8_t, const Real* g,
                                                        const Real* p, Real* z, Real*, Real*,
                                                        Real* u) {
  schedule_free_cpu_elements<false>(step, n, g, p, z, static_cast<Real*>(nullptr), u);
}

}  // namespace

JAXFUSE_CPU_OPTIMIZER(ScheduleFreeAdamw, schedule_free_adamw_elements);
JAXFUSE_CPU_OPTIMIZER(ScheduleFreeSgd, schedule_free_sgd_elements);

}  // namespace jaxfuse
