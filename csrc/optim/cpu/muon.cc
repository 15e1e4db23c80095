// jaxfuse_muon, CPU: the optimizer driver (optimizer.h) with Muon's element pass, the weight
// decay flag hoisted out so that each of the two variants vectorizes.
#include "optim/cpu/optimizer.h"

#include "optim/families/muon.h"

namespace jaxfuse {
namespace {

template <typename Real>
__attribute__((always_inline)) inline void muon_cpu_elements(const MuonStep<Real>& step,
                                                             int64_t n, uint8_t decay,
                                                             const Real* o, const Real* p, Real*,
                                                             Real*, Real*, Real* u) {
  decay ? muon_elements(step, n, true, o, p, u) : muon_elements(step, n, false, o, p, u);
}

}  // namespace

JAXFUSE_CPU_OPTIMIZER(Muon, muon_cpu_elements);

}  // namespace jaxfuse
