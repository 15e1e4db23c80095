# Sourced by tools/sanitize.sh and tools/cuda_on_cpu.sh: developer builds of the native modules
# outside the package (CMake directly, own build directories), and how to run Python with them.

# Configures and builds in $1 from source root $2; any further arguments go to CMake.
# Sanitizers (ASan + UBSan) and a Debug build with asserts on (at -O0: the checks' run time is
# XLA's compiles, under ASan's allocator, not the handlers' loops, and -O1 only lengthens the
# compile of the emulated CUDA sources; line tables only, -g1, which is what a sanitizer's stack
# trace shows, at less compile time; the CPU handlers' hot loops for this machine's ISA only:
# CMakeLists.txt, JAXFUSE_SANITIZE) always; the CUDA sources are compiled for the host as well
# (tools/cuda_on_cpu), with nvcc or without.
dev_build() {
  local dir="$1" src="$2"; shift 2
  mkdir -p "$(dirname "$dir")"
  python3 -c "import nanobind" 2>/dev/null || python3 -m pip install --quiet "nanobind>=2.4"
  command -v ninja >/dev/null 2>&1 || python3 -m pip install --quiet ninja
  cmake -S "$src" -B "$dir" -G Ninja -DSKBUILD_PROJECT_NAME=jaxfuse \
    -DPython_EXECUTABLE="$(command -v python3)" -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-g1 -O0" \
    -DJAXFUSE_CUDA=OFF -DJAXFUSE_CUDA_ON_CPU=ON -DJAXFUSE_SANITIZE=ON "$@" >"$dir.configure.log" 2>&1 \
    || { cat "$dir.configure.log"; return 1; }
  # DEV_TARGETS: only these targets (default: all).
  cmake --build "$dir" --parallel "${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" ${DEV_TARGETS:+--target $DEV_TARGETS}
}

# Runs a command (python3 ...) with the modules of build directory $1 and the sanitizer runtime.
with_dev_build() {
  local dir="$1"; shift
  # The extension is sanitized, python3 is not: the ASan runtime must be loaded first, and
  # libstdc++ with it (ASan's C++-exception interceptor binds at start-up; jaxlib throws).
  LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libstdc++.so)" \
  ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:malloc_context_size=4:${ASAN_OPTIONS:-}" \
  UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}" \
  JAXFUSE_EXTENSION_DIR="$(cd "$dir" && pwd)" PYTHONUNBUFFERED=1 "$@"
}
