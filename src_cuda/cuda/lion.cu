// jaxfuse_lion, CUDA: the optimizer driver (optimizer.cuh) with Lion's element math.
#include "jaxfuse/lion_math.h"
#include "optimizer.cuh"

namespace jaxfuse {

JAXFUSE_CUDA_OPTIMIZER(Lion);

}  // namespace jaxfuse
