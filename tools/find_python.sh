# Sourced by .ci/run and tools/build_wheel.sh: find_python X.Y prints the path of a CPython X.Y
# interpreter that runs (a pyenv shim that names a version not selected does not), or fails.
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
