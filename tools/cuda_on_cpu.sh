#!/usr/bin/env bash
# CUDA on the CPU: compiles jaxfuse's real CUDA sources (csrc/*/cuda/*.cu) as host C++ against
# tools/cuda_on_cpu, a small CPU implementation of the CUDA runtime (each CUDA thread a fiber,
# each block an OS thread, barriers that detect deadlock), with ASan + UBSan, and runs the real
# CUDA handlers on the CPU. Stages (STAGES="driver emu" picks some; the default, which CI runs, is
# "driver emu"; STAGES=all adds "suite", about 10 more minutes on 2 cores, and "controls", about
# 8: run the controls after changing tools/cuda_on_cpu or tests/test_cuda_on_cpu.py):
#   driver    the multi-tensor driver on hand-made tensor lists (exact-size buffers, misaligned
#             bases), polling across blocks and programmatic launches' waits, plus five planted
#             synchronization faults the emulator must report; the decoder's 8-bit weight
#             widening on every pair of codes
#   emu       tests/test_cuda_on_cpu.py: every op and mode against the CPU handlers (bitwise where
#             the math is element-wise), several emulated grid sizes, in-order and shuffled
#             schedules; with the default constants and with tables, chunks and slices shrunk
#             so that the multi-launch and tensor-slicing paths run on small buffers
#   suite     the whole test suite with the emulated CUDA handlers in place of the CPU ones
#   controls  planted bugs in the real sources (a tail overrun, a wrong last-block counter, a
#             decoder wait that ends at a group's first arrival instead of its finish, a GEMV
#             group marked finished after its first batch row instead of all, a missing
#             __syncthreads, a top-k / top-p walk that reads the row's search after one thread
#             may have rewritten it, a weight-ring slab used without waiting for its copies, a
#             ring slot refilled before every warp is done with it, a stage kernel that reads its
#             input before it waits for the launch before) must each make a check fail
# Exit status 0 when every check passes and (with controls) every planted bug is caught.
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/dev_build.sh
STAGES="${STAGES:-driver emu}"
[ "$STAGES" = all ] && STAGES="driver emu suite controls"
BUILD=build/dev-sanitize        # shared with tools/sanitize.sh
SMALL=build/dev-cuda-on-cpu-small
SMALL_DEFINES="JAXFUSE_MT_CHUNK=128;JAXFUSE_MT_TABLE_BYTES=600;JAXFUSE_MT_MAX_SLICE_CHUNKS=3"
# The small build holds the ops whose checks run on it (the emu stage's selection below): Adam,
# the clip, and LAMB with the trust-ratio families' first pass.
SMALL_SOURCES="adam;clip;lamb;trust_sums"
# The controls' build runs no quantized decoder: its int8 / fp8 kernels are left out, two thirds
# of decoder.cu's compile time.
UNQUANTIZED_DECODER="JAXFUSE_DECODER_QUANTIZED_KERNELS=0"
EMU_TARGETS="_jaxfuse_cuda_on_cpu cuda_on_cpu_multi_tensor_test"
has_stage() { [[ " $STAGES " == *" $1 "* ]]; }
t0=$(date +%s)
stamp() { echo "== cuda_on_cpu [$(( $(date +%s) - t0 ))s]: $*"; }

stamp "build (default constants: $BUILD)"
dev_build "$BUILD" .
stamp "build (small tables, chunks and slices: $SMALL)"
DEV_TARGETS="$EMU_TARGETS" dev_build "$SMALL" . "-DJAXFUSE_CUDA_ON_CPU_DEFINES=$SMALL_DEFINES" \
  "-DJAXFUSE_CUDA_ON_CPU_SOURCES=$SMALL_SOURCES"
cp "$BUILD"/_jaxfuse_cpu.*.so "$SMALL"/  # the CPU handlers to compare against

emu_tests() {  # BUILD_DIR [pytest args]: tests/test_cuda_on_cpu.py against that build
  local dir="$1"; shift
  with_dev_build "$dir" env JAXFUSE_REQUIRE_CUDA_ON_CPU=1 \
    python3 -m pytest -q -n auto -p no:cacheprovider tests/test_cuda_on_cpu.py "$@"
}

if has_stage driver; then
  for dir in "$BUILD" "$SMALL"; do
    stamp "driver ($dir)"
    with_dev_build "$dir" "$dir/cuda_on_cpu_multi_tensor_test"
    for fault in divergent_sync grid_sync grid_sync_after_exit poll_forever store_before_wait; do
      with_dev_build "$dir" "$dir/cuda_on_cpu_multi_tensor_test" "$fault" 2>/dev/null
    done
  done
  with_dev_build "$BUILD" "$BUILD/cuda_on_cpu_decoder_widen_test"
fi

if has_stage emu; then
  stamp "CUDA handlers vs CPU handlers ($BUILD)"
  emu_tests "$BUILD"
  stamp "CUDA handlers vs CPU handlers ($SMALL)"
  # The decoder does not use the multi-tensor constants, and the tables' and slices' boundaries
  # do not depend on the grid: each case runs here once, on its launch of the default build (a
  # test run on every launch there, on its shuffled ones and the 16-block grid here). The
  # element-wise families (test_element_family_bitwise, and SGD's precision modes) are functors
  # on the driver whose tables, chunks and slices Adam's cases (up to five tensor lists, mixed
  # dtypes, stochastic rounding, 8-bit states) cross here, and LAMB's cases the trust-ratio
  # families' first pass; the default build runs them all.
  small="not decoder and not element_family and not _sgd and not muon"
  small+=" and (not trust_ratio_family or lamb)"
  small+=" and (adam_bitwise or precision_modes or trust_ratio_family or shuffled or grid16x1)"
  emu_tests "$SMALL" -k "$small"
fi

if has_stage suite; then
  stamp "the whole test suite on the emulated CUDA handlers"
  with_dev_build "$BUILD" env JAXFUSE_CPU_TARGETS=cuda_on_cpu \
    python3 -m pytest -q -p no:cacheprovider tests --ignore=tests/test_cuda_on_cpu.py -m "not slow"
fi

if has_stage controls; then
  # Each control edits one line of a copy of the sources (the edit must apply exactly once),
  # rebuilds the emulated handlers and runs a check that must now FAIL.
  CTRL=build/dev-cuda-on-cpu-controls
  mkdir -p "$CTRL/src/tools"
  rm -rf "$CTRL/src/csrc" "$CTRL/src/tools/cuda_on_cpu"
  cp -r CMakeLists.txt csrc "$CTRL/src/" && cp -r tools/cuda_on_cpu "$CTRL/src/tools/"
  mkdir -p "$CTRL/build" && cp "$BUILD"/_jaxfuse_cpu.*.so "$CTRL/build/"  # to compare against
  caught=0
  control() {  # NAME FILE OLD NEW CHECK...
    local name="$1" file="$2" old="$3" new="$4"; shift 4
    stamp "control '$name': $file"
    cp "csrc/$file" "$CTRL/src/csrc/$file"
    python3 - "$CTRL/src/csrc/$file" "$old" "$new" <<'PY'
import sys
path, old, new = sys.argv[1:]
text = open(path).read()
if text.count(old) != 1:
    sys.exit(f"control: the planted edit matches {text.count(old)} places in {path}: update it")
open(path, "w").write(text.replace(old, new))
PY
    DEV_TARGETS="$EMU_TARGETS" dev_build "$CTRL/build" "$CTRL/src" \
      "-DJAXFUSE_CUDA_ON_CPU_DEFINES=$UNQUANTIZED_DECODER" >"$CTRL/build.log" 2>&1 \
      || { cat "$CTRL/build.log"; exit 1; }
    if with_dev_build "$CTRL/build" "$@" >"$CTRL/$name.log" 2>&1; then
      echo "NOT CAUGHT: the checks pass with the planted bug '$name' (log: $CTRL/$name.log)"
    else
      echo "caught: $(grep -m1 -E 'ERROR: AddressSanitizer|FAIL:|Mismatched elements|^FAILED' "$CTRL/$name.log" || tail -1 "$CTRL/$name.log")"
      caught=$((caught + 1))
    fi
    cp "csrc/$file" "$CTRL/src/csrc/$file"  # undo
  }
  control tail_overrun optim/cuda/multi_tensor.cuh \
    "const int count = min(4, ref.n - i);" "const int count = 4;" \
    "$CTRL/build/cuda_on_cpu_multi_tensor_test"
  control last_block_counter decoder/cuda/decoder_common.cuh \
    "*flag = atomicAdd(counter, 1) == expected - 1;" "*flag = atomicAdd(counter, 1) == 0;" \
    env JAXFUSE_REQUIRE_CUDA_ON_CPU=1 python3 -m pytest -q -x -p no:cacheprovider \
    tests/test_cuda_on_cpu.py -k "test_decoder and not same_bits and not quantized"
  control early_wait decoder/cuda/decoder_common.cuh \
    "const int* finished = counter(i) + 1;" "const int* finished = counter(i);" \
    env JAXFUSE_REQUIRE_CUDA_ON_CPU=1 python3 -m pytest -q -x -p no:cacheprovider \
    tests/test_cuda_on_cpu.py -k "test_decoder and not same_bits and not quantized"
  control finished_at_first_row decoder/cuda/decoder_gemv.cuh \
    "arrive_last(counter, arrivals + p.dims.batch, &sm.flag)" \
    "arrive_last(counter, arrivals + 1, &sm.flag)" \
    env JAXFUSE_REQUIRE_CUDA_ON_CPU=1 python3 -m pytest -q -x -p no:cacheprovider \
    tests/test_cuda_on_cpu.py -k "test_decoder and not same_bits and not quantized"
  control missing_syncthreads core/cuda/common.cuh \
    "  if (lane == 0) scratch[warp] = v;
  __syncthreads();" "  if (lane == 0) scratch[warp] = v;" \
    env JAXFUSE_REQUIRE_CUDA_ON_CPU=1 python3 -m pytest -q -x -p no:cacheprovider \
    tests/test_cuda_on_cpu.py -k "test_global_norm"
  control search_read_after_walk decoder/cuda/decoder_sample.cuh \
    "    const SampleSearch st = load_search(b);
    uint32_t count_above;
    uint64_t mass_above, mass_total;
    suffix_sums(h, count, mass, &count_above, &mass_above, &mass_total);" \
    "    uint32_t count_above;
    uint64_t mass_above, mass_total;
    suffix_sums(h, count, mass, &count_above, &mass_above, &mass_total);
    const SampleSearch st = load_search(b);" \
    env JAXFUSE_REQUIRE_CUDA_ON_CPU=1 python3 -m pytest -q -x -p no:cacheprovider \
    tests/test_cuda_on_cpu.py -k "whole_model_step and not quantized"
  control missing_ring_wait decoder/cuda/decoder_gemv_mma.cuh \
    "  if (slots == 4) wait_async_copies<2>();
  else wait_async_copies<0>();" "" \
    env JAXFUSE_REQUIRE_CUDA_ON_CPU=1 python3 -m pytest -q -x -p no:cacheprovider \
    tests/test_cuda_on_cpu.py -k "gemv_chunks_passes_and_splits and mma"
  control ring_slot_refilled_early decoder/cuda/decoder_gemv_mma.cuh \
    "    await_slab(stream.slots);
    stream.issue(s + stream.slots - 1);" \
    "    stream.issue(s + stream.slots - 1);
    await_slab(stream.slots);" \
    env JAXFUSE_REQUIRE_CUDA_ON_CPU=1 python3 -m pytest -q -x -p no:cacheprovider \
    tests/test_cuda_on_cpu.py -k "gemv_chunks_passes_and_splits and mma"
  # A stage kernel that reads its input (attention's q, k and v) before it waits for the launch
  # that writes it: on a GPU a race, on the emulator the poisoned bytes.
  control qkv_read_before_wait decoder/cuda/decoder_attention.cuh \
    "      await_qkv(it);
      if (it.valid) {
        const NewToken<kT> token{p, sm, layer};
        token.load_query_and_new_kv(it);" \
    "      if (it.valid) {
        const NewToken<kT> token{p, sm, layer};
        token.load_query_and_new_kv(it);
        await_qkv(it);" \
    env JAXFUSE_REQUIRE_CUDA_ON_CPU=1 python3 -m pytest -q -x -p no:cacheprovider \
    tests/test_cuda_on_cpu.py -k "test_decoder and not same_bits and not quantized"
  [ "$caught" -eq 9 ] || { echo "== cuda_on_cpu: only $caught of 9 planted bugs caught"; exit 1; }
fi
stamp "all passed"
