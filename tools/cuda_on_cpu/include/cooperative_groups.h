// CUDA on the CPU: the cooperative-groups calls jaxfuse uses (see cuda_runtime.h here).
#pragma once

#include <cuda_runtime.h>

namespace cooperative_groups {

struct grid_group {
  void sync(const char* file = __builtin_FILE(), int line = __builtin_LINE()) const {
    cuemu::sync_grid(file, line);
  }
};
inline grid_group this_grid() { return {}; }

struct thread_block {
  void sync(const char* file = __builtin_FILE(), int line = __builtin_LINE()) const {
    cuemu::sync_block(file, line);
  }
};
inline thread_block this_thread_block() { return {}; }

}  // namespace cooperative_groups
