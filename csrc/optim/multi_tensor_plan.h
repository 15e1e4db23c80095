// How the CUDA multi-tensor driver (csrc/optim/cuda/multi_tensor.cuh) cuts a call into launches:
// chunk and table sizes, and the launch count that follows from them. Host code, so that every
// module (the CPU one included) can say what a call launches on a GPU (op.h's CallCost).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace jaxfuse {

// The JAXFUSE_MT_* overrides exist for tools/cuda_on_cpu, which shrinks the tables, chunks and
// slices so that the multi-launch and tensor-slicing paths run on small buffers.
#ifndef JAXFUSE_MT_CHUNK
#define JAXFUSE_MT_CHUNK (1 << 15)
#endif
#ifndef JAXFUSE_MT_TABLE_BYTES
#define JAXFUSE_MT_TABLE_BYTES 32000
#endif
inline constexpr int kMultiTensorChunk = JAXFUSE_MT_CHUNK;  // elements per chunk
static_assert(kMultiTensorChunk % 8 == 0,
              "chunks keep vector groups aligned and complex pairs whole");
// CUDA 12.1+ on sm_70+ allows 32764 bytes of kernel parameters; leave room for the op.
inline constexpr int kTableBytes = JAXFUSE_MT_TABLE_BYTES;
inline constexpr int kTableHeaderBytes = 64;

// Tensors one table (one launch) holds for an op of `lists` lists. Per tensor: a pointer and a
// dtype per list, the element count, the chunk prefix, the tensor's number and slice, the mask.
constexpr int table_capacity(int lists) {
  return (kTableBytes - kTableHeaderBytes) / (9 * lists + 4 + 4 + 4 + 4 + 1);
}

// Largest table entry: a whole number of chunks below 2^31 elements.
#ifndef JAXFUSE_MT_MAX_SLICE_CHUNKS
#define JAXFUSE_MT_MAX_SLICE_CHUNKS (INT32_MAX / kMultiTensorChunk)
#endif
inline constexpr int64_t kMaxSlice = int64_t(JAXFUSE_MT_MAX_SLICE_CHUNKS) * kMultiTensorChunk;
static_assert(kMaxSlice > 0 && kMaxSlice <= INT32_MAX, "slices are indexed with 32-bit sizes");

// Launches of one multi_tensor_apply over tensors of `sizes` scalars with `lists` lists: each
// tensor takes ceil(size / kMaxSlice) table entries, a table holds table_capacity(lists), and an
// empty call still launches once (ops may write per-call scalars such as the step count).
inline int64_t multi_tensor_launches(int lists, const std::vector<int64_t>& sizes) {
  int64_t entries = 0;
  for (int64_t s : sizes) entries += (s + kMaxSlice - 1) / kMaxSlice;
  const int64_t cap = table_capacity(lists);
  return std::max<int64_t>(1, (entries + cap - 1) / cap);
}

}  // namespace jaxfuse
