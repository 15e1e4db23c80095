// jaxfuse_schedule_free_adamw and jaxfuse_schedule_free_sgd, CUDA: the optimizer driver
// (optimizer.cuh) with the schedule-free element math.
#include "optim/families/schedule_free.h"
#include "optim/cuda/optimizer.cuh"

namespace jaxfuse {

JAXFUSE_CUDA_OPTIMIZER(ScheduleFreeAdamw);
JAXFUSE_CUDA_OPTIMIZER(ScheduleFreeSgd);

}  // namespace jaxfuse
