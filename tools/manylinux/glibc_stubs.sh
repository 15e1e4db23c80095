#!/usr/bin/env bash
# Writes glibc 2.28 link stubs for x86-64 into OUTDIR: what a link against them may bind is only
# what glibc 2.28 exports, at the versions it exports them (manylinux_2_28). CMakeLists.txt links
# the wheels' modules against them (JAXFUSE_GLIBC_STUBS). The stubs are zig's (the `ziglang`
# package, which generates them for any glibc version from its symbol lists); libc.so is a linker
# script that adds this machine's libc_nonshared.a (atexit, pthread_atfork: code linked into the
# module, not symbols) and folds in libpthread, libdl and librt, where glibc 2.28 keeps the
# symbols newer glibc moved into libc.
#   bash tools/manylinux/glibc_stubs.sh OUTDIR PYTHON    # PYTHON: an interpreter with ziglang
set -euo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd)
python=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export ZIG_GLOBAL_CACHE_DIR="$work/cache" ZIG_LOCAL_CACHE_DIR="$work/cache"
echo 'int jaxfuse_glibc_probe(void) { return 0; }' > "$work/probe.c"
# zig builds the stubs for the target's glibc while linking, and names them on its lld line.
lld_line=$("$python" -m ziglang cc -target x86_64-linux-gnu.2.28 -fno-sanitize=all -shared -fPIC \
  "$work/probe.c" -o "$work/probe.so" -v 2>&1 | grep 'ld.lld')
stubs=$(dirname "$(tr ' ' '\n' <<<"$lld_line" | grep '/libc\.so\.6$' | head -n1)")
cp "$stubs"/{libc.so.6,libm.so.6,libpthread.so.0,libdl.so.2,librt.so.1} "$out"/
cp "$stubs"/libld.so.2 "$out"/ld-linux-x86-64.so.2  # its SONAME
cp "$(gcc -print-file-name=libc_nonshared.a)" "$out"/
cat > "$out"/libc.so <<EOT
OUTPUT_FORMAT(elf64-x86-64)
GROUP ( $out/libc.so.6 $out/libc_nonshared.a AS_NEEDED ( $out/libpthread.so.0 $out/libdl.so.2 $out/librt.so.1 $out/ld-linux-x86-64.so.2 ) )
EOT
for lib in m.so.6 pthread.so.0 dl.so.2 rt.so.1; do
  echo "GROUP ( $out/lib$lib )" > "$out/lib${lib%%.so*}.so"
done
