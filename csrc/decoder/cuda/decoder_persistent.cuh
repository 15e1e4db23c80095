// The CUDA decoder's persistent schedule (included by cuda/decoder.cu only): every stage of the
// call in ONE cooperative launch of decoder_kernel (decoder_kernel.cuh), its grid the blocks
// that fit the device at once, its blocks going from one stage to the next and waiting on the
// work groups' counters for the inputs they need, with no grid sync between stages.
//
// What it costs: one launch per call, and between stages the chain of a group's last split
// finishing, its release and the polls of the blocks that wait for it (the stage timeline
// measures it: jaxfuse/_decode/timeline.py).
#pragma once

#include "decoder/cuda/decoder_launch.cuh"

namespace jaxfuse::cuda_decoder {

inline ffi::Error launch_persistent(const DecoderLaunch& launch) {
  DecoderParams params = launch.params;
  params.run = LaunchSlots{0, params.slots(), 0, params.dims.layers, false};
  return launch_kernel("the decoder kernel", launch.kernel, dim3(launch.blocks), dim3(kThreads),
                       launch.stream, LaunchOptions{/*cooperative=*/true, launch.ring_bytes},
                       params);
}

}  // namespace jaxfuse::cuda_decoder
