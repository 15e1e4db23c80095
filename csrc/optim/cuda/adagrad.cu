// jaxfuse_adagrad, CUDA: the optimizer driver (optimizer.cuh) with Adagrad's element math.
#include "optim/families/adagrad.h"
#include "optim/cuda/optimizer.cuh"

namespace jaxfuse {

JAXFUSE_CUDA_OPTIMIZER(Adagrad);

}  // namespace jaxfuse
