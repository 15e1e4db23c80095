// jaxfuse_lars and its first pass jaxfuse_lars_trust_sums, CPU: the optimizer driver
// (optimizer.h) and the trust-sums driver (trust_sums.h) with Lars's element loops (gcc unswitches
// their per-tensor flags, so that each variant vectorizes).
#include "optim/cpu/optimizer.h"
#include "optim/cpu/trust_sums.h"

#include "optim/families/lars.h"

namespace jaxfuse {

JAXFUSE_CPU_OPTIMIZER(Lars, Lars::update);
JAXFUSE_CPU_TRUST_SUMS(Lars, Lars::direction);

}  // namespace jaxfuse
