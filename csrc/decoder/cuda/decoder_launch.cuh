// What both of the CUDA decoder's schedules launch (included by the schedules' files only): the
// kernel instance of the call's dtypes, its grid and weight ring, and its parameters but for
// the slots each launch runs (LaunchSlots, set by the schedule).
#pragma once

#include "decoder/cuda/decoder_kernel.cuh"

namespace jaxfuse::cuda_decoder {

struct DecoderLaunch {
  void (*kernel)(DecoderParams);
  int blocks;         // the grid: the blocks that fit the device at once
  size_t ring_bytes;  // the weight ring's dynamic shared memory
  cudaStream_t stream;
  DecoderParams params;
};

}  // namespace jaxfuse::cuda_decoder
