// The CUDA decoder's stage-kernel schedule (included by cuda/decoder.cu only): the same kernel
// (decoder_kernel.cuh) launched once per stage of the call, in order on the call's stream, each
// launch a programmatic dependent launch of the one before (sm_90+): its blocks are scheduled as
// the previous launch's leave the SMs, copy their first weights into the weight ring (or ask L2
// for them) and only then wait for the previous launch (griddepcontrol.wait) before they read
// its results. The grid, the work's split and so the bits are the persistent schedule's.
//
// The launches: the embedding (after the counters' memset, not programmatic), every layer's five
// stages and the LM head (programmatic), and the draw (not programmatic: its radix passes wait
// on every block of its own). A launch's blocks may wait for each other (the finish of a GEMV
// tile's other batch rows, the draw's passes), so every launch is one whose blocks all run at
// once: a cooperative one where it is not programmatic; a programmatic one's grid is at most
// what fits the device, and the next launch's blocks take SMs only as its blocks leave them.
// Without programmatic launch (before sm_90) every launch is cooperative, and waits for the one
// before as a stream does.
//
// What it costs: a launch per stage (under XLA's command buffers, nodes of one graph with
// programmatic edges), and at each boundary the previous launch's tail (its last blocks) less
// what the next launch's first weights overlap of it; no counters are polled between stages.
#pragma once

#include "decoder/cuda/decoder_launch.cuh"

namespace jaxfuse::cuda_decoder {

// The launch of slot `slot` of a call of `layers` layers.
inline LaunchSlots stage_launch(int slot, int layers) {
  const int layer = slot == 0 ? 0 : std::min((slot - 1) / kLayerStages, layers);
  const bool in_layer = slot > 0 && slot < int(head_slot(layers));
  return LaunchSlots{slot, slot + 1, layer, in_layer ? layer + 1 : layer, true};
}

inline ffi::Error launch_stage_kernels(const DecoderLaunch& launch) {
  bool programmatic = false;
  JF_CUDA_RETURN_IF_ERROR(programmatic_launch_supported(&programmatic));
  DecoderParams params = launch.params;
  const int slots = params.slots(), draw = int(sample_slot(params.dims.layers));
  for (int slot = 0; slot < slots; ++slot) {
    params.run = stage_launch(slot, params.dims.layers);
    LaunchOptions options;
    options.dynamic_shared = launch.ring_bytes;
    options.programmatic = programmatic && slot > 0 && slot != draw;
    options.cooperative = !options.programmatic;
    const ffi::Error err = launch_kernel("the decoder's stage kernel", launch.kernel,
                                         dim3(launch.blocks), dim3(kThreads), launch.stream,
                                         options, params);
    if (!err.success()) {
      return ffi::Error(*err.errc(), str_cat(err.message(), " (the call's stage ", slot, ")"));
    }
  }
  return ffi::Error::Success();
}

}  // namespace jaxfuse::cuda_decoder
