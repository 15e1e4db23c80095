// jaxfuse_rmsprop, CUDA: the optimizer driver (optimizer.cuh) with RMSprop's element math.
#include "optim/families/rmsprop.h"
#include "optim/cuda/optimizer.cuh"

namespace jaxfuse {

JAXFUSE_CUDA_OPTIMIZER(Rmsprop);

}  // namespace jaxfuse
