// jaxfuse_adam, CUDA: the optimizer driver (optimizer.cuh) with Adam's element math.
#include "optim/families/adam.h"
#include "optim/cuda/optimizer.cuh"

namespace jaxfuse {

JAXFUSE_CUDA_OPTIMIZER(Adam);

}  // namespace jaxfuse
