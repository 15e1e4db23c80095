// jaxfuse_lamb and its first pass jaxfuse_lamb_trust_sums, CUDA: the optimizer driver
// (optimizer.cuh) and the trust-sums driver (trust_sums.cuh) with Lamb's element math.
#include "optim/families/lamb.h"
#include "optim/cuda/optimizer.cuh"
#include "optim/cuda/trust_sums.cuh"

namespace jaxfuse {

JAXFUSE_CUDA_OPTIMIZER(Lamb);
JAXFUSE_CUDA_TRUST_SUMS(Lamb);

}  // namespace jaxfuse
