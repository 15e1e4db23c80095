#!/usr/bin/env bash
# Installs a built wheel as a user without a CUDA compiler would (a fresh virtual environment,
# no nvcc on the PATH) and runs the tests against the installed package.
#   bash tools/test_wheel.sh [WHEEL [pytest args]]   # WHEEL "" or none: dist/jaxfuse-*.whl;
#                                                    # no pytest args: the op tests
# JAX_VERSION=0.11.2 installs that jax and jaxlib beside it (default: the newest pip gives).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
source tools/find_python.sh
t0=$(date +%s)
stamp() { echo "== test_wheel [$(( $(date +%s) - t0 ))s]: $*"; }

wheel="${1:-}"; shift $(( $# > 0 ? 1 : 0 ))
wheel=$(realpath "${wheel:-$(ls dist/jaxfuse-*.whl)}")
[ $# -gt 0 ] || set -- tests/test_adam.py tests/test_clip.py tests/test_fused.py tests/test_decoder.py \
  tests/test_ffi_validation.py tests/test_build.py tests/test_sharding.py
python=$(find_python 3.12) || { echo "test_wheel: no Python 3.12 found (set PYTHON=)"; exit 1; }

# No CUDA compiler on the PATH, no CUDA variables.
path=$(path_without_nvcc)
unset CUDACXX CUDA_PATH CUDA_HOME JAXFUSE_EXTENSION_DIR JAXFUSE_CPU_TARGETS

env=build/wheel-test-env
rm -rf "$env"
"$python" -m venv "$env"
env_python="$root/$env/bin/python"
stamp "pip install $(basename "$wheel")[test] into a fresh $("$env_python" --version) environment"
PATH="$path" "$env_python" -m pip install --quiet --upgrade pip
PATH="$path" "$env_python" -m pip install --quiet "$wheel[test]" \
  ${JAX_VERSION:+"jax==$JAX_VERSION" "jaxlib==$JAX_VERSION"}
stamp "installed in $(( $(date +%s) - t0 ))s"

# Run from outside the source tree so that `import jaxfuse` finds the installed package.
cd "$(mktemp -d)"
PATH="$path" "$env_python" - "$wheel" <<'PY'
import shutil, sys, importlib.metadata as md
import jax, jaxfuse
assert shutil.which("nvcc") is None, "nvcc is on the PATH"
assert "site-packages" in jaxfuse.__file__, jaxfuse.__file__
cuda = jaxfuse.backends()["cuda"]
print(f"jaxfuse {jaxfuse.__version__} from {jaxfuse.__file__}; jax {jax.__version__}, "
      f"jaxlib {md.version('jaxlib')}; CUDA handlers built: {cuda['built']}")
if "+cu" in sys.argv[1] and not cuda["built"]:
  sys.exit("the wheel's label promises CUDA handlers, but jaxfuse.backends() reports none")
PY
stamp "pytest $*"
PATH="$path" "$env_python" -m pytest -q -n auto -p no:cacheprovider --rootdir "$root" -c "$root/pyproject.toml" \
  "${@/#tests/$root/tests}"
stamp "done"
