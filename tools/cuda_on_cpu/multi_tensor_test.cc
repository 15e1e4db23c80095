// The CUDA multi-tensor driver (csrc/optim/cuda/multi_tensor.cuh) on hand-made tensor lists, run
// on the CPU by tools/cuda_on_cpu: sizes around every chunk, slice and table boundary, mixed
// dtypes, bases that defeat vector access, and buffers allocated to their exact size (ASan sees
// any overrun) with guard bytes in front. XLA never hands the handlers such pointers; users of
// the driver might. Exit status 0 when every check passes.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <cooperative_groups.h>

#include "optim/cuda/multi_tensor.cuh"

namespace jaxfuse {
namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    if (failures <= 20) std::fprintf(stderr, "FAIL: %s\n", what.c_str());
  }
}

// out = 2 * in + 1 in each list's own dtype; every element exactly once.
struct AffineOp : MultiTensorOpBase {
  __device__ void operator()(const ChunkRef<2>& r) const {
    for_each_group(r, [&](int64_t i, int n, bool vec) {
      float x[4] = {0.f, 0.f, 0.f, 0.f};
      load_group(r.ptr[0], r.dtype[0], i, n, vec, x);
      for (int j = 0; j < 4; ++j) x[j] = 2.0f * x[j] + 1.0f;
      store_group(r.ptr[1], r.dtype[1], i, n, vec, x);
    });
  }
};

// One partial sum per block (fixed slots), as the global norm does.
struct SumOp : MultiTensorOpBase {
  float* partials;
  float sum = 0.0f;
  __device__ void operator()(const ChunkRef<1>& r) {
    for_each_group(r, [&](int64_t i, int n, bool vec) {
      float x[4] = {0.f, 0.f, 0.f, 0.f};
      load_group(r.ptr[0], r.dtype[0], i, n, vec, x);
      for (int j = 0; j < 4; ++j) sum += x[j];
    });
  }
  __device__ void finish(int block) {
    __shared__ float per_thread[kMultiTensorThreads];
    per_thread[threadIdx.x] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
      float s = 0.0f;
      for (int t = 0; t < kMultiTensorThreads; ++t) s += per_thread[t];
      partials[block] = s;
    }
    __syncthreads();
  }
};

constexpr unsigned char kGuard = 0xA5;

// A buffer of exactly n elements at `offset` bytes past an allocation, guard bytes before it.
struct Buffer {
  DType dtype;
  int64_t n;
  int offset;
  char* alloc = nullptr;

  Buffer(DType t, int64_t count, int off) : dtype(t), n(count), offset(off) {
    // Exactly the guard and the data: one byte past the last element is out of bounds for ASan.
    alloc = static_cast<char*>(std::malloc(std::max<size_t>(1, size_t(n * dtype_bytes(t) + off))));
    std::memset(alloc, kGuard, size_t(off));
  }
  Buffer(const Buffer&) = delete;
  ~Buffer() { std::free(alloc); }
  void* data() const { return alloc + offset; }
  bool guard_intact() const {
    for (int i = 0; i < offset; ++i) {
      if (static_cast<unsigned char>(alloc[i]) != kGuard) return false;
    }
    return true;
  }
};

// Sizes around the chunk and slice boundaries; `small` only those below a few hundred elements
// (for trees of many tensors).
std::vector<int64_t> test_sizes(bool small = false) {
  if (small) return {0, 1, 2, 3, 4, 5, 7, 8, 9, 31, 33, 255, 257};
  const int64_t c = kMultiTensorChunk;
  std::vector<int64_t> s = {0, 1, 2, 3, 4, 5, 7, 8, 9, 31, 33, 255, 257, c - 1, c, c + 1, 3 * c + 5};
  if (kMaxSlice <= (int64_t(1) << 20)) {  // the small build: slices of a few chunks
    for (int64_t x : {kMaxSlice - 1, kMaxSlice, kMaxSlice + 3, 2 * kMaxSlice + 1}) s.push_back(x);
  }
  return s;
}

DType dtype_at(int i) {
  static const DType all[] = {DType::kF32, DType::kBF16, DType::kF16};
  return all[i % 3];
}

void test_affine(int repeat_tensors, bool small) {
  std::mt19937 rng(1234 + repeat_tensors);
  std::normal_distribution<float> normal;
  std::vector<std::unique_ptr<Buffer>> in, out;
  TensorLists lists;
  lists.num_lists = 2;
  const std::vector<int64_t> sizes = test_sizes(small);
  int t = 0;
  for (int rep = 0; rep < repeat_tensors; ++rep) {
    for (int64_t n : sizes) {
      const DType din = dtype_at(t), dout = dtype_at(t / 3 + rep);
      const int off_in = (t % 4) * dtype_bytes(din), off_out = ((t + 1) % 4) * dtype_bytes(dout);
      in.push_back(std::make_unique<Buffer>(din, n, off_in));
      out.push_back(std::make_unique<Buffer>(dout, n, off_out));
      for (int64_t i = 0; i < n; ++i) {
        store_from_float(in.back()->data(), din, i, normal(rng));
        store_from_float(out.back()->data(), dout, i, std::nanf(""));  // poison
      }
      lists.ptr.push_back({in.back()->data(), out.back()->data()});
      lists.dtype.push_back({din, dout});
      lists.size.push_back(n);
      lists.mask.push_back(0);
      ++t;
    }
  }
  int blocks = 0;
  const ffi::Error err = multi_tensor_apply<2>(nullptr, lists, AffineOp{}, 0, &blocks);
  check(err.success(), "affine: launch failed: " + err.message());
  for (size_t k = 0; k < in.size(); ++k) {
    const Buffer& a = *in[k];
    const Buffer& b = *out[k];
    int64_t bad = 0;
    for (int64_t i = 0; i < a.n; ++i) {
      const float expect = round_to(b.dtype, 2.0f * load_as_float(a.data(), a.dtype, i) + 1.0f);
      const float got = load_as_float(b.data(), b.dtype, i);
      if (!(got == expect)) ++bad;
    }
    check(bad == 0, "affine: tensor " + std::to_string(k) + " (" + std::to_string(a.n) + " elements, offsets " +
                        std::to_string(a.offset) + "/" + std::to_string(b.offset) + "): " +
                        std::to_string(bad) + " wrong elements");
    check(a.guard_intact() && b.guard_intact(), "affine: guard bytes overwritten, tensor " + std::to_string(k));
  }
}

// The partial sums must be the same bitwise whatever the schedule, and add up to the total.
void test_sum(int repeat_tensors, bool small) {
  std::vector<std::unique_ptr<Buffer>> bufs;
  TensorLists lists;
  lists.num_lists = 1;
  double exact = 0.0;
  int t = 0;
  for (int rep = 0; rep < repeat_tensors; ++rep) {
    for (int64_t n : test_sizes(small)) {
      const DType d = dtype_at(t);
      bufs.push_back(std::make_unique<Buffer>(d, n, (t % 4) * dtype_bytes(d)));
      for (int64_t i = 0; i < n; ++i) {
        store_from_float(bufs.back()->data(), d, i, float((i * 7 + t) % 13) - 6.0f);
        exact += load_as_float(bufs.back()->data(), d, i);
      }
      lists.ptr.push_back({bufs.back()->data()});
      lists.dtype.push_back({d});
      lists.size.push_back(n);
      lists.mask.push_back(0);
      ++t;
    }
  }
  std::vector<float> first;
  for (const char* seed : {"0", "7", "12345"}) {
    setenv("JAXFUSE_EMU_SEED", seed, 1);
    std::vector<float> partials(4096, std::nanf(""));
    SumOp op;
    op.partials = partials.data();
    int blocks = 0;
    const ffi::Error err = multi_tensor_apply<1>(nullptr, lists, op, 64, &blocks);
    check(err.success(), "sum: launch failed: " + err.message());
    check(blocks > 0 && blocks <= 4096, "sum: blocks used " + std::to_string(blocks));
    partials.resize(size_t(std::max(blocks, 0)));
    double total = 0.0;
    for (float p : partials) total += p;
    // Small integers: every partial is exact, so the total is too.
    check(total == exact, "sum: total " + std::to_string(total) + " != " + std::to_string(exact));
    if (first.empty()) first = partials;
    check(partials == first, std::string("sum: partials differ under schedule seed ") + seed);
  }
  unsetenv("JAXFUSE_EMU_SEED");
}

// Polling (the decoder's counters): block b's thread 0 waits for block b - 1's flag, and for a
// flag its own block's last thread sets after it (a poll that must let the block's other threads
// run); `order` records the blocks' order, which must be 0, 1, 2, ...
__global__ void poll_chain_kernel(int* flags, int* order) {
  __shared__ int handoff;
  const int b = int(blockIdx.x), last = int(blockDim.x) - 1;
  if (threadIdx.x == 0) {
    handoff = 0;
    if (b > 0) {
      while (atomicAdd(&flags[b - 1], 0) == 0) __nanosleep(32);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    while (atomicAdd(&handoff, 0) == 0) __nanosleep(32);
    order[b] = atomicAdd(&order[gridDim.x], 1);
    __threadfence();
    atomicExch(&flags[b], 1);
  } else if (int(threadIdx.x) == last) {
    atomicExch(&handoff, 1);
  }
}

void test_poll() {
  constexpr int kBlocks = 4;
  for (const char* seed : {"0", "3"}) {
    setenv("JAXFUSE_EMU_SEED", seed, 1);
    std::vector<int> flags(kBlocks, 0), order(kBlocks + 1, 0);
    const ffi::Error err = launch_kernel("poll", poll_chain_kernel, dim3(kBlocks), dim3(64), nullptr,
                                         LaunchOptions{true}, flags.data(), order.data());
    check(err.success(), "poll: " + err.message());
    for (int b = 0; b < kBlocks; ++b) {
      check(order[b] == b, "poll: block " + std::to_string(b) + " went " + std::to_string(order[b]));
    }
  }
  unsetenv("JAXFUSE_EMU_SEED");
}

// cp.async into dynamic shared memory (the decoder's weight ring): thread t copies in[t] (16
// bytes) as one commit group and zeros in place of in[t] as the next; between the waits the
// second copy must not have landed (its destination still holds the 0xff fill), after
// them both have.
__global__ void async_copy_kernel(const uint4* in, uint4* out) {
  uint4* ring = reinterpret_cast<uint4*>(dynamic_shared_memory());
  const int t = int(threadIdx.x), n = int(blockDim.x);
  copy_async_16(ring + t, in + t, true);
  commit_async_copies();
  copy_async_16(ring + n + t, in + t, false);
  commit_async_copies();
  wait_async_copies<1>();
  out[t] = ring[t];
  out[2 * n + t] = ring[n + t];  // in flight
  wait_async_copies<0>();
  out[n + t] = ring[n + t];
}

void test_async_copy() {
  constexpr int kThreads = 64;
  std::vector<uint4> in(kThreads), out(3 * kThreads);
  for (int t = 0; t < kThreads; ++t) in[t] = uint4{unsigned(4 * t), unsigned(4 * t + 1), 7u, 9u};
  const size_t shared = 2 * kThreads * sizeof(uint4);
  ffi::Error err = launch_kernel("async copy", async_copy_kernel, dim3(2), dim3(kThreads), nullptr,
                                 LaunchOptions{false, shared}, in.data(), out.data());
  check(err.success(), "async copy: " + err.message());
  for (int t = 0; t < kThreads; ++t) {
    const uint4 a = out[t], b = out[kThreads + t], early = out[2 * kThreads + t];
    check(a.x == in[t].x && a.y == in[t].y && a.z == 7u && a.w == 9u, "async copy: 16 bytes");
    check(b.x == 0u && b.y == 0u && b.z == 0u && b.w == 0u, "async copy: zero fill");
    check(early.x == ~0u && early.w == ~0u, "async copy: landed before its wait");
  }
  // Over 48 KB of dynamic shared memory needs the kernel's opt-in, as on a GPU.
  const size_t big = 64 * 1024;
  err = launch_kernel("async copy", async_copy_kernel, dim3(1), dim3(kThreads), nullptr,
                      LaunchOptions{false, big}, in.data(), out.data());
  check(!err.success(), "dynamic shared memory over 48 KB launched without the opt-in");
  check(cudaFuncSetAttribute(async_copy_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             int(big)) == cudaSuccess, "cudaFuncSetAttribute");
  err = launch_kernel("async copy", async_copy_kernel, dim3(1), dim3(kThreads), nullptr,
                      LaunchOptions{false, big}, in.data(), out.data());
  check(err.success(), "async copy with the opt-in: " + err.message());
}

// Programmatic dependent launch: `write` stores v[i] = value (a plain or programmatic launch);
// `read` copies v[i] into before[i] ahead of its griddepcontrol.wait and into after[i] past it.
__global__ void pdl_write_kernel(float* v, float value) {
  const int i = int(blockIdx.x * blockDim.x + threadIdx.x);
  wait_for_prior_grids();
  v[i] = value;
}

__global__ void pdl_read_kernel(const float* v, float* before, float* after) {
  const int i = int(blockIdx.x * blockDim.x + threadIdx.x);
  const float early = v[i];
  wait_for_prior_grids();
  before[i] = early;
  after[i] = v[i];
}

__global__ void pdl_store_before_wait_kernel(float* v) {
  v[threadIdx.x] = 2.0f;
  wait_for_prior_grids();
}

// A programmatic launch's reads before its wait see the bytes the chain of launches since the
// last plain one wrote as 0xff, past it their values; a launch that is not programmatic, or one
// on a device before compute capability 9.0, sees them all.
void test_programmatic() {
  constexpr int kBlocks = 3, kThreads = 64, n = kBlocks * kThreads;
  std::vector<float> v(n, 0.0f), before(n), after(n);
  for (const char* devices : {"4x2", "4x2x228x80"}) {
    setenv("JAXFUSE_EMU_DEVICES", devices, 1);
    const bool poisons = std::string(devices) == "4x2";
    cuemu::watch_memory(v.data(), n * sizeof(float));
    cuemu::watch_memory(before.data(), n * sizeof(float));
    cuemu::watch_memory(after.data(), n * sizeof(float));
    LaunchOptions chained;
    chained.programmatic = true;
    ffi::Error err = launch_kernel("pdl write", pdl_write_kernel, dim3(kBlocks), dim3(kThreads),
                                   nullptr, LaunchOptions{}, v.data(), 1.0f);
    check(err.success(), "pdl write: " + err.message());
    err = launch_kernel("pdl write", pdl_write_kernel, dim3(kBlocks), dim3(kThreads), nullptr,
                        chained, v.data(), 3.0f);
    check(err.success(), "pdl write (programmatic): " + err.message());
    err = launch_kernel("pdl read", pdl_read_kernel, dim3(kBlocks), dim3(kThreads), nullptr,
                        chained, v.data(), before.data(), after.data());
    check(err.success(), "pdl read: " + err.message());
    for (int i = 0; i < n; ++i) {
      check(after[i] == 3.0f, "pdl read: past the wait, not the last launch's value");
      check(poisons ? std::isnan(before[i]) : before[i] == 3.0f,
            std::string("pdl read before the wait on ") + devices + ": " +
                std::to_string(before[i]));
    }
    // A plain launch waits for everything before it: its reads see every value.
    err = launch_kernel("pdl read", pdl_read_kernel, dim3(kBlocks), dim3(kThreads), nullptr,
                        LaunchOptions{}, v.data(), before.data(), after.data());
    check(err.success() && before[0] == 3.0f, "pdl read, plain launch");
    cuemu::unwatch_memory();
  }
  unsetenv("JAXFUSE_EMU_DEVICES");
}

// A poll that never ends: block 1 waits for a flag no block sets.
__global__ void poll_forever_kernel(int* flags) {
  if (blockIdx.x == 1 && threadIdx.x == 0) {
    while (atomicAdd(&flags[0], 0) == 0) __nanosleep(32);
  }
}

// Planted synchronization bugs the emulator must report as kernel faults (each in its own
// process: a fault is sticky, as on a GPU).
__global__ void divergent_sync_kernel(float* out) {
  if (threadIdx.x < 32) return;  // warp 0 exits; the others wait at a barrier it never reaches
  __syncthreads();
  out[threadIdx.x] = 1.0f;
}

__global__ void grid_sync_kernel(float* out) {
  out[blockIdx.x] = 1.0f;
  cooperative_groups::this_grid().sync();
}

__global__ void grid_sync_after_exit_kernel(float* out) {
  if (blockIdx.x == 0) return;  // the other blocks wait at a grid sync block 0 never reaches
  cooperative_groups::this_grid().sync();
  out[blockIdx.x] = 1.0f;
}

int expect_fault(const char* which) {
  std::vector<float> out(1024);
  const std::string name = which;
  ffi::Error err = ffi::Error::Success();
  if (name == "divergent_sync") {
    err = launch_kernel(which, divergent_sync_kernel, dim3(2), dim3(128), nullptr, LaunchOptions{}, out.data());
  } else if (name == "grid_sync") {  // grid sync in a launch that is not cooperative
    err = launch_kernel(which, grid_sync_kernel, dim3(4), dim3(64), nullptr, LaunchOptions{}, out.data());
  } else if (name == "grid_sync_after_exit") {
    err = launch_kernel(which, grid_sync_after_exit_kernel, dim3(4), dim3(64), nullptr, LaunchOptions{true},
                        out.data());
  } else if (name == "store_before_wait") {  // a store a programmatic launch makes too early
    cuemu::watch_memory(out.data(), out.size() * sizeof(float));
    LaunchOptions chained;
    chained.programmatic = true;
    err = launch_kernel(which, pdl_write_kernel, dim3(1), dim3(64), nullptr, LaunchOptions{},
                        out.data(), 1.0f);
    if (err.success()) {
      err = launch_kernel(which, pdl_store_before_wait_kernel, dim3(1), dim3(64), nullptr, chained,
                          out.data());
    }
  } else if (name == "poll_forever") {
    setenv("JAXFUSE_EMU_GRID_SYNC_TIMEOUT", "1", 1);
    std::vector<int> flags(1, 0);
    err = launch_kernel(which, poll_forever_kernel, dim3(2), dim3(32), nullptr, LaunchOptions{true}, flags.data());
  } else {
    std::fprintf(stderr, "unknown fault '%s'\n", which);
    return 2;
  }
  const bool caught = !err.success() && err.message().find("cudaErrorLaunchFailure") != std::string::npos;
  std::printf("%s: %s (%s)\n", which, caught ? "caught" : "NOT CAUGHT", err.message().c_str());
  return caught ? 0 : 1;
}

}  // namespace
}  // namespace jaxfuse

int main(int argc, char** argv) {
  using namespace jaxfuse;
  if (argc > 1) return expect_fault(argv[1]);
  std::printf("multi-tensor driver: chunk %d, table capacity %d/%d tensors (2/1 lists), slice %lld\n",
              kMultiTensorChunk, TensorTable<2>::kCap, TensorTable<1>::kCap, (long long)kMaxSlice);
  const int per_rep = int(test_sizes(true).size());
  test_affine(1, false);
  test_affine(TensorTable<2>::kCap / per_rep + 2, true);  // more tensors than a table: several launches
  test_sum(1, false);
  test_sum(TensorTable<1>::kCap / per_rep + 2, true);
  test_poll();
  test_async_copy();
  test_programmatic();
  std::printf("%s: %d failures\n", failures ? "FAILED" : "ok", failures);
  return failures ? 1 : 0;
}
