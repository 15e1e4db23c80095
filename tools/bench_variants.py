"""Times builds of jaxfuse side by side (tuning variants, see tools/gpu_check.sh's variants
stage): for each NAME=DIR, with JAXFUSE_EXTENSION_DIR=DIR, the optimizer step on 64M and 256M
fp32 tensors (benchmarks/bench_optim.py: optax, fused AdamW, with and without clip) and the
decoder step (benchmarks/bench_decoder.py --quick). One markdown table per benchmark, rows
tagged with the variant's name.

  python3 tools/bench_variants.py default=build/gpu-carry decoder_1=build/variant-decoder_1 ...
"""

import os
import subprocess
import sys
import tempfile

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")
RUNS = {
    "optimizer": ("bench_optim.py", ["--tensors-only", "--sizes", "64,256"],
                  ("| optax |", "| jf-fused |", "| optax+clip |", "| jf-fused+clip |")),
    "decoder": ("bench_decoder.py", ["--quick"], ("",)),
}


def table_rows(path):
  lines = [line.rstrip("\n") for line in open(path) if line.startswith("|")]
  return lines[:2], lines[2:]


def main(specs):
  variants = [spec.split("=", 1) for spec in specs]
  failed = 0
  with tempfile.TemporaryDirectory() as tmp:
    for bench, (script, args, keep) in RUNS.items():
      header, rows = None, []
      for name, ext_dir in variants:
        out = os.path.join(tmp, f"{bench}-{name}.md")
        extra = ["--plot", os.path.join(tmp, "unused.png")] if script == "bench_optim.py" else []
        env = dict(os.environ, JAXFUSE_EXTENSION_DIR=os.path.abspath(ext_dir))
        print(f"{bench}: {name} ...", file=sys.stderr, flush=True)
        run = subprocess.run([sys.executable, script, *args, *extra, "--out", out], env=env,
                             cwd=BENCH, stdout=subprocess.DEVNULL)
        if run.returncode != 0:
          rows.append(f"| {name} | FAILED (exit {run.returncode}) |")
          failed += 1
          continue
        header, body = table_rows(out)
        rows += [f"| {name} {row}" for row in body if any(k in row for k in keep)]
      print(f"\n### {bench}\n")
      if header:
        print(f"| build {header[0]}\n|---{header[1]}")
      print("\n".join(rows))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
