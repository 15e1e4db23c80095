// The multi-tensor chunk driver of the CPU optimizer and clip handlers: every tensor of a call's
// lists cut into chunks, run on the thread pool.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/cpu/common.h"
#include "optim/tensor_lists.h"

namespace jaxfuse {

// The chunks of every tensor of `lists`, `chunk` elements each (the last one shorter): chunk c
// of all tensors together belongs to the tensor t with first[t] <= c < first[t + 1].
struct ChunkIndex {
  std::vector<int64_t> first;  // [num_tensors + 1], prefix sum of chunk counts
  int64_t chunk;

  ChunkIndex(const TensorLists& lists, int64_t chunk_elements) : chunk(chunk_elements) {
    first.assign(lists.num_tensors() + 1, 0);
    for (int64_t t = 0; t < lists.num_tensors(); ++t) {
      first[t + 1] = first[t] + (lists.size[t] + chunk - 1) / chunk;
    }
  }
  int64_t total() const { return first.back(); }
  int64_t tensor_of(int64_t c) const {
    return std::upper_bound(first.begin(), first.end(), c) - first.begin() - 1;
  }
};

// Runs fn(tensor, first_element, count, chunk_number) over all chunks of all tensors in parallel.
template <typename Fn>
void for_each_chunk(ffi::ThreadPool* pool, const TensorLists& lists, const ChunkIndex& chunks,
                    const Fn& fn) {
  parallel_for(pool, chunks.total(), [&](int64_t c) {
    const int64_t t = chunks.tensor_of(c);
    const int64_t start = (c - chunks.first[t]) * chunks.chunk;
    fn(t, start, std::min(chunks.chunk, lists.size[t] - start), c);
  });
}

}  // namespace jaxfuse
