// jaxfuse_lamb and its first pass jaxfuse_lamb_trust_sums, CPU: the optimizer driver
// (optimizer.h) and the trust-sums driver (trust_sums.h) with Lamb's element loops (gcc unswitches
// their per-tensor flags, so that each variant vectorizes).
#include "optim/cpu/optimizer.h"
#include "optim/cpu/trust_sums.h"

#include "optim/families/lamb.h"

namespace jaxfuse {

JAXFUSE_CPU_OPTIMIZER(Lamb, Lamb::update);
JAXFUSE_CPU_TRUST_SUMS(Lamb, Lamb::direction);

}  // namespace jaxfuse
