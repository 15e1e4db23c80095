// jaxfuse_sgd, CUDA: the optimizer driver (optimizer.cuh) with SGD's element math.
#include "jaxfuse/sgd_math.h"
#include "optimizer.cuh"

namespace jaxfuse {

JAXFUSE_CUDA_OPTIMIZER(Sgd);

}  // namespace jaxfuse
