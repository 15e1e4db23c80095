// CUDA on the CPU: the part of the CUDA runtime API and of the device intrinsics that jaxfuse's
// .cu sources use, implemented for the host, so that the real kernels and FFI handlers compile
// as host C++ (g++ -x c++, this header force-included as nvcc force-includes the real one) and
// run on the CPU. tools/cuda_on_cpu.sh builds and runs them; emu.cc is the runtime.
//
// Execution model: a launch runs to completion before cudaLaunchKernelEx returns (one stream,
// in order). Each block is an OS thread (all blocks of a cooperative launch at once, so the grid
// is co-resident; other launches on a few worker threads); each CUDA thread is a fiber (a stack
// of its own) of its block's OS thread. Fibers switch only at __syncthreads, warp shuffles and
// grid syncs, which are barriers that detect deadlock (a thread that exited or waits elsewhere) and report it
// as a kernel fault, and at __nanosleep, the pause of a thread polling memory that another thread
// will write: it lets the block's other threads run, yields the OS thread, and reports a poll
// that outlasts JAXFUSE_EMU_GRID_SYNC_TIMEOUT as a deadlock. __shared__ variables are thread_local, so one copy per block. Atomics and
// fences are host atomics; the vector types keep CUDA's alignment, so UBSan flags a misaligned
// vector access as the GPU would fault on it.
//
// Programmatic dependent launch: a launch with cudaLaunchAttributeProgrammaticStreamSerialization
// runs its blocks at once and holds them at griddepcontrol.wait until every block waits there or
// has exited; until then every byte of the call's results (watch_memory()) that the launches
// since the last plain one wrote reads as 0xff (NaN as a float), and a store to the results is a
// kernel fault: what a kernel may do before its wait, it may do while those launches still run.
//
// What it cannot show: memory-visibility effects of the GPU's weak memory model, timing, register
// and shared-memory limits, the device intrinsics' own rounding (math.h's host branches run), and
// CUDA-graph capture.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __grid_constant__
#define __launch_bounds__(...)
#define __shared__ static thread_local

#define CUDART_VERSION 13000
// Kernel sources test this where the emulator needs its own path (dynamic shared memory).
#define CUDA_ON_CPU 1

// ---- types --------------------------------------------------------------------------------------

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) double2 { double x, y; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(16) int4 { int x, y, z, w; };

inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline double2 make_double2(double x, double y) { return {x, y}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

enum cudaError {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInsufficientDriver = 35,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidDevice = 101,
  cudaErrorLaunchOutOfResources = 701,
  cudaErrorLaunchFailure = 719,
  cudaErrorCooperativeLaunchTooLarge = 720,
  cudaErrorNotSupported = 801,
};
using cudaError_t = cudaError;

enum cudaDeviceAttr {
  cudaDevAttrMaxThreadsPerBlock = 1,
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrMaxSharedMemoryPerMultiprocessor = 81,
  cudaDevAttrComputeCapabilityMajor = 75,
  cudaDevAttrComputeCapabilityMinor = 76,
  cudaDevAttrCooperativeLaunch = 95,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
};

enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };

struct CUstream_st;
using cudaStream_t = CUstream_st*;

enum cudaLaunchAttributeID {
  cudaLaunchAttributeCooperative = 2,
  cudaLaunchAttributeProgrammaticStreamSerialization = 6,
};
union cudaLaunchAttributeValue {
  int cooperative;
  int programmaticStreamSerializationAllowed;
  char pad[64];
};
struct cudaLaunchAttribute {
  cudaLaunchAttributeID id;
  cudaLaunchAttributeValue val;
};
struct cudaLaunchConfig_t {
  dim3 gridDim;
  dim3 blockDim;
  size_t dynamicSmemBytes;
  cudaStream_t stream;
  cudaLaunchAttribute* attrs;
  unsigned int numAttrs;
};

// ---- the runtime (emu.cc) -----------------------------------------------------------------------

namespace cuemu {

// Runs `body` (one kernel invocation) for every thread of the launch; see the file comment.
cudaError_t launch(const cudaLaunchConfig_t& config, size_t param_bytes, const void* entry,
                   const char* kernel, const std::function<void()>& body);
// cudaFuncSetAttribute(entry, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes): a launch with
// more than 48 KB of dynamic shared memory fails without it, as on a GPU.
cudaError_t set_max_dynamic_shared(const void* entry, int bytes);
// The launch's dynamic shared memory of the calling thread's block (`extern __shared__` cannot be
// thread_local): filled with 0xff bytes when the block starts, as a GPU leaves it undefined.
char* dynamic_shared_memory();
// cp.async as <cuda_pipeline_primitives.h> declares it, per thread: a copy fills its
// destination with 0xff bytes when issued (a reader the copy races with sees them) and lands
// when a wait covers its commit group (a reader that did not wait sees the 0xff bytes).
void async_copy(void* dst, const void* src, size_t bytes, size_t zfill);
void async_commit();
void async_wait_prior(size_t groups);
// Co-resident blocks per SM of the current emulated device, for every kernel and block size.
int blocks_per_sm();

// Work enqueued on the emulated streams since the process started: successful kernel launches
// and memsets. Tests compare them with what the ops declare (op.h's CudaLaunches).
struct EnqueuedWork {
  long kernels = 0;
  long memsets = 0;
};
EnqueuedWork enqueued_work();

void sync_block(const char* file, int line);
void sync_grid(const char* file, int line);
// griddepcontrol.wait: in a programmatic launch (cudaLaunchAttributeProgrammaticStreamSerialization)
// the calling thread waits until the launches before it have completed (see emu.cc's launch()
// for how reads before that are shown); elsewhere it returns at once.
void grid_dependency_wait(const char* file, int line);
// The device memory of the current FFI call that its kernels may write (its results), watched
// by the programmatic launches' checks; set by the emulated module's handlers for the length of
// a call (module_init.cc), on the calling thread.
void watch_memory(void* data, size_t bytes);
void unwatch_memory();
void poll_sleep(const char* file, int line);
uint64_t warp_exchange(unsigned mask, uint64_t bits, int src_lane, const char* file, int line);

// Kernel parameters as CUDA lays them out: each aligned to its type, packed in order.
template <typename... T>
constexpr size_t param_bytes() {
  size_t off = 0;
  ((off = (off + alignof(T) - 1) / alignof(T) * alignof(T) + sizeof(T)), ...);
  return off;
}

template <typename T>
T shuffle(unsigned mask, T v, int src_lane, const char* file, int line) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "shuffles move <= 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  bits = warp_exchange(mask, bits, src_lane, file, line);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

}  // namespace cuemu

cudaError_t cudaGetDevice(int* device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
const char* cudaGetErrorString(cudaError_t err);
const char* cudaGetErrorName(cudaError_t err);
cudaError_t cudaDriverGetVersion(int* version);
cudaError_t cudaRuntimeGetVersion(int* version);
cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t stream);

template <typename Kernel>
cudaError_t cudaFuncSetAttribute(Kernel* entry, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaErrorInvalidValue;
  return cuemu::set_max_dynamic_shared(reinterpret_cast<const void*>(entry), value);
}

template <typename Kernel>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, Kernel, int, size_t) {
  *blocks = cuemu::blocks_per_sm();
  return cudaSuccess;
}

// The runtime's type-safe launch: arguments are converted to the kernel's parameter types once,
// and each emulated thread calls the kernel with its own copy of them.
template <typename... ExpTypes, typename... ActTypes>
cudaError_t cudaLaunchKernelEx(const cudaLaunchConfig_t* config, void (*kernel)(ExpTypes...),
                               ActTypes&&... args) {
  std::tuple<std::decay_t<ExpTypes>...> params(std::forward<ActTypes>(args)...);
  return cuemu::launch(*config, cuemu::param_bytes<std::decay_t<ExpTypes>...>(),
                       reinterpret_cast<const void*>(kernel), __PRETTY_FUNCTION__,
                       [&]() { std::apply(kernel, params); });
}

// ---- device built-ins -----------------------------------------------------------------------------

// Set by the emulator before it resumes a thread (fibers of a block share one OS thread).
extern thread_local uint3 threadIdx;
extern thread_local uint3 blockIdx;
extern thread_local dim3 blockDim;
extern thread_local dim3 gridDim;

inline void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  cuemu::sync_block(file, line);
}

template <typename T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32, const char* file = __builtin_FILE(),
              int line = __builtin_LINE()) {
  (void)width;
  return cuemu::shuffle(mask, v, src & 31, file, line);
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32,
                  const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  (void)width;
  return cuemu::shuffle(mask, v, int(threadIdx.x % 32) ^ lane_mask, file, line);
}
template <typename T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32,
                   const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  (void)width;
  const int src = int(threadIdx.x % 32 + delta);
  return cuemu::shuffle(mask, v, src < 32 ? src : -1, file, line);  // -1: keep own value
}

inline void __nanosleep(unsigned, const char* file = __builtin_FILE(),
                        int line = __builtin_LINE()) {
  cuemu::poll_sleep(file, line);
}

// Byte n of the result is byte (s >> 4n) & 7 of the eight bytes of x (0-3) and y (4-7).
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t bytes = uint64_t(y) << 32 | x;
  unsigned r = 0;
  for (int n = 0; n < 4; ++n) r |= unsigned(bytes >> 8 * (s >> 4 * n & 7) & 0xffu) << 8 * n;
  return r;
}

inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }

template <typename T>
T atomicAdd(T* address, T value) {
  if constexpr (std::is_integral_v<T>) {
    return __atomic_fetch_add(address, value, __ATOMIC_RELAXED);
  } else {
    T old = __atomic_load_n(address, __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n(address, &old, old + value, true, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED)) {
    }
    return old;
  }
}
namespace cuemu {
// Stores `value` at `address` while it beats the value there (beats(value, old)); returns the
// value it found: atomicMax's and atomicMin's compare-and-swap loop.
template <typename T, typename Beats>
T atomic_replace_if(T* address, T value, Beats beats) {
  static_assert(std::is_integral_v<T>, "atomicMax / atomicMin of integers");
  T old = __atomic_load_n(address, __ATOMIC_RELAXED);
  while (beats(value, old) && !__atomic_compare_exchange_n(address, &old, value, true,
                                                           __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  return old;
}
}  // namespace cuemu
template <typename T>
T atomicMax(T* address, T value) {
  return cuemu::atomic_replace_if(address, value, [](T v, T old) { return old < v; });
}
template <typename T>
T atomicMin(T* address, T value) {
  return cuemu::atomic_replace_if(address, value, [](T v, T old) { return v < old; });
}
template <typename T>
T atomicExch(T* address, T value) {
  return __atomic_exchange_n(address, value, __ATOMIC_RELAXED);
}

// Cache-hinted loads and stores: plain accesses (the emulator has no caches to bypass).
template <typename T>
T __ldg(const T* p) { return *p; }
template <typename T>
T __ldcg(const T* p) { return *p; }
template <typename T>
void __stcg(T* p, T v) { *p = v; }

inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }

// CUDA's global min/max overloads (any mix of arithmetic types).
template <typename A, typename B>
std::common_type_t<A, B> min(A a, B b) { return b < a ? b : a; }
template <typename A, typename B>
std::common_type_t<A, B> max(A a, B b) { return a < b ? b : a; }
