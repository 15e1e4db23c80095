#!/usr/bin/env bash
# What a GPU lease runs, in stages that each fit one 10-minute device command. First, always:
#
#   bash tools/gpu_check.sh quick                                        # <= 9.5 min, see stage_quick
#
# then, with device time left, stages of the full check:
#
#   STAGE_LIMIT_S=420 bash tools/gpu_check.sh env build graphs tests      # ~4 min
#   STAGE_LIMIT_S=285 bash tools/gpu_check.sh bench_optim bench_decoder   # ~6.5 min
#   STAGE_LIMIT_S=110 bash tools/gpu_check.sh sanitize report             # ~1.5 min
#   STAGE_LIMIT_S=200 bash tools/gpu_check.sh bench_train profile bench_leaves
#   STAGE_LIMIT_S=300 bash tools/gpu_check.sh bench_families             # never run on a GPU yet
#   STAGE_LIMIT_S=300 bash tools/gpu_check.sh bench_long bench_quantized # never run on a GPU yet
#   STAGE_LIMIT_S=300 bash tools/gpu_check.sh bench_generate             # never run on a GPU yet
#   STAGE_LIMIT_S=120 bash tools/gpu_check.sh bench_muon                 # never run on a GPU yet
#   STAGE_LIMIT_S=90 bash tools/gpu_check.sh decoder_timeline            # never run on a GPU yet
#   STAGE_LIMIT_S=400 bash tools/gpu_check.sh variants
#   DEADLINE_S=3600 bash tools/gpu_check.sh all    # all, in that order, where no 10-minute limit is
# (times measured on an H100 on 2026-11-24, from a carried build).
#
# Stages: quick (below), env (driver, toolkit, jax), build (use a carried build/gpu-carry of these sources whose
# CUDA module loads there, else build with the machine's nvcc into build/gpu-device), build_pip (the user's editable
# install, with --no-build-isolation), tests (the suite, CUDA backend included), graphs (command
# buffers on vs off, bitwise, training step and decode loop), sanitize (memcheck, racecheck,
# synccheck over tools/gpu_ops.py, one op per process), report, bench_optim, bench_families
# (every optimizer family against optax, and AdamW's precision modes), bench_decoder,
# decoder_timeline (the decoder's stages block by block: tools/decoder_timeline.py),
# bench_generate (the whole-model step, head and draw included, and generate's tokens/s),
# bench_long (long prompts and contexts: the scanned prefill against the one it replaced, and
# the decoder's time per token at contexts 1k to 32k), bench_quantized (the decoder with int8
# and fp8 matrices beside bf16, Llama-3.2-1B layers; the whole int8 step, head included),
# bench_train, profile (ncu over tools/profile_kernels.py), bench_leaves (the 1000-leaf tree with
# XLA's command buffers off, beside bench_optim's run with them on), variants (tuning switches,
# timed beside the default build).
#
# Before the lease, on the CPU machine: PYTHON=<a Python 3.12 with jax and nanobind> bash
# tools/gpu_check.sh carry builds the modules (sm_90) into build/gpu-carry and build/variant-*,
# each stamped with a hash of the sources; name those folders in the device call's carry. The
# build and variants stages use a carried build only if its hash matches the tree's, and else
# build there (~minutes).
#
# Every stage logs to $OUT/<stage>.log (default ./gpu_out) and has a time limit (STAGE_LIMIT_S,
# default 540 s); its row of the summary is kept in build/gpu_check_summary.md, so a later command
# on the same warm machine prints the rows of earlier ones too. The summary table is printed last.
# QUICK=1 makes the benchmarks small (a smoke run).
# A device tool that returns only a few files from its output folder gets the logs as one archive,
# packed as they come so that a command cut off still returns them:
#   F=$OUT; export OUT=/tmp/gq; mkdir -p $OUT; (while sleep 40; do tar czf /tmp/q.tgz -C /tmp gq \
#     && mv /tmp/q.tgz $F/quick.tgz; done) & bash tools/gpu_check.sh quick; kill %1; \
#     tar czf $F/quick.tgz -C /tmp gq; cp /tmp/gq/summary.md $F/
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SELF="$ROOT/tools/gpu_check.sh"
OUT="${OUT:-$ROOT/gpu_out}"
mkdir -p "$OUT" build
SUMMARY=build/gpu_check_summary.md
EXT_FILE=build/gpu_check_extension_dir
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
LIMIT="${STAGE_LIMIT_S:-540}"
# The whole command's budget: a step gets at most what is left of it, so that the summary still
# prints inside the device's 10-minute limit.
START=$(date +%s)
DEADLINE="${DEADLINE_S:-570}"
Q=${QUICK:+--quick}

step() {  # step NAME COMMAND...: runs under the time limit, logs, records a summary row
  local name="$1"; shift
  local t0=$(date +%s)
  local limit=$(( DEADLINE - 15 - (t0 - START) ))
  [ "$limit" -gt "$LIMIT" ] && limit=$LIMIT
  if [ "$limit" -lt 10 ]; then
    echo "| $name | SKIPPED (the command's ${DEADLINE}s are spent) | - | $(date -u +%H:%M) |" >> "$SUMMARY"
    return 1
  fi
  echo "=== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local dt=$(( $(date +%s) - t0 ))
  tail -n 15 "$OUT/$name.log"
  local result="ok"
  [ $rc -eq 124 ] && result="TIMED OUT (${limit}s)"
  [ $rc -ne 0 ] && [ $rc -ne 124 ] && result="FAILED ($rc)"
  echo "| $name | $result | ${dt}s | $(date -u +%H:%M) |" >> "$SUMMARY"
  cp "$SUMMARY" "$OUT/summary.md"  # a command cut off later still returns the rows so far
  return $rc
}

use_extension() {  # the modules later stages load: the build stage's choice, else a carried build
  if [ -f "$EXT_FILE" ]; then
    export JAXFUSE_EXTENSION_DIR="$(cat "$EXT_FILE")"
  elif carried build/gpu-carry; then
    export JAXFUSE_EXTENSION_DIR="$ROOT/build/gpu-carry"
  fi
}

cuda_usable() {
  JAXFUSE_EXTENSION_DIR="$1" python3 -c "
import jaxfuse, sys
b = jaxfuse.backends(); print(jaxfuse.__version__, b)
sys.exit(0 if b['cuda']['usable'] else 1)"
}

stage_env() {
  {
    date -u
    nvidia-smi
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,power.limit,temperature.gpu --format=csv
    nvcc --version | tail -2
    compute-sanitizer --version | tail -1
    python3 -c "import sys, jax, jaxlib, optax; print(sys.version); print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'optax', optax.__version__); print(jax.devices())"
    python3 -m pip list 2>/dev/null | grep -iE "^(jax|flax|optax|nanobind|scikit-build|pytest|hypothesis|safetensors|numpy|ml.dtypes)"
  } > "$OUT/env.log" 2>&1
  cat "$OUT/env.log"
}

source_hash() {  # source_hash [FLAGS]: what a build is of: the CMake file, the sources, flags
  { cat CMakeLists.txt $(find csrc -type f \( -name '*.h' -o -name '*.cc' -o -name '*.cu' \
      -o -name '*.cuh' \) | LC_ALL=C sort); echo "flags: ${1:-}"; } | sha256sum | cut -c1-16
}

build_into() {  # build_into DIR PYTHON [CUDA FLAGS]: both modules for sm_90, copied into DIR
  local dir=$1 py=$2 flags=${3:-}
  cmake -S . -B "$dir-cmake" -G Ninja -DSKBUILD_PROJECT_NAME=jaxfuse -DPython_EXECUTABLE="$py" \
      -DCMAKE_BUILD_TYPE=Release -DJAXFUSE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DCMAKE_CUDA_FLAGS="$flags -Xptxas=-v" \
    && cmake --build "$dir-cmake" -j"$(nproc)" -v \
    && mkdir -p "$dir" && cp "$dir-cmake"/*.so "$dir"/ && source_hash "$flags" > "$dir/SOURCE_HASH"
}

carried() {  # carried DIR [FLAGS]: DIR holds a build of exactly these sources with these flags
  [ -f "$1/SOURCE_HASH" ] && [ "$(cat "$1/SOURCE_HASH")" = "$(source_hash "${2:-}")" ] \
    && ls "$1"/_jaxfuse_cuda.*.so > /dev/null 2>&1
}

stage_carry() {  # on the CPU machine, before the lease: PYTHON=<a Python 3.12 with jax, nanobind>
  local py=${PYTHON:?PYTHON must name a Python 3.12 with jax and nanobind installed} v
  DEADLINE=${DEADLINE_S:-3600}  # no device limit here: four full builds on a small machine
  carried build/gpu-carry || step carry_default bash "$SELF" _run build_into build/gpu-carry "$py"
  for v in "${VARIANTS[@]}"; do
    carried "build/variant-${v%%:*}" "${v#*:}" \
      || step "carry_${v%%:*}" bash "$SELF" _run build_into "build/variant-${v%%:*}" "$py" "${v#*:}"
  done
  du -sh build/gpu-carry build/variant-*/ | grep -v cmake
}

stage_build() {
  rm -f "$EXT_FILE"
  if carried build/gpu-carry && cuda_usable build/gpu-carry > "$OUT/build.log" 2>&1; then
    echo "$ROOT/build/gpu-carry" > "$EXT_FILE"
    echo "| build | carried build/gpu-carry ($(source_hash)) loads, CUDA usable | - | $(date -u +%H:%M) |" >> "$SUMMARY"
    cat "$OUT/build.log"
    return 0
  fi
  echo "no carried build of these sources ($(source_hash)) that loads here: building with this machine's nvcc"
  step build bash "$SELF" _run build_into build/gpu-device "$(command -v python3)" || return 1
  grep -E "spill|registers" "$OUT/build.log" | sort -u > "$OUT/ptxas.txt"
  echo "$ROOT/build/gpu-device" > "$EXT_FILE"
  step backends bash "$SELF" _run cuda_usable "$ROOT/build/gpu-device"
}

stage_build_pip() {  # what a user on this machine would run (compiles everything: ~minutes)
  step build_pip env JAXFUSE_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=16 \
    python3 -m pip install --no-build-isolation --no-deps -v -e .
}

stage_tests() {
  use_extension
  # Workers share the one GPU; each takes only the memory it uses (tests/conftest.py).
  step tests python3 -m pytest -q -n 8 -rfEsx --durations=15 tests -W ignore::DeprecationWarning
}

stage_graphs() {
  use_extension
  step graphs python3 tools/check_command_buffers.py --dump "$OUT/hlo_dump"
  tar -czf "$OUT/hlo_dump.tgz" -C "$OUT" hlo_dump 2>/dev/null && rm -rf "$OUT/hlo_dump"
}

stage_sanitize() {
  use_extension
  for tool in memcheck racecheck synccheck; do
    step "sanitize_$tool" bash "$SELF" _run _sanitize_one "$tool"
  done
}

SANITIZER_FLAGS=(--error-exitcode 99 --print-limit 20)  # exit non-zero on findings

_sanitize_one() {  # _sanitize_one TOOL: a plain jax program, then each op in its own process
  # The plain program tells a problem of the sanitizer with jax from one in jaxfuse. Every
  # kernel is checked, XLA's too: judge findings by the kernel they name.
  local tool=$1 rc=0 r
  for op in plain norm adam families decoder; do
    echo "--- $tool: $op"
    if [ "$op" = plain ]; then
      set -- python3 -c "import jax.numpy as j; print(float((j.ones(1000) * 2).sum()))"
    else
      set -- python3 tools/gpu_ops.py "$op"
    fi
    timeout $((LIMIT / 4)) compute-sanitizer --tool "$tool" "${SANITIZER_FLAGS[@]}" "$@"
    r=$?
    echo "--- $tool: $op: exit $r"
    [ $r -ne 0 ] && rc=$r
  done
  return $rc
}

stage_bench_optim() {
  use_extension
  step bench_optim python3 benchmarks/bench_optim.py $Q --out "$OUT/bench_optim.md" \
    --plot "$OUT/optim_bandwidth_gpu.png"
}

stage_bench_families() {
  use_extension
  step bench_families python3 benchmarks/bench_families.py $Q --out "$OUT/bench_families.md"
  step bench_precision python3 benchmarks/bench_precision.py $Q --out "$OUT/bench_precision.md"
}

stage_bench_muon() {
  use_extension
  step bench_muon python3 benchmarks/bench_muon.py --out "$OUT/bench_muon.md"
}

stage_bench_decoder() {
  use_extension
  step bench_decoder python3 benchmarks/bench_decoder.py $Q --out "$OUT/bench_decoder.md"
}

stage_decoder_timeline() {
  use_extension
  step decoder_timeline python3 tools/decoder_timeline.py --model \
    --batches "${TIMELINE_BATCHES:-1,4,16}" --out "$OUT/decoder_timeline.md" \
    --plot "$OUT/decoder_timeline.png"
}

stage_bench_generate() {
  use_extension
  step bench_generate python3 benchmarks/bench_generate.py $Q --out "$OUT/bench_generate.md"
  step bench_generate_filter python3 benchmarks/bench_generate.py --filter $Q \
    --out "$OUT/bench_generate_filter.md"
}

stage_bench_quantized() {
  use_extension
  step bench_quantized python3 benchmarks/bench_decoder.py --quantized $Q \
    --out "$OUT/bench_quantized.md"
  step bench_generate_int8 python3 benchmarks/bench_generate.py --quantize int8 $Q \
    --out "$OUT/bench_generate_int8.md"
}

stage_bench_long() {
  use_extension
  step bench_prefill python3 benchmarks/bench_prefill.py $Q --out "$OUT/bench_prefill.md"
  step bench_long_context python3 benchmarks/bench_decoder.py --long-context $Q \
    --out "$OUT/bench_long_context.md"
}

stage_bench_train() {
  use_extension
  step bench_train python3 benchmarks/bench_train_step.py $Q --out "$OUT/bench_train_step.md"
}

stage_profile() {
  use_extension
  step profile ncu --clock-control none --kernel-name regex:'decoder_kernel|multi_tensor|norm_finish' \
    --launch-skip 2 --launch-count 13 --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
    python3 tools/profile_kernels.py
}

stage_bench_leaves() {
  use_extension
  step bench_leaves env XLA_FLAGS="--xla_gpu_enable_command_buffer=" \
    python3 benchmarks/bench_optim.py --quick --out "$OUT/bench_leaves.md" --plot "$OUT/unused.png"
  rm -f "$OUT/unused.png"
}

# Tuning variants: the default build beside builds that differ by one switch (see the switches'
# comments in csrc/*/cuda), timed side by side. A variant's build is carried in
# build/variant-NAME (stage carry) or built here, all in parallel.
VARIANTS=("decoder_1:-DJAXFUSE_DECODER_BLOCKS_PER_SM=1")

stage_variants() {
  use_extension
  local v specs=("default=${JAXFUSE_EXTENSION_DIR:?no build: run the build stage first}")
  local left=$(( DEADLINE - 120 - ($(date +%s) - START) ))
  for v in "${VARIANTS[@]}"; do  # the missing builds, in parallel, leaving 2 minutes to time them
    carried "build/variant-${v%%:*}" "${v#*:}" || timeout "$left" bash "$SELF" _run build_into \
        "build/variant-${v%%:*}" "$(command -v python3)" "${v#*:}" >> "$OUT/variant_builds.log" 2>&1 &
  done
  wait
  for v in "${VARIANTS[@]}"; do
    if carried "build/variant-${v%%:*}" "${v#*:}"; then
      specs+=("${v%%:*}=$ROOT/build/variant-${v%%:*}")
    else
      echo "| variant ${v%%:*} | build FAILED (variant_builds.log) | - | $(date -u +%H:%M) |" >> "$SUMMARY"
    fi
  done
  step variants python3 tools/bench_variants.py "${specs[@]}"
}

# quick: the first command of every lease, ONE device command of at most 9.5 minutes (DEADLINE_S,
# 560 s by default here; run it with a device timeout of 590) on the carried build (stage carry,
# before the lease): env and the build check, then, most important first, each step capped
# (LIMIT, from the times of the H200 run of 2026-11-28) so that a stuck one leaves the others
# their time, and its log and the summary in $OUT as soon as it ends:
#   ops                   every op and mode against the CPU handlers (tools/gpu_ops.py), and the
#                         decoder's stage kernels against its persistent kernel, bit for bit
#   bench_decoder_grid    the decoder's rows on both schedules (the persistent launch, the stage
#                         kernels): the 16 layers and the whole step (head and draw included),
#                         bf16 / int8 / fp8 matrices, batch 1/4/16, context 1k/4k/16k, each beside
#                         plain XLA, in 170 s (rows past it listed as not reached)
#   decoder_timeline      the 16 layers' stages on each schedule at batch 1 and 16, context 1k,
#                         block by block (their shares of the step, work, waits, wake latencies),
#                         and the whole step's at batch 1 and 16
#   graphs                XLA's command buffers on and off (tools/check_command_buffers.py): the
#                         same bits, the decoder's schedules the same bits, and whether a graph
#                         keeps the stage kernels' programmatic edges (their step as fast as on
#                         the stream)
#   bench_optim           AdamW on GPT-2 small (fp32; bf16 with master weights), with and
#                         without the clip, 8-bit moments, and the 256M tensor, beside optax,
#                         device time apart from wall time
#   bench_packed          the 1000-leaf tree's AdamW step fused per leaf, with the state
#                         packed, with params and state packed (the host's share; optax's
#                         half-minute compile of this tree is left to stage bench_optim)
#   bench_muon            jaxfuse.muon on GPT-2 small beside optax.contrib.muon and the fused
#                         AdamW step (fp32 and bf16 Newton-Schulz), and the Gram iteration
#                         beside the standard one on the largest stack
#   memcheck_decoder      compute-sanitizer memcheck over the decoder's and whole step's cases
#   racecheck_decoder     compute-sanitizer racecheck over the same (shared-memory hazards: the
#                         tensor-core GEMV's weight ring, filled by cp.async)
#   tests                 the op tests (not the slow ones) with what is left
# A step that does not fit what is left of the deadline is SKIPPED in the summary. generate's
# tokens/s (the grid times the whole step), the filtered and int8 generate rows, and the 8-bit
# layers beside XLA's read rate, are stages bench_generate and bench_quantized.
stage_quick() {
  DEADLINE=${DEADLINE_S:-560}
  stage_env
  echo "| env | $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1) | - | $(date -u +%H:%M) |" >> "$SUMMARY"
  stage_build
  [ -f "$EXT_FILE" ] || { cp "$SUMMARY" "$OUT/summary.md"; return 1; }
  use_extension
  LIMIT=100 step ops python3 tools/gpu_ops.py  # the H200 run's 75 s, the every-code and stage-kernel decoder cases
  LIMIT=195 step bench_decoder_grid python3 benchmarks/bench_decoder_grid.py --budget-s 170 \
    --out "$OUT/bench_decoder_grid.md"
  LIMIT=100 TIMELINE_BATCHES=1,16 stage_decoder_timeline
  LIMIT=75 stage_graphs
  LIMIT=80 step bench_optim python3 benchmarks/bench_optim.py --trees "GPT-2 small,256M" \
    --out "$OUT/bench_optim.md" --plot "$OUT/optim_bandwidth_gpu.png"
  LIMIT=45 step bench_packed python3 benchmarks/bench_optim.py --trees "1000 leaves" \
    --variants "jf-fused,jf-fused packed,jf-fused packed params" \
    --out "$OUT/bench_packed.md" --plot "$OUT/unused.png"
  LIMIT=90 step bench_muon python3 benchmarks/bench_muon.py --out "$OUT/bench_muon.md"
  LIMIT=30 step memcheck_decoder compute-sanitizer --tool memcheck "${SANITIZER_FLAGS[@]}" \
    python3 tools/gpu_ops.py decoder
  LIMIT=90 step racecheck_decoder compute-sanitizer --tool racecheck "${SANITIZER_FLAGS[@]}" \
    python3 tools/gpu_ops.py decoder
  step tests python3 -m pytest -q -n 8 -m "not slow" -rfEsx -p no:cacheprovider tests \
    -W ignore::DeprecationWarning
}

stage_report() {
  use_extension
  step report python3 benchmarks/report_gpt2.py
}

# `step` runs commands, not functions: a stage's function runs under it as `bash $SELF _run FN ...`.
if [ "${1:-}" = _run ]; then shift; use_extension; "$@"; exit; fi
stages=("$@")
[ ${#stages[@]} -eq 0 ] && { echo "usage: $0 STAGE... | all (see the header)"; exit 2; }
[ "${stages[0]}" = all ] && stages=(env build graphs tests bench_optim bench_families bench_muon bench_decoder
                                    decoder_timeline bench_generate bench_long bench_quantized sanitize report
                                    bench_train profile bench_leaves variants)
for s in "${stages[@]}"; do
  if ! declare -F "stage_$s" > /dev/null; then echo "unknown stage: $s"; exit 2; fi
done
for s in "${stages[@]}"; do
  "stage_$s"
  [ "$s" = build ] && [ ! -f "$EXT_FILE" ] && { echo "no usable build: stopping"; break; }
done

echo
echo "== summary ($(date -u +%F), $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null))"
echo "| stage | result | time | ended (UTC) |"
echo "|---|---|---|---|"
cat "$SUMMARY"
cp "$SUMMARY" "$OUT/summary.md"
for s in "${stages[@]}"; do
  case $s in bench_*|decoder_timeline|all|quick)
    for f in "$OUT"/bench_*.md "$OUT"/decoder_timeline.md; do [ -f "$f" ] && { echo; cat "$f"; }; done; break;;
  esac
done
