// jaxfuse_adagrad, CUDA: the optimizer driver (optimizer.cuh) with Adagrad's element math.
#include "jaxfuse/adagrad_math.h"
#include "optimizer.cuh"

namespace jaxfuse {

JAXFUSE_CUDA_OPTIMIZER(Adagrad);

}  // namespace jaxfuse
