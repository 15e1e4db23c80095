// CUDA on the CPU: the runtime behind include/cuda_runtime.h (read its comment first).
//
// Settings, read from the environment at each call so one process can try several:
//   JAXFUSE_EMU_DEVICES          emulated devices as SMSxBLOCKS_PER_SM[xSHARED_KB_PER_SM[xCC]],
//                                comma separated ("4x2"; shared memory: 228 KB an SM, an H100's;
//                                compute capability CC 90, an H100's: programmatic launches
//                                run as such from 90 on)
//   JAXFUSE_EMU_DEVICE           the current device's index (0)
//   JAXFUSE_EMU_SEED             0: threads and blocks run in index order; else a seed for
//                                shuffled schedules (the order fibers resume after each barrier
//                                and the order blocks are taken)
//   JAXFUSE_EMU_WARP_AHEAD       1: the lowest-numbered runnable thread runs first, so one warp
//                                runs ahead of the others until it waits at a block barrier (or
//                                polls: then every runnable thread gets a turn): a thread that
//                                overwrites shared memory the block's other warps have yet to
//                                read is then seen (with the seed's order otherwise)
//   JAXFUSE_EMU_WORKERS          OS threads for a non-cooperative launch (4)
//   JAXFUSE_EMU_DRIVER_VERSION   the emulated driver's CUDA version (CUDART_VERSION; 0: none)
//   JAXFUSE_EMU_FAIL_COOPERATIVE 1: cooperative launches fail as too large (tests error paths)
//   JAXFUSE_EMU_GRID_SYNC_TIMEOUT seconds a grid sync waits, or a thread polls with __nanosleep,
//                                before it reports a deadlock (60)
#include <cuda_runtime.h>
#include <sys/mman.h>
#include <unistd.h>
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#include <algorithm>
#include <map>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define CUEMU_ASAN 1
#else
#define CUEMU_ASAN 0
#endif

// ---- fiber switches ---------------------------------------------------------------------------
// glibc's swapcontext saves and restores the signal mask, a system call on every switch (a
// decoder case switches fibers millions of times): on x86-64 a switch is the callee-saved
// registers and the stack pointer (the SSE and x87 control words are the OS thread's: no kernel
// changes them), elsewhere ucontext.
#if defined(__x86_64__)
// cuemu_switch_stack(save, load): pushes the registers, stores the stack pointer in *save, loads
// `load` (a stack that cuemu_switch_stack itself left, or make_context laid out), pops its
// registers and returns into it.
extern "C" void cuemu_switch_stack(void** save, void* load);
asm(R"(
  .text
  .p2align 4
  .type cuemu_switch_stack, @function
cuemu_switch_stack:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size cuemu_switch_stack, .-cuemu_switch_stack
)");
#endif

namespace cuemu {
namespace {

#if defined(__x86_64__)
struct Context {
  void* sp = nullptr;
};

void switch_context(Context& save, const Context& load) { cuemu_switch_stack(&save.sp, load.sp); }

// A context that starts entry() (which never returns) on the stack [base, base + bytes): the
// frame cuemu_switch_stack pops, over entry's return address (none; and a zero frame pointer,
// where a stack walk ends), entry's stack aligned as at a call.
void make_context(Context& c, char* base, size_t bytes, void (*entry)()) {
  void** sp = reinterpret_cast<void**>(reinterpret_cast<uintptr_t>(base + bytes) & ~uintptr_t(15));
  *--sp = nullptr;
  *--sp = reinterpret_cast<void*>(entry);
  for (int i = 0; i < 6; ++i) *--sp = nullptr;  // rbp, rbx, r12 to r15
  c.sp = sp;
}
#else
struct Context {
  ucontext_t uc{};
};

void switch_context(Context& save, const Context& load) { swapcontext(&save.uc, &load.uc); }

void make_context(Context& c, char* base, size_t bytes, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = base;
  c.uc.uc_stack.ss_size = bytes;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
  // makecontext has laid out the stack; swapcontext does not read uc_stack. ASan's swapcontext
  // interceptor does: it clears the shadow of the target's whole uc_stack on every switch,
  // erasing the redzones of the frames a suspended fiber holds. ASan learns of fiber stacks from
  // the start/finish_switch_fiber calls instead, and give_stack() clears a stack once, when its
  // fiber is done with it.
  c.uc.uc_stack = stack_t{};
}
#endif

}  // namespace
}  // namespace cuemu

thread_local uint3 threadIdx;
thread_local uint3 blockIdx;
thread_local dim3 blockDim;
thread_local dim3 gridDim;

namespace cuemu {
namespace {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr size_t kMaxParamBytes = 32764;  // CUDA 12.1+ on sm_70+
constexpr size_t kStackBytes = 256 * 1024;
constexpr size_t kDefaultDynamicShared = 48 * 1024;  // without cudaFuncSetAttribute
constexpr size_t kReservedSharedPerBlock = 1024;     // the driver's, as on sm_80+
constexpr size_t kGuardBytes = 4096;

// ---- settings -------------------------------------------------------------------------------------

long env_long(const char* name, long fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::strtol(v, nullptr, 10) : fallback;
}

struct Device {
  int sms = 4;
  int blocks_per_sm = 2;
  int shared_kb = 228;  // per SM
  int cc = 90;          // compute capability, major x 10 + minor
};

std::vector<Device> devices() {
  std::vector<Device> out;
  const char* spec = std::getenv("JAXFUSE_EMU_DEVICES");
  std::stringstream ss(spec != nullptr && *spec != '\0' ? spec : "4x2");
  std::string item;
  while (std::getline(ss, item, ',')) {
    Device d;
    if (std::sscanf(item.c_str(), "%dx%dx%dx%d", &d.sms, &d.blocks_per_sm, &d.shared_kb,
                    &d.cc) >= 2 &&
        d.sms > 0 && d.blocks_per_sm > 0 && d.shared_kb > 0 && d.cc > 0) {
      out.push_back(d);
    }
  }
  if (out.empty()) out.push_back(Device{});
  return out;
}

int current_device() { return int(env_long("JAXFUSE_EMU_DEVICE", 0)); }
int driver_version() { return int(env_long("JAXFUSE_EMU_DRIVER_VERSION", CUDART_VERSION)); }

// ---- errors -----------------------------------------------------------------------------------------

thread_local cudaError_t last_error = cudaSuccess;
std::atomic<int> sticky_error{cudaSuccess};  // a kernel fault: every later call fails
std::atomic<long> kernels_enqueued{0};       // enqueued_work()
std::atomic<long> memsets_enqueued{0};

cudaError_t fail(cudaError_t err) {
  last_error = err;
  return err;
}

// What every runtime call checks first, as the real runtime does.
cudaError_t api_entry() {
  if (const int sticky = sticky_error.load()) return fail(cudaError_t(sticky));
  const int driver = driver_version();
  if (driver == 0 || driver / 1000 < CUDART_VERSION / 1000) return fail(cudaErrorInsufficientDriver);
  const int device = current_device();
  if (device < 0 || device >= int(devices().size())) return fail(cudaErrorInvalidDevice);
  return cudaSuccess;
}

// ---- fiber stacks ---------------------------------------------------------------------------------

std::mutex stack_pool_mu;
std::vector<char*> stack_pool;

char* take_stack() {
  {
    std::lock_guard<std::mutex> lock(stack_pool_mu);
    if (!stack_pool.empty()) {
      char* s = stack_pool.back();
      stack_pool.pop_back();
      return s;
    }
  }
  void* m = mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  if (m == MAP_FAILED) {
    std::fprintf(stderr, "cuda_on_cpu: cannot map a fiber stack\n");
    std::abort();
  }
  mprotect(m, kGuardBytes, PROT_NONE);  // a stack overflow faults instead of corrupting
  return static_cast<char*>(m);
}

void give_stack(char* s) {
#if CUEMU_ASAN
  // An abandoned or finished fiber leaves its frames' redzones poisoned.
  __asan_unpoison_memory_region(s + kGuardBytes, kStackBytes - kGuardBytes);
#endif
  std::lock_guard<std::mutex> lock(stack_pool_mu);
  stack_pool.push_back(s);
}

// ---- launches, blocks, fibers ----------------------------------------------------------------------

enum class Wait { kRunnable, kBlockSync, kWarpSync, kGridSync, kDependency, kExited, kAborted };

// A result buffer of the current FFI call (watch_memory()): its bytes before the launch running
// now, and which of them the launches since the last plain launch (or memset) have written.
struct WatchedRegion {
  unsigned char* data;
  size_t bytes;
  std::vector<unsigned char> before;
  std::vector<unsigned char> chain_wrote;
};
thread_local std::vector<WatchedRegion> watched;  // the launching thread's call

struct Fiber {
  Context ctx;
  char* stack = nullptr;
  uint3 tid{};
  int linear = 0;
  Wait wait = Wait::kRunnable;
  const char* file = "";
  int line = 0;
  void* fake_stack = nullptr;
  long barriers = 0;       // barriers passed (a poll that spans one is a new poll)
  bool polled = false;     // its last pause was a poll (__nanosleep)
  long poll_barriers = -1;  // `barriers` when the current poll began (-1: none)
  std::chrono::steady_clock::time_point poll_start;
  // cp.async: the copies issued and not yet waited for, and the commit groups closed so far.
  struct AsyncCopy {
    void* dst;
    const void* src;
    size_t bytes, zfill;
    long group;
  };
  std::vector<AsyncCopy> async_copies;
  long async_groups = 0;
};

struct WarpState {
  int arrived = 0;
  long gen = 0;
  uint64_t slots[2][kWarpSize] = {};  // values of generation gen % 2
};

struct Launch {
  const std::function<void()>* body;
  std::string kernel;
  dim3 grid, block;
  bool cooperative;
  long seed;
  bool warp_ahead;
  int total_blocks;
  size_t dynamic_shared = 0;
  std::chrono::seconds grid_timeout{60};

  std::mutex mu;
  std::condition_variable cv;
  int grid_arrived = 0;
  long grid_gen = 0;
  int blocks_exited = 0;
  std::atomic<bool> aborted{false};
  std::string fault;
  // A programmatic launch's: the launching thread's watched results, their bytes as its blocks
  // see them before the wait (the chain's writes poisoned), and the blocks at the wait.
  bool programmatic = false;
  std::vector<WatchedRegion>* regions = nullptr;
  std::vector<std::vector<unsigned char>> poisoned;
  int dependency_arrived = 0;
  std::atomic<bool> dependency_resolved{false};

  void set_fault(const std::string& msg) {
    std::lock_guard<std::mutex> lock(mu);
    set_fault_locked(msg);
  }
  void set_fault_locked(const std::string& msg) {
    if (fault.empty()) fault = msg;
    aborted = true;
    cv.notify_all();
  }

  // The wait's end (mu held), once every block waits or has exited: a store before it to the
  // watched results is a fault; their true bytes are put back.
  void resolve_dependency() {
    if (dependency_resolved) return;
    for (size_t i = 0; regions != nullptr && i < regions->size(); ++i) {
      WatchedRegion& r = (*regions)[i];
      if (std::memcmp(r.data, poisoned[i].data(), r.bytes) != 0) {
        size_t at = 0;
        while (r.data[at] == poisoned[i][at]) ++at;
        set_fault_locked("a store to the call's results (byte " + std::to_string(at) +
                         " of a " + std::to_string(r.bytes) + "-byte result) before "
                         "griddepcontrol.wait in a programmatic launch: it may overtake the "
                         "launches before, which may still run");
      }
      std::memcpy(r.data, r.before.data(), r.bytes);
    }
    dependency_resolved = true;
    cv.notify_all();
  }
};

struct Block {
  Launch* launch = nullptr;
  uint3 bid{};
  std::vector<Fiber> fibers;
  std::vector<WarpState> warps;
  Context scheduler;
  Fiber* current = nullptr;
  size_t runnable_from = 0;  // no fiber before it is runnable: where warp-ahead's search starts
  const void* scheduler_stack = nullptr;
  size_t scheduler_stack_size = 0;
  std::vector<unsigned char> dynamic_shared;  // malloc's alignment: 16 bytes
};

thread_local Block* this_block = nullptr;

Fiber& this_fiber() {
  if (this_block == nullptr || this_block->current == nullptr) {
    std::fprintf(stderr, "cuda_on_cpu: a device built-in was called outside a kernel\n");
    std::abort();
  }
  return *this_block->current;
}

std::string where(const char* file, int line) {
  const char* slash = std::strrchr(file, '/');
  return std::string(slash ? slash + 1 : file) + ":" + std::to_string(line);
}

// Fiber -> scheduler. Returns when the scheduler resumes this fiber.
void yield_to_scheduler(Fiber& f) {
  Block& b = *this_block;
#if CUEMU_ASAN
  __sanitizer_start_switch_fiber(f.wait == Wait::kExited || f.wait == Wait::kAborted ? nullptr : &f.fake_stack,
                                 b.scheduler_stack, b.scheduler_stack_size);
#endif
  switch_context(f.ctx, b.scheduler);
#if CUEMU_ASAN
  __sanitizer_finish_switch_fiber(f.fake_stack, &b.scheduler_stack, &b.scheduler_stack_size);
#endif
}

// A kernel fault: the launch is abandoned (the faulting fiber is never resumed).
[[noreturn]] void fault(const std::string& msg) {
  Fiber& f = this_fiber();
  Block& b = *this_block;
  std::ostringstream os;
  os << msg << " [block (" << b.bid.x << "," << b.bid.y << "," << b.bid.z << "), thread (" << f.tid.x
     << "," << f.tid.y << "," << f.tid.z << ")]";
  b.launch->set_fault(os.str());
  f.wait = Wait::kAborted;
  yield_to_scheduler(f);
  std::abort();  // unreachable: aborted fibers are not resumed
}

void fiber_main() {
  Block& b = *this_block;
  Fiber& f = *b.current;
#if CUEMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &b.scheduler_stack, &b.scheduler_stack_size);
#endif
  (*b.launch->body)();
  f.wait = Wait::kExited;
  yield_to_scheduler(f);
  std::abort();  // unreachable
}

void resume(Block& b, Fiber& f) {
  b.current = &f;
  threadIdx = f.tid;
#if CUEMU_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, f.stack + kGuardBytes, kStackBytes - kGuardBytes);
#endif
  switch_context(b.scheduler, f.ctx);
#if CUEMU_ASAN
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
  b.current = nullptr;
}

std::string describe_waits(const Block& b) {
  std::ostringstream os;
  int exited = 0, block_sync = 0, grid_sync = 0, warp_sync = 0, dependency = 0;
  std::string block_at, grid_at, warp_at;
  for (const Fiber& f : b.fibers) {
    switch (f.wait) {
      case Wait::kExited: ++exited; break;
      case Wait::kDependency: ++dependency; break;
      case Wait::kBlockSync: ++block_sync; block_at = where(f.file, f.line); break;
      case Wait::kGridSync: ++grid_sync; grid_at = where(f.file, f.line); break;
      case Wait::kWarpSync: ++warp_sync; warp_at = where(f.file, f.line); break;
      default: break;
    }
  }
  os << block_sync << " threads at __syncthreads" << (block_sync ? " (" + block_at + ")" : "") << ", "
     << warp_sync << " at a warp shuffle" << (warp_sync ? " (" + warp_at + ")" : "") << ", "
     << grid_sync << " at grid sync" << (grid_sync ? " (" + grid_at + ")" : "") << ", "
     << dependency << " at griddepcontrol.wait, " << exited << " exited, of " << b.fibers.size();
  return os.str();
}

// All threads of the block wait at one barrier: check it is the same one, then release them.
bool release_barrier(Block& b, Wait kind, std::string* error) {
  const Fiber& first = b.fibers.front();
  for (const Fiber& f : b.fibers) {
    if (std::strcmp(f.file, first.file) != 0 || f.line != first.line) {
      *error = "barrier divergence: threads wait at different barriers (" + where(first.file, first.line) +
               " and " + where(f.file, f.line) + ")";
      return false;
    }
  }
  if (kind == Wait::kGridSync) {
    Launch& L = *b.launch;
    const auto at = [&] { return "grid sync at " + where(first.file, first.line); };
    const auto blocks_exited = [&] {
      return at() + " cannot complete: " + std::to_string(L.blocks_exited) + " blocks exited";
    };
    std::unique_lock<std::mutex> lock(L.mu);
    if (L.blocks_exited > 0) {
      *error = blocks_exited();
      return false;
    }
    const long gen = L.grid_gen;
    if (++L.grid_arrived == L.total_blocks) {
      L.grid_arrived = 0;
      ++L.grid_gen;
      L.cv.notify_all();
    } else {
      const bool woke = L.cv.wait_for(lock, L.grid_timeout, [&] {
        return L.grid_gen != gen || L.aborted.load() || L.blocks_exited > 0;
      });
      if (L.grid_gen == gen) {
        if (L.aborted) return false;
        *error = woke ? blocks_exited() : at() + " timed out: deadlock";
        return false;
      }
    }
  }
  for (Fiber& f : b.fibers) f.wait = Wait::kRunnable;
  b.runnable_from = 0;
  return true;
}

// Every thread of the block that has not exited waits at griddepcontrol.wait: the block arrives
// at its launch's wait, which ends when every block has arrived or exited (resolve_dependency),
// then its threads go on.
bool release_dependency(Block& b, std::string* error) {
  Launch& L = *b.launch;
  std::unique_lock<std::mutex> lock(L.mu);
  if (!L.dependency_resolved) {
    if (++L.dependency_arrived + L.blocks_exited == L.total_blocks) {
      L.resolve_dependency();
    } else {
      const bool woke = L.cv.wait_for(lock, L.grid_timeout, [&] {
        return L.dependency_resolved.load() || L.aborted.load();
      });
      if (!L.dependency_resolved) {
        if (!L.aborted && !woke) *error = "griddepcontrol.wait timed out: deadlock (a block "
                                          "that polls before its wait?)";
        return false;
      }
    }
  }
  b.runnable_from = 0;
  for (Fiber& f : b.fibers) {
    if (f.wait == Wait::kDependency) f.wait = Wait::kRunnable;
  }
  return true;
}

// The block's threads as fibers, each at the start of the kernel body.
void make_fibers(Block& b, const dim3& block) {
  const int threads = int(block.x * block.y * block.z);
  b.fibers.resize(threads);
  b.warps.resize((threads + kWarpSize - 1) / kWarpSize);
  for (int i = 0; i < threads; ++i) {
    Fiber& f = b.fibers[i];
    f.linear = i;
    f.tid = uint3{unsigned(i % block.x), unsigned(i / block.x % block.y),
                  unsigned(i / (block.x * block.y))};
    f.stack = take_stack();
    make_context(f.ctx, f.stack + kGuardBytes, kStackBytes - kGuardBytes, fiber_main);
  }
}

// When no fiber can run: "" if all exited (the block is done); otherwise releases the barrier
// every fiber waits at and returns "" to go on, or says why it cannot (a deadlock, a fault).
std::string settle_block(Block& b, bool* done) {
  int exited = 0, block_sync = 0, grid_sync = 0, dependency = 0;
  for (const Fiber& f : b.fibers) {
    exited += f.wait == Wait::kExited;
    block_sync += f.wait == Wait::kBlockSync;
    grid_sync += f.wait == Wait::kGridSync;
    dependency += f.wait == Wait::kDependency;
  }
  const int threads = int(b.fibers.size());
  *done = exited == threads;
  if (*done) return "";
  if (dependency > 0 && dependency + exited == threads) {
    std::string error;
    if (!release_dependency(b, &error)) {
      *done = true;
      return error;
    }
    return "";
  }
  const Wait kind = block_sync == threads ? Wait::kBlockSync
                    : grid_sync == threads ? Wait::kGridSync
                                           : Wait::kRunnable;
  if (kind == Wait::kRunnable) return "deadlock: " + describe_waits(b);
  std::string error;
  if (!release_barrier(b, kind, &error)) {
    *done = true;
    return error;
  }
  return "";
}

// Runs the block's fibers round-robin (shuffled per round when the launch has a seed) until all
// exit; returns the block's fault, or "".
std::string schedule_block(Launch& L, Block& b) {
  const uint3 bid = b.bid;
  std::mt19937_64 rng(uint64_t(L.seed) * 0x9e3779b97f4a7c15ull + bid.x * 7919u + bid.y * 104729u + bid.z);
  std::vector<int> order(b.fibers.size());
  std::iota(order.begin(), order.end(), 0);
  while (!L.aborted) {
    if (L.warp_ahead) {
      const auto first = std::find_if(b.fibers.begin() + b.runnable_from, b.fibers.end(),
                                      [](const Fiber& f) { return f.wait == Wait::kRunnable; });
      b.runnable_from = size_t(first - b.fibers.begin());
      if (first != b.fibers.end()) {
        resume(b, *first);
        if (!first->polled) continue;  // a poller: a pass over every thread, below
      }
    }
    if (L.seed != 0) std::shuffle(order.begin(), order.end(), rng);
    bool ran = false;
    for (int i : order) {
      if (b.fibers[i].wait != Wait::kRunnable) continue;
      resume(b, b.fibers[i]);
      ran = true;
      if (L.aborted) break;
    }
    if (ran || L.aborted) continue;
    bool done = false;
    std::string error = settle_block(b, &done);
    if (!error.empty() || done) return error;
  }
  return "";
}

void run_block(Launch& L, uint3 bid) {
  Block b;
  b.launch = &L;
  b.bid = bid;
  b.dynamic_shared.assign(L.dynamic_shared, 0xff);
  make_fibers(b, L.block);
  this_block = &b;
  blockIdx = bid;
  blockDim = L.block;
  gridDim = L.grid;
  const std::string error = schedule_block(L, b);
  if (!error.empty()) {
    std::ostringstream os;
    os << error << " [block (" << bid.x << "," << bid.y << "," << bid.z << ")]";
    L.set_fault(os.str());
  }
  {
    std::lock_guard<std::mutex> lock(L.mu);
    ++L.blocks_exited;
    if (L.programmatic && L.dependency_arrived > 0 &&
        L.dependency_arrived + L.blocks_exited == L.total_blocks) {
      L.resolve_dependency();
    }
    L.cv.notify_all();
  }
  this_block = nullptr;
  for (Fiber& f : b.fibers) give_stack(f.stack);
}

uint3 block_of(const dim3& grid, int i) {
  return uint3{unsigned(i % grid.x), unsigned(i / grid.x % grid.y), unsigned(i / (grid.x * grid.y))};
}

// Short kernel name from __PRETTY_FUNCTION__ of the launch template.
std::string kernel_name(const char* pretty) {
  std::string s(pretty);
  const size_t at = s.find("ExpTypes = {");
  return at == std::string::npos ? s : s.substr(at, std::min<size_t>(160, s.size() - at));
}

long shared_per_sm() { return long(devices()[std::max(0, current_device())].shared_kb) * 1024; }
long shared_per_block_optin() { return shared_per_sm() - long(kReservedSharedPerBlock); }

// cudaFuncSetAttribute's limits, per kernel and device (as each device's context has its own).
std::mutex dynamic_shared_mu;
std::map<std::pair<const void*, int>, size_t> dynamic_shared_limits;

size_t max_dynamic_shared(const void* entry) {
  std::lock_guard<std::mutex> lock(dynamic_shared_mu);
  const auto it = dynamic_shared_limits.find({entry, current_device()});
  return it == dynamic_shared_limits.end() ? kDefaultDynamicShared : it->second;
}

// Why a launch configuration cannot run (as the CUDA runtime would refuse it), or cudaSuccess.
cudaError_t check_launch(const cudaLaunchConfig_t& config, size_t param_bytes, const void* entry,
                         bool cooperative) {
  const dim3 g = config.gridDim, t = config.blockDim;
  const long total_blocks = long(g.x) * g.y * g.z;
  const long threads = long(t.x) * t.y * t.z;
  if (total_blocks < 1 || threads < 1 || threads > 1024) return cudaErrorInvalidConfiguration;
  if (config.dynamicSmemBytes > max_dynamic_shared(entry)) {
    std::fprintf(stderr, "cuda_on_cpu: %zu bytes of dynamic shared memory (the kernel's limit: %zu)\n",
                 config.dynamicSmemBytes, max_dynamic_shared(entry));
    return cudaErrorInvalidValue;
  }
  if (threads % kWarpSize != 0) {
    std::fprintf(stderr, "cuda_on_cpu: blocks of %ld threads: only whole warps are emulated\n", threads);
    return cudaErrorInvalidConfiguration;
  }
  if (param_bytes > kMaxParamBytes) {
    std::fprintf(stderr, "cuda_on_cpu: %zu bytes of kernel parameters (limit %zu)\n", param_bytes,
                 kMaxParamBytes);
    return cudaErrorInvalidValue;
  }
  if (cooperative) {
    const Device d = devices()[current_device()];
    if (env_long("JAXFUSE_EMU_FAIL_COOPERATIVE", 0) != 0 || total_blocks > long(d.sms) * d.blocks_per_sm) {
      return cudaErrorCooperativeLaunchTooLarge;
    }
  }
  return cudaSuccess;
}

// Runs every block of L on worker threads (all blocks at once when cooperative, so a grid sync
// has every block resident), in a shuffled order when the launch has a seed.
void run_blocks(Launch& L) {
  const int total_blocks = L.total_blocks;
  std::vector<int> block_order(total_blocks);
  std::iota(block_order.begin(), block_order.end(), 0);
  if (L.seed != 0) std::shuffle(block_order.begin(), block_order.end(), std::mt19937_64(L.seed));
  const int workers = L.cooperative || L.programmatic ? total_blocks
                                    : int(std::clamp<long>(env_long("JAXFUSE_EMU_WORKERS", 4), 1, total_blocks));
  std::atomic<int> next{0};
  std::vector<std::thread> pool;
  pool.reserve(workers);
  for (int w = 0; w < workers; ++w) {
    pool.emplace_back([&] {
      for (int i = next.fetch_add(1); i < total_blocks && !L.aborted; i = next.fetch_add(1)) {
        run_block(L, block_of(L.grid, block_order[i]));
      }
    });
  }
  for (std::thread& th : pool) th.join();
}

// The byte loops over a call's results (a decoder's cache is most of its bytes) are left
// uninstrumented: their bounds are the regions' own, and ASan's check of every byte would cost
// more than the launch.
__attribute__((no_sanitize("address"))) void poison_chain_writes(WatchedRegion& r) {
  for (size_t i = 0; i < r.bytes; ++i) {
    if (r.chain_wrote[i]) r.data[i] = 0xff;
  }
}

__attribute__((no_sanitize("address"))) void note_launch_writes(WatchedRegion& r) {
  for (size_t i = 0; i < r.bytes; ++i) r.chain_wrote[i] |= r.data[i] != r.before[i];
}

// Before a launch: the watched results' bytes (what the launch finds), and for a programmatic
// one, the bytes the chain of launches since the last plain one wrote poisoned until its wait.
void watch_launch(Launch& L) {
  if (watched.empty()) return;
  L.regions = &watched;
  for (WatchedRegion& r : watched) {
    if (!L.programmatic) std::fill(r.chain_wrote.begin(), r.chain_wrote.end(), 0);
    r.before.assign(r.data, r.data + r.bytes);
    if (!L.programmatic) continue;
    poison_chain_writes(r);
    L.poisoned.emplace_back(r.data, r.data + r.bytes);
  }
}

}  // namespace

// ---- the runtime API ---------------------------------------------------------------------------------

cudaError_t launch(const cudaLaunchConfig_t& config, size_t param_bytes, const void* entry,
                   const char* kernel, const std::function<void()>& body) {
  if (const cudaError_t err = api_entry()) return err;
  bool cooperative = false, programmatic = false;
  for (unsigned i = 0; i < config.numAttrs; ++i) {
    if (config.attrs[i].id == cudaLaunchAttributeCooperative) cooperative = config.attrs[i].val.cooperative != 0;
    if (config.attrs[i].id == cudaLaunchAttributeProgrammaticStreamSerialization) {
      programmatic = config.attrs[i].val.programmaticStreamSerializationAllowed != 0;
    }
  }
  // Before compute capability 9.0 a programmatic launch waits for the one before, as any does.
  programmatic = programmatic && devices()[current_device()].cc >= 90;
  if (const cudaError_t err = check_launch(config, param_bytes, entry, cooperative)) return fail(err);
  Launch L;
  L.body = &body;
  L.kernel = kernel_name(kernel);
  L.grid = config.gridDim;
  L.block = config.blockDim;
  L.cooperative = cooperative;
  L.seed = env_long("JAXFUSE_EMU_SEED", 0);
  L.warp_ahead = env_long("JAXFUSE_EMU_WARP_AHEAD", 0) != 0;
  L.total_blocks = int(long(L.grid.x) * L.grid.y * L.grid.z);
  L.dynamic_shared = config.dynamicSmemBytes;
  L.grid_timeout = std::chrono::seconds(env_long("JAXFUSE_EMU_GRID_SYNC_TIMEOUT", 60));
  L.programmatic = programmatic;
  watch_launch(L);
  run_blocks(L);
  {
    std::lock_guard<std::mutex> lock(L.mu);
    if (L.programmatic) L.resolve_dependency();  // no block waited: the end is the wait's
  }
  for (WatchedRegion& r : watched) note_launch_writes(r);
  if (!L.fault.empty()) {
    std::fprintf(stderr, "cuda_on_cpu: kernel fault in %s: %s\n", L.kernel.c_str(), L.fault.c_str());
    sticky_error = cudaErrorLaunchFailure;
    return fail(cudaErrorLaunchFailure);
  }
  kernels_enqueued.fetch_add(1);
  return cudaSuccess;
}

EnqueuedWork enqueued_work() { return {kernels_enqueued.load(), memsets_enqueued.load()}; }

cudaError_t set_max_dynamic_shared(const void* entry, int bytes) {
  if (const cudaError_t err = api_entry()) return err;
  if (bytes < 0 || bytes > shared_per_block_optin()) return fail(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lock(dynamic_shared_mu);
  dynamic_shared_limits[{entry, current_device()}] = size_t(bytes);
  return cudaSuccess;
}

char* dynamic_shared_memory() {
  this_fiber();  // inside a kernel
  return reinterpret_cast<char*>(this_block->dynamic_shared.data());
}

void async_copy(void* dst, const void* src, size_t bytes, size_t zfill) {
  Fiber& f = this_fiber();
  const auto misaligned = [&](const void* p) { return reinterpret_cast<uintptr_t>(p) % bytes != 0; };
  if ((bytes != 4 && bytes != 8 && bytes != 16) || zfill > bytes || misaligned(dst) ||
      (zfill < bytes && misaligned(src))) {
    fault("cp.async of " + std::to_string(bytes) + " bytes (zfill " + std::to_string(zfill) +
          "): a size of 4, 8 or 16 bytes, both addresses aligned to it");
  }
  std::memset(dst, 0xff, bytes);
  f.async_copies.push_back({dst, src, bytes, zfill, f.async_groups});
}

void async_commit() { ++this_fiber().async_groups; }

void async_wait_prior(size_t groups) {
  Fiber& f = this_fiber();
  const long done = f.async_groups - long(groups);  // groups before this one have landed
  auto& copies = f.async_copies;
  auto keep = copies.begin();
  for (Fiber::AsyncCopy& c : copies) {
    if (c.group < done) {
      std::memcpy(c.dst, c.src, c.bytes - c.zfill);
      std::memset(static_cast<char*>(c.dst) + (c.bytes - c.zfill), 0, c.zfill);
    } else {
      *keep++ = c;
    }
  }
  copies.erase(keep, copies.end());
}

int blocks_per_sm() { return devices()[std::max(0, current_device())].blocks_per_sm; }


void sync_block(const char* file, int line) {
  Fiber& f = this_fiber();
  ++f.barriers;
  f.wait = Wait::kBlockSync;
  f.file = file;
  f.line = line;
  yield_to_scheduler(f);
}

void grid_dependency_wait(const char* file, int line) {
  Fiber& f = this_fiber();
  const Launch& L = *this_block->launch;
  if (!L.programmatic || L.dependency_resolved) return;
  ++f.barriers;
  f.wait = Wait::kDependency;
  f.file = file;
  f.line = line;
  yield_to_scheduler(f);
}

void watch_memory(void* data, size_t bytes) {
  if (bytes == 0) return;
  watched.push_back({static_cast<unsigned char*>(data), bytes, {}, std::vector<unsigned char>(bytes, 0)});
}

void unwatch_memory() { watched.clear(); }

void sync_grid(const char* file, int line) {
  Fiber& f = this_fiber();
  if (!this_block->launch->cooperative) fault("grid sync at " + where(file, line) + " in a non-cooperative launch");
  ++f.barriers;
  std::atomic_thread_fence(std::memory_order_seq_cst);
  f.wait = Wait::kGridSync;
  f.file = file;
  f.line = line;
  yield_to_scheduler(f);
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

// A thread polling memory that another thread writes: it lets the block's other threads run
// (the writer may be one of them, past a barrier this one has left) and the OS thread yield (or
// another block, waiting for a core). Polls since the thread's last barrier count as one; one
// that outlasts the launch's timeout is a deadlock (a counter that never reaches its target), and
// a poll in an abandoned launch ends its fiber.
void poll_sleep(const char* file, int line) {
  Fiber& f = this_fiber();
  Launch& L = *this_block->launch;
  if (L.aborted) {
    f.wait = Wait::kAborted;
    yield_to_scheduler(f);
    std::abort();  // unreachable: aborted fibers are not resumed
  }
  const auto now = std::chrono::steady_clock::now();
  if (f.poll_barriers != f.barriers) {
    f.poll_barriers = f.barriers;
    f.poll_start = now;
  } else if (now - f.poll_start > L.grid_timeout) {
    fault("deadlock: polled at " + where(file, line) + " for " +
          std::to_string(L.grid_timeout.count()) + " s (a counter that never reaches its target?)");
  }
  f.file = file;
  f.line = line;
  f.polled = true;
  yield_to_scheduler(f);  // still runnable: the scheduler resumes it after the others
  f.polled = false;
  std::this_thread::yield();
}

// One collective exchange among the 32 lanes of a warp: every lane deposits `bits`, waits for
// the others, and reads lane `src_lane`'s value (its own when src_lane < 0). Two alternating slot
// sets let a fast lane deposit for the next exchange while a slow one still reads this one.
uint64_t warp_exchange(unsigned mask, uint64_t bits, int src_lane, const char* file, int line) {
  Fiber& f = this_fiber();
  if (mask != kFullMask) fault("warp shuffle at " + where(file, line) + " with a partial mask (not emulated)");
  Block& b = *this_block;
  WarpState& w = b.warps[f.linear / kWarpSize];
  const int lane = f.linear % kWarpSize;
  const long gen = w.gen;
  ++f.barriers;
  w.slots[gen & 1][lane] = bits;
  f.file = file;
  f.line = line;
  if (++w.arrived == kWarpSize) {  // last lane in: release the warp, keep running
    w.arrived = 0;
    ++w.gen;
    const int first = (f.linear / kWarpSize) * kWarpSize;
    for (int i = 0; i < kWarpSize; ++i) {
      Fiber& other = b.fibers[first + i];
      if (&other != &f) other.wait = Wait::kRunnable;
    }
    b.runnable_from = std::min(b.runnable_from, size_t(first));
  } else {
    f.wait = Wait::kWarpSync;
    yield_to_scheduler(f);
  }
  return src_lane < 0 ? bits : w.slots[gen & 1][src_lane];
}

}  // namespace cuemu

// ---- C API ----------------------------------------------------------------------------------------------

cudaError_t cudaGetDevice(int* device) {
  if (const cudaError_t err = cuemu::api_entry()) return err;
  *device = cuemu::current_device();
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (const cudaError_t err = cuemu::api_entry()) return err;
  const std::vector<cuemu::Device> devs = cuemu::devices();
  if (device < 0 || device >= int(devs.size())) return cuemu::fail(cudaErrorInvalidDevice);
  switch (attr) {
    case cudaDevAttrMultiProcessorCount: *value = devs[device].sms; return cudaSuccess;
    case cudaDevAttrCooperativeLaunch: *value = 1; return cudaSuccess;
    case cudaDevAttrComputeCapabilityMajor: *value = devs[device].cc / 10; return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor: *value = devs[device].cc % 10; return cudaSuccess;
    case cudaDevAttrMaxThreadsPerBlock: *value = 1024; return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor: *value = int(cuemu::shared_per_sm()); return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *value = int(cuemu::shared_per_block_optin());
      return cudaSuccess;
  }
  return cuemu::fail(cudaErrorInvalidValue);
}

cudaError_t cudaGetLastError() {
  const cudaError_t err = cuemu::last_error;
  if (const int sticky = cuemu::sticky_error.load()) return cudaError_t(sticky);
  cuemu::last_error = cudaSuccess;
  return err;
}

cudaError_t cudaPeekAtLastError() {
  if (const int sticky = cuemu::sticky_error.load()) return cudaError_t(sticky);
  return cuemu::last_error;
}

const char* cudaGetErrorName(cudaError_t err) {
  switch (err) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInsufficientDriver: return "cudaErrorInsufficientDriver";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorLaunchOutOfResources: return "cudaErrorLaunchOutOfResources";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorCooperativeLaunchTooLarge: return "cudaErrorCooperativeLaunchTooLarge";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
  }
  return "cudaErrorUnknown";
}

const char* cudaGetErrorString(cudaError_t err) {
  switch (err) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInsufficientDriver: return "CUDA driver version is insufficient for CUDA runtime version";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    case cudaErrorCooperativeLaunchTooLarge: return "too many blocks in cooperative launch";
    case cudaErrorNotSupported: return "operation not supported";
  }
  return "unknown error";
}

cudaError_t cudaDriverGetVersion(int* version) {
  *version = cuemu::driver_version();
  return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int* version) {
  *version = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t) {
  if (const cudaError_t err = cuemu::api_entry()) return err;
  std::memset(ptr, value, bytes);
  // A kernel after a memset waits for it: the chain of programmatic launches starts anew.
  for (cuemu::WatchedRegion& r : cuemu::watched) std::fill(r.chain_wrote.begin(), r.chain_wrote.end(), 0);
  cuemu::memsets_enqueued.fetch_add(1);
  return cudaSuccess;
}
