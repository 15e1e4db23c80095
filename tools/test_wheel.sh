#!/usr/bin/env bash
# Installs the built wheels as a user without a CUDA compiler would (a fresh virtual environment,
# no nvcc on the PATH): jaxfuse from dist/ with the extra for a CUDA major, which brings that
# major's handler package (from dist/) and jax's CUDA plugin (from the index), then checks what
# `python -m jaxfuse` reports and runs the tests against the installed package.
#   bash tools/test_wheel.sh cuda13|cuda12|cpu [pytest args]   # no pytest args: the op tests
# JAX_VERSION=0.11.2 installs that jax (and its plugin) beside it (default: the newest pip gives).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
source tools/find_python.sh
t0=$(date +%s)
stamp() { echo "== test_wheel [$(( $(date +%s) - t0 ))s]: $*"; }

flavor=${1:?"usage: test_wheel.sh cuda13|cuda12|cpu [pytest args]"}; shift
[ $# -gt 0 ] || set -- tests/test_adam.py tests/test_clip.py tests/test_fused.py tests/test_decoder.py \
  tests/test_ffi_validation.py tests/test_build.py tests/test_install.py tests/test_sharding.py
python=$(find_python 3.12) || { echo "test_wheel: no Python 3.12 found (set PYTHON=)"; exit 1; }
wheel=$(realpath "$(ls dist/jaxfuse-*.whl)")
extras=test
jax=${JAX_VERSION:+"jax==$JAX_VERSION"}
if [ "$flavor" != cpu ]; then
  ls dist/jaxfuse_"$flavor"-*.whl >/dev/null || { echo "test_wheel: no dist/jaxfuse_$flavor-*.whl"; exit 1; }
  extras="test,$flavor"
  jax=${JAX_VERSION:+"jax[$flavor]==$JAX_VERSION"}
fi

# No CUDA compiler on the PATH, no CUDA variables.
path=$(path_without_nvcc)
unset CUDACXX CUDA_PATH CUDA_HOME JAXFUSE_EXTENSION_DIR JAXFUSE_CPU_TARGETS

env=build/wheel-test-$flavor
rm -rf "$env"
"$python" -m venv "$env"
env_python="$root/$env/bin/python"
stamp "pip install jaxfuse[$extras] ${jax:-} from dist/ into a fresh $("$env_python" --version) environment"
PATH="$path" "$env_python" -m pip install --quiet --upgrade pip
PATH="$path" "$env_python" -m pip install --quiet --find-links "$root/dist" \
  "jaxfuse[$extras] @ file://$wheel" ${jax:+"$jax"}
stamp "installed in $(( $(date +%s) - t0 ))s"

# Run from outside the source tree so that `import jaxfuse` finds the installed package.
cd "$(mktemp -d)"
PATH="$path" "$env_python" -m jaxfuse | tee jaxfuse.txt
PATH="$path" "$env_python" - "$flavor" <<'PY'
import shutil, sys
import jaxfuse
flavor = sys.argv[1]
assert shutil.which("nvcc") is None, "nvcc is on the PATH"
assert "site-packages" in jaxfuse.__file__, jaxfuse.__file__
cuda = jaxfuse.backends()["cuda"]
expected = None if flavor == "cpu" else f"jaxfuse_{flavor}"
if cuda["package"] != expected:
  sys.exit(f"the CUDA handlers come from {cuda['package']}, expected {expected}")
if flavor != "cpu" and (cuda["runtime_version"] or "").split(".")[0] != flavor[4:]:
  sys.exit(f"{expected} holds a CUDA {cuda['runtime_version']} build")
PY
stamp "pytest $*"
PATH="$path" "$env_python" -m pytest -q -n auto -p no:cacheprovider --rootdir "$root" -c "$root/pyproject.toml" \
  "${@/#tests/$root/tests}"
stamp "done"
