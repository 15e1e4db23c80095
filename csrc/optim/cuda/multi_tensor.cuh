// Multi-tensor apply, CUDA side: the tensor lists of an FFI call are packed into tables passed
// by value as kernel parameters (no device allocation, no host-to-device copy, no sync: safe for
// CUDA graph capture). One launch covers as many tensors as fit a table; more tensors take a few
// launches (multi_tensor_plan.h says how many). Every block walks chunks of all tensors of its
// table (grid-stride), finds its tensor by binary search over the chunk prefix, and hands
// (tensor, first element, count) to the op.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "core/cuda/common.cuh"
#include "optim/multi_tensor_plan.h"
#include "optim/tensor_lists.h"

namespace jaxfuse {

inline constexpr int kMultiTensorThreads = 256;

// Blocks of kMultiTensorThreads an op's kernel is compiled to fit on one SM, which caps its
// registers (4: 64 per thread, 3: 80): an op may declare kMinBlocksPerSM, 1 otherwise.
template <typename Op, typename = void>
struct MinBlocksPerSM : std::integral_constant<int, 1> {};
template <typename Op>
struct MinBlocksPerSM<Op, std::void_t<decltype(Op::kMinBlocksPerSM)>>
    : std::integral_constant<int, Op::kMinBlocksPerSM> {};

template <int kLists>
struct TensorTable {
  static constexpr int kCap = table_capacity(kLists);  // multi_tensor_plan.h
  void* ptr[kLists][kCap];
  int32_t size[kCap];             // elements of each entry (a tensor or a <2^31 slice of one)
  int32_t chunk_start[kCap + 1];  // prefix sum of chunks
  DType dtype[kLists][kCap];
  int32_t tensor[kCap];           // the entry's tensor in the call
  int32_t slice[kCap];            // the entry's slice of its tensor (kMaxSlice elements each)
  uint8_t mask[kCap];
  int32_t num_tensors;
};
static_assert(sizeof(TensorTable<6>) <= kTableBytes, "table exceeds the kernel parameter budget");

// Device view of one tensor's chunk, what ops receive.
template <int kLists>
struct ChunkRef {
  void* ptr[kLists];
  DType dtype[kLists];
  int64_t start;   // first element of the chunk within the table entry
  int64_t offset;  // first element of the table entry within its tensor
  int n;           // elements in the chunk
  int index;      // the chunk's number in the call (all launches), tensors and chunks in order
  int tensor;     // the tensor's number in the call
  uint8_t mask;   // the tensor's entry of TensorLists::mask
  bool aligned;   // every list's pointer allows 4-element vector access
};

__device__ __forceinline__ int find_entry(const int32_t* chunk_start, int num, int chunk) {
  int lo = 0, hi = num;  // invariant: chunk_start[lo] <= chunk < chunk_start[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (chunk_start[mid] <= chunk) lo = mid; else hi = mid;
  }
  return lo;
}

// The op: a struct with `__device__ void operator()(const ChunkRef<kLists>&)`,
// called by all threads of the block for each of its chunks, `prepare()` run before the chunks
// and `finish(block)` after them, with `block` numbering blocks across all launches of one
// multi_tensor_apply (for ops that write one partial result per block).
template <int kLists, typename Op>
__global__ void __launch_bounds__(kMultiTensorThreads, MinBlocksPerSM<Op>::value)
    multi_tensor_kernel(const __grid_constant__ TensorTable<kLists> table, Op op, int block_offset,
                        int chunk_offset) {
  op.prepare();
  const int total = table.chunk_start[table.num_tensors];
  for (int c = blockIdx.x; c < total; c += gridDim.x) {
    const int e = find_entry(table.chunk_start, table.num_tensors, c);
    ChunkRef<kLists> ref;
    const int local = c - table.chunk_start[e];
    ref.start = int64_t(local) * kMultiTensorChunk;
    ref.n = min(kMultiTensorChunk, table.size[e] - local * kMultiTensorChunk);
    ref.index = chunk_offset + c;
    ref.tensor = table.tensor[e];
    ref.offset = int64_t(table.slice[e]) * kMaxSlice;
    ref.mask = table.mask[e];
    bool aligned = true;
#pragma unroll
    for (int k = 0; k < kLists; ++k) {
      ref.ptr[k] = table.ptr[k][e];
      ref.dtype[k] = table.dtype[k][e];
      aligned &= (reinterpret_cast<uintptr_t>(ref.ptr[k]) % (4 * dtype_bytes(ref.dtype[k]))) == 0;
    }
    ref.aligned = aligned;
    op(ref);
  }
  op.finish(block_offset + blockIdx.x);
}

// Base for ops: nothing to prepare or finish.
struct MultiTensorOpBase {
  __device__ void prepare() {}
  __device__ void finish(int block) {}
};

// Packs `lists` into as few tables as needed (tensors of 2^31 elements or more are split into
// slices) and launches multi_tensor_kernel<kLists, Op> for each on `stream`. Each launch gets at
// most `max_blocks_per_launch` blocks (0: as many as are co-resident); `*blocks_used`, if given,
// receives the number of blocks of all launches together. `subset`, if given, names the tensors
// to take, in order (ops still see each tensor's number in `lists`).
template <int kLists, typename Op>
ffi::Error multi_tensor_apply(cudaStream_t stream, const TensorLists& lists, const Op& op,
                              int max_blocks_per_launch = 0, int* blocks_used = nullptr,
                              const std::vector<int32_t>* subset = nullptr) {
  if (lists.num_lists != kLists) return internal_error("list count mismatch");
  using Table = TensorTable<kLists>;
  constexpr auto kernel = multi_tensor_kernel<kLists, Op>;
  int max_grid = 0;
  JF_CUDA_RETURN_IF_ERROR(resident_blocks<kernel>(kMultiTensorThreads, 0, 0, &max_grid));
  if (max_blocks_per_launch > 0) max_grid = std::min(max_grid, max_blocks_per_launch);
  int block_offset = 0;
  int chunk_offset = 0;

  Table table;
  table.num_tensors = 0;
  table.chunk_start[0] = 0;
  bool launched = false;
  // Launches even an empty table once: ops may write per-call scalars (e.g. the step count).
  auto launch = [&]() -> ffi::Error {
    const int chunks = table.chunk_start[table.num_tensors];
    if (chunks == 0 && launched) return ffi::Error::Success();
    const int grid = std::max(1, std::min(chunks, max_grid));
    JF_RETURN_IF_ERROR(launch_kernel("the multi-tensor kernel", kernel, dim3(grid),
                                     dim3(kMultiTensorThreads), stream,
                                     LaunchOptions{}, table, op, block_offset,
                                     chunk_offset));
    block_offset += grid;
    chunk_offset += chunks;
    launched = true;
    table.num_tensors = 0;
    return ffi::Error::Success();
  };
  const int64_t count =
      subset != nullptr ? static_cast<int64_t>(subset->size()) : lists.num_tensors();
  for (int64_t j = 0; j < count; ++j) {
    const int64_t t = subset != nullptr ? (*subset)[j] : j;
    for (int64_t off = 0; off < lists.size[t]; off += kMaxSlice) {
      const int64_t n = std::min(kMaxSlice, lists.size[t] - off);
      const int e = table.num_tensors;
      for (int k = 0; k < kLists; ++k) {
        // A block list's values of the slice (slices hold whole blocks).
        const int64_t first = lists.per_block[k] ? off / kBlockElements : off;
        table.ptr[k][e] =
            static_cast<char*>(lists.ptr[t][k]) + first * dtype_bytes(lists.dtype[t][k]);
        table.dtype[k][e] = lists.dtype[t][k];
      }
      table.size[e] = static_cast<int32_t>(n);
      table.tensor[e] = static_cast<int32_t>(t);
      table.slice[e] = static_cast<int32_t>(off / kMaxSlice);
      table.mask[e] = lists.mask[t];
      table.chunk_start[e + 1] =
          table.chunk_start[e] + static_cast<int32_t>((n + kMultiTensorChunk - 1) / kMultiTensorChunk);
      table.num_tensors = e + 1;
      if (table.num_tensors == Table::kCap) JF_RETURN_IF_ERROR(launch());
    }
  }
  JF_RETURN_IF_ERROR(launch());
  if (blocks_used != nullptr) *blocks_used = block_offset;
  return ffi::Error::Success();
}

// ---- vectorized element access for ops ------------------------------------------------------
// Four consecutive elements of dtype kT in the compute type Real: 16-byte accesses (two for
// float64), 8-byte for 16-bit dtypes.

template <DType kT, typename Real>
__device__ __forceinline__ void load4(const void* base, int64_t i, Real out[4]) {
  using S = Storage<kT>;
  if constexpr (kT == DType::kF32) {
    const float4 v = *reinterpret_cast<const float4*>(static_cast<const float*>(base) + i);
    out[0] = Real(v.x); out[1] = Real(v.y); out[2] = Real(v.z); out[3] = Real(v.w);
  } else if constexpr (kT == DType::kF64) {
    const double2* p = reinterpret_cast<const double2*>(static_cast<const double*>(base) + i);
    const double2 a = p[0], b = p[1];
    out[0] = Real(a.x); out[1] = Real(a.y); out[2] = Real(b.x); out[3] = Real(b.y);
  } else {
    const uint2 raw = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(base) + i);
    const uint16_t h[4] = {uint16_t(raw.x & 0xffffu), uint16_t(raw.x >> 16),
                           uint16_t(raw.y & 0xffffu), uint16_t(raw.y >> 16)};
#pragma unroll
    for (int j = 0; j < 4; ++j) out[j] = S::template load<Real>(h[j]);
  }
}

template <DType kT, typename Real>
__device__ __forceinline__ void store4(void* base, int64_t i, const Real in[4]) {
  using S = Storage<kT>;
  if constexpr (kT == DType::kF32) {
    *reinterpret_cast<float4*>(static_cast<float*>(base) + i) =
        make_float4(S::store(in[0]), S::store(in[1]), S::store(in[2]), S::store(in[3]));
  } else if constexpr (kT == DType::kF64) {
    double2* p = reinterpret_cast<double2*>(static_cast<double*>(base) + i);
    p[0] = make_double2(S::store(in[0]), S::store(in[1]));
    p[1] = make_double2(S::store(in[2]), S::store(in[3]));
  } else {
    uint16_t h[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) h[j] = S::store(in[j]);
    *reinterpret_cast<uint2*>(static_cast<uint16_t*>(base) + i) =
        make_uint2(uint32_t(h[0]) | (uint32_t(h[1]) << 16), uint32_t(h[2]) | (uint32_t(h[3]) << 16));
  }
}

// Up to 4 consecutive elements (count n) in the compute type: a vector access when `vec`, else
// scalar ones.
template <typename Real>
__device__ __forceinline__ void load_group(const void* base, DType t, int64_t i, int n, bool vec,
                                           Real out[4]) {
  if (vec) {
    visit_dtype(t, [&](auto tag) { load4<decltype(tag)::value>(base, i, out); });
  } else {
    for (int j = 0; j < n; ++j) out[j] = load_value<Real>(base, t, i + j);
  }
}

template <typename Real>
__device__ __forceinline__ void store_group(void* base, DType t, int64_t i, int n, bool vec,
                                            const Real in[4]) {
  if (vec) {
    visit_dtype(t, [&](auto tag) { store4<decltype(tag)::value>(base, i, in); });
  } else {
    for (int j = 0; j < n; ++j) store_value<Real>(base, t, i + j, in[j]);
  }
}

// Up to 4 consecutive int16 words (count n) as values of the compute type: one 8-byte access
// when `vec`, else scalar ones.
template <typename Real>
__device__ __forceinline__ void load_word_group(const void* base, int64_t i, int n, bool vec,
                                                Real out[4]) {
  const int16_t* w = static_cast<const int16_t*>(base) + i;
  if (vec) {
    const uint2 raw = *reinterpret_cast<const uint2*>(w);
    out[0] = Real(int16_t(raw.x & 0xffffu));
    out[1] = Real(int16_t(raw.x >> 16));
    out[2] = Real(int16_t(raw.y & 0xffffu));
    out[3] = Real(int16_t(raw.y >> 16));
  } else {
    for (int j = 0; j < n; ++j) out[j] = Real(w[j]);
  }
}

template <typename Real>
__device__ __forceinline__ void store_word_group(void* base, int64_t i, int n, bool vec,
                                                 const Real in[4]) {
  int16_t* w = static_cast<int16_t*>(base) + i;
  if (vec) {
    uint16_t h[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) h[j] = uint16_t(int16_t(in[j]));
    *reinterpret_cast<uint2*>(w) = make_uint2(uint32_t(h[0]) | (uint32_t(h[1]) << 16),
                                              uint32_t(h[2]) | (uint32_t(h[3]) << 16));
  } else {
    for (int j = 0; j < n; ++j) w[j] = int16_t(in[j]);
  }
}

// Calls fn(first, count, aligned) over the block's share of a chunk: groups of 4 elements per
// thread per step, with `aligned` true when the group may use vector accesses.
template <int kLists, typename Fn>
__device__ __forceinline__ void for_each_group(const ChunkRef<kLists>& ref, Fn&& fn) {
  for (int i = threadIdx.x * 4; i < ref.n; i += blockDim.x * 4) {
    const int count = min(4, ref.n - i);
    fn(ref.start + i, count, ref.aligned && count == 4);
  }
}

}  // namespace jaxfuse
