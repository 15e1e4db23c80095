// jaxfuse_muon, CUDA: the optimizer driver (optimizer.cuh) with Muon's element pass.
#include "optim/families/muon.h"
#include "optim/cuda/optimizer.cuh"

namespace jaxfuse {

JAXFUSE_CUDA_OPTIMIZER(Muon);

}  // namespace jaxfuse
