// jaxfuse_adam, CUDA: the optimizer driver (optimizer.cuh) with Adam's element math.
#include "jaxfuse/adam_math.h"
#include "optimizer.cuh"

namespace jaxfuse {

JAXFUSE_CUDA_OPTIMIZER(Adam);

}  // namespace jaxfuse
