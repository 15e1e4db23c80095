// jaxfuse_adagrad, CPU: the optimizer driver (optimizer.h) with Adagrad's element loop (no flags
// to hoist: one variant).
#include "optim/cpu/optimizer.h"

#include "optim/families/adagrad.h"

namespace jaxfuse {
namespace {

template <typename Real>
__attribute__((always_inline)) inline void adagrad_cpu_elements(const AdagradStep<Real>& step,
                                                                int64_t n, uint8_t, const Real* g,
                                                                const Real*, Real* s, Real*,
                                                                Real*, Real* u) {
  adagrad_elements(step, n, g, s, u);
}

}  // namespace

JAXFUSE_CPU_OPTIMIZER(Adagrad, adagrad_cpu_elements);

}  // namespace jaxfuse
