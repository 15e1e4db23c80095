# Sourced by .ci/run, tools/build_wheel.sh and tools/test_wheel.sh: find_python X.Y prints the path
# of a CPython X.Y interpreter that runs (a pyenv shim that names a version not selected does not),
# or fails; path_without_nvcc prints $PATH less every directory holding a CUDA compiler (what a
# user without one has).
find_python() {
  local want="$1" candidate
  for candidate in "${PYTHON:-}" "python$want" python3 \
      "$(pyenv root 2>/dev/null)"/versions/"$want".*/bin/python"$want"; do
    [ -n "$candidate" ] || continue
    if "$candidate" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$want'.split('.'))))" \
        2>/dev/null; then
      command -v "$candidate" 2>/dev/null || echo "$candidate"
      return 0
    fi
  done
  return 1
}

path_without_nvcc() {
  local path="" dir
  local -a dirs
  IFS=: read -ra dirs <<<"$PATH"
  for dir in "${dirs[@]}"; do [ -x "$dir/nvcc" ] || path="${path:+$path:}$dir"; done
  echo "$path"
}
