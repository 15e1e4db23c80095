// The init of _jaxfuse_cuda_on_cpu, the CUDA handlers compiled for the host: the production
// module's exports (csrc/core/module.h) plus enqueued_work(), the kernels and memsets the emulated
// runtime has enqueued so far (tests/test_cuda_on_cpu.py checks each op's CallCost with it).
#include <cuda_runtime.h>

#include "core/module.h"

namespace nb = nanobind;

NB_MODULE(_jaxfuse_cuda_on_cpu, m) {
  jaxfuse::define_module(m);
  m.def("enqueued_work", []() {
    const cuemu::EnqueuedWork work = cuemu::enqueued_work();
    nb::dict d;
    d["kernels"] = work.kernels;
    d["memsets"] = work.memsets;
    return d;
  });
}
