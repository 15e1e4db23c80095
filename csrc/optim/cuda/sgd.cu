// jaxfuse_sgd, CUDA: the optimizer driver (optimizer.cuh) with SGD's element math.
#include "optim/families/sgd.h"
#include "optim/cuda/optimizer.cuh"

namespace jaxfuse {

JAXFUSE_CUDA_OPTIMIZER(Sgd);

}  // namespace jaxfuse
