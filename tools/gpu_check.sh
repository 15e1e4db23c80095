#!/usr/bin/env bash
# Everything a GPU lease should run, in one command: build, the test suite on the CUDA backend,
# compute-sanitizer (memcheck + racecheck) over the CUDA tests, a CUDA-graph capture check, and
# every benchmark. Logs go to $OUT (or ./gpu_out); a summary table is printed last.
#
#   bash tools/gpu_check.sh            # everything
#   QUICK=1 bash tools/gpu_check.sh    # smaller benchmarks
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
declare -a SUMMARY

step() {  # step NAME COMMAND...: runs, logs to $OUT/NAME.log, records status and time
  local name="$1"; shift
  local t0=$(date +%s)
  echo "=== $name: $*"
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local dt=$(( $(date +%s) - t0 ))
  tail -n 25 "$OUT/$name.log"
  SUMMARY+=("| $name | $([ $rc -eq 0 ] && echo ok || echo "FAILED ($rc)") | ${dt}s |")
  return $rc
}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
} > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"

step build env JAXFUSE_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=16 \
  python3 -m pip install --no-build-isolation --no-deps -v -e . || { printf '%s\n' "${SUMMARY[@]}"; exit 1; }
grep -E "spill|ptxas" "$OUT/build.log" | sort -u | head -40 > "$OUT/ptxas.txt"

step backends python3 -c "import jaxfuse; b = jaxfuse.backends(); print(jaxfuse.__version__, b); assert b['cuda']['usable'], b"
step tests_gpu python3 -m pytest -q -m gpu tests -W ignore::DeprecationWarning
step tests_all python3 -m pytest -q tests -W ignore::DeprecationWarning

if command -v compute-sanitizer >/dev/null 2>&1; then
  SAN_TESTS="tests/test_adam.py tests/test_clip.py tests/test_dtypes.py tests/test_decoder.py"
  for tool in memcheck racecheck synccheck; do
    step "sanitizer_$tool" env XLA_PYTHON_CLIENT_PREALLOCATE=false \
      compute-sanitizer --tool "$tool" --error-exitcode 99 --target-processes all \
      python3 -m pytest -q -x -m gpu $SAN_TESTS -m "not slow" -W ignore::DeprecationWarning
  done
else
  SUMMARY+=("| sanitizers | compute-sanitizer not found | - |")
fi

# CUDA graphs: XLA must capture the jaxfuse custom calls into command buffers.
step cuda_graphs env XLA_FLAGS="--xla_dump_to=$OUT/hlo_dump --xla_dump_hlo_as_text" \
  python3 tools/check_command_buffers.py "$OUT/hlo_dump"

Q=${QUICK:+--quick}
step report python3 -m jaxfuse.report
step bench_optim python3 benchmarks/bench_optim.py $Q --out "$OUT/bench_optim.md" \
  --plot "$OUT/optim_bandwidth_gpu.png"
step bench_decoder python3 benchmarks/bench_decoder.py $Q --out "$OUT/bench_decoder.md"
# The flax TrainState step (drop-in, in-place helper, optax), when flax is installed there.
if python3 -c "import flax" 2>/dev/null; then
  step bench_train_step python3 benchmarks/bench_train_step.py $Q --out "$OUT/bench_train_step.md"
fi

echo
echo "== summary ($(date -u +%F), $(head -2 "$OUT/device.txt" | tail -1))"
echo "| step | result | time |"
echo "|---|---|---|"
printf '%s\n' "${SUMMARY[@]}"
for f in "$OUT/report.log" "$OUT/bench_optim.md" "$OUT/bench_decoder.md" \
         "$OUT/bench_train_step.md"; do [ -f "$f" ] && { echo; cat "$f"; }; done
