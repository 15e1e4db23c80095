// jaxfuse_lion, CUDA: the optimizer driver (optimizer.cuh) with Lion's element math.
#include "optim/families/lion.h"
#include "optim/cuda/optimizer.cuh"

namespace jaxfuse {

JAXFUSE_CUDA_OPTIMIZER(Lion);

}  // namespace jaxfuse
