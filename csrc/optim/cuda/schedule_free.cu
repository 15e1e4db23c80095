// jaxfuse_schedule_free, CUDA: the optimizer driver (optimizer.cuh) with the schedule-free
// element math.
#include "optim/families/schedule_free.h"
#include "optim/cuda/optimizer.cuh"

namespace jaxfuse {

JAXFUSE_CUDA_OPTIMIZER(ScheduleFree);

}  // namespace jaxfuse
