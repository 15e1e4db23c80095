// jaxfuse_lars and its first pass jaxfuse_lars_trust_sums, CUDA: the optimizer driver
// (optimizer.cuh) and the trust-sums driver (trust_sums.cuh) with Lars's element math.
#include "optim/families/lars.h"
#include "optim/cuda/optimizer.cuh"
#include "optim/cuda/trust_sums.cuh"

namespace jaxfuse {

JAXFUSE_CUDA_OPTIMIZER(Lars);
JAXFUSE_CUDA_TRUST_SUMS(Lars);

}  // namespace jaxfuse
