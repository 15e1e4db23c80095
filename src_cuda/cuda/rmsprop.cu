// jaxfuse_rmsprop, CUDA: the optimizer driver (optimizer.cuh) with RMSprop's element math.
#include "jaxfuse/rmsprop_math.h"
#include "optimizer.cuh"

namespace jaxfuse {

JAXFUSE_CUDA_OPTIMIZER(Rmsprop);

}  // namespace jaxfuse
