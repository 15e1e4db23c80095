"""Checks that jaxfuse's custom calls run inside XLA's CUDA graphs (command buffers), and that
replaying the graphs gives the same bits as running without them. GPU only:

  python3 tools/check_command_buffers.py [--dump DIR]

Each configuration runs in a fresh process (XLA reads its flags once), on the same inputs:
  off      --xla_gpu_enable_command_buffer= (no graphs)
  default  XLA's default command-buffer types, graphs of any size (min_graph_size=1)
  forced   CUSTOM_CALL named explicitly beside FUSION, graphs of any size
and computes (a) a jitted training step (model, jaxfuse.clip_by_global_norm + jaxfuse.adamw via
jaxfuse.fused_step, params and state donated) run 5 times, and (b) a jitted decode loop (4
persistent_decoder steps per call, cache donated) called 4 times on each of the decoder's
schedules, so that the first call (which captures the graph) and at least three replays are
covered. Their results must be bitwise equal to 'off', and the stage kernels' the persistent
kernel's. For the graph runs it reads XLA's dumps (optimized HLO, thunk sequence and metadata) to
find which jaxfuse targets ran inside command buffers. Exit status 1 if a result differs or a
graph configuration left a jaxfuse target out of its command buffers.

It also times each decode loop once warm (ms a step, wall): in a graph the stage kernels' launches
are nodes with programmatic edges (CUDA 12.3+ captures them); a graph whose stage-kernel step is
slower than the same launches on the stream ('off') has lost them, which it reports (a warning:
the results are right either way).
"""

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile
import time

TARGETS = {"train_step": {"jaxfuse_global_norm", "jaxfuse_adam"},
           "decode_loop": {"jaxfuse_decoder"}}
SCHEDULES = ("persistent", "stage_kernels")
CONFIGS = {
    "off": "--xla_gpu_enable_command_buffer=",
    "default": "--xla_gpu_graph_min_graph_size=1",
    "forced": "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1",
}


def child(out_path: str) -> None:
  """Runs both programs and saves every result to out_path (npz)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  import jaxfuse

  sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
  from helpers import random_decoder_problem  # the tests' decoder inputs

  assert jax.devices()[0].platform == "gpu", jax.devices()
  results = {}
  k = jax.random.split(jax.random.key(0), 4)
  params = {"w1": jax.random.normal(k[0], (256, 512)) * 0.05,
            "b1": jax.random.normal(k[3], (512,)) * 0.01,
            "w2": jax.random.normal(k[1], (512, 10)) * 0.05}
  x = jax.random.normal(k[2], (64, 256))
  y = jnp.arange(64) % 10
  import optax
  tx = optax.chain(jaxfuse.clip_by_global_norm(1.0), jaxfuse.adamw(1e-3, weight_decay=0.1))

  def loss_fn(p):
    h = jax.nn.relu(x @ p["w1"] + p["b1"])
    return optax.softmax_cross_entropy_with_integer_labels(h @ p["w2"], y).mean()

  def train_step(p, s):
    loss, g = jax.value_and_grad(loss_fn)(p)
    p, s, norm = jaxfuse.fused_step(tx, g, s, p, return_grad_norm=True)
    return p, s, loss, norm

  train_step = jax.jit(train_step, donate_argnums=(0, 1))
  state = tx.init(params)
  for i in range(5):
    params, state, loss, norm = train_step(params, state)
    results[f"train/loss{i}"], results[f"train/norm{i}"] = np.asarray(loss), np.asarray(norm)
  for path, leaf in jax.tree_util.tree_flatten_with_path((params, state))[0]:
    results["train/" + jax.tree_util.keystr(path)] = np.asarray(leaf)

  cfg = jaxfuse.DecoderConfig(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                              head_dim=64, intermediate_size=512, max_seq_len=64)
  h, w, cache = random_decoder_problem(cfg, 2, jnp.bfloat16, seed=1)

  def decode_loop(h, pos, cache, schedule):
    for _ in range(4):
      h, cache = jaxfuse.persistent_decoder(h, pos, w, cache, cfg, schedule=schedule)
      pos = pos + 1
    return h, pos, cache

  decode_loop = jax.jit(decode_loop, donate_argnums=(2,), static_argnums=(3,))
  first = (h, cache)
  for schedule in SCHEDULES:
    h, cache = jax.tree.map(jnp.copy, first)
    pos = jnp.array([3, 17], jnp.int32)
    for i in range(4):
      h, pos, cache = decode_loop(h, pos, cache, schedule)
      results[f"decode/{schedule}/h{i}"] = np.asarray(h.astype(jnp.float32))
    results[f"decode/{schedule}/k"] = np.asarray(cache.k.astype(jnp.float32))
    results[f"decode/{schedule}/v"] = np.asarray(cache.v.astype(jnp.float32))
    jax.block_until_ready(cache)
    t0 = time.perf_counter()
    for _ in range(10):
      h, pos, cache = decode_loop(h, jnp.array([3, 17], jnp.int32), cache, schedule)
    jax.block_until_ready(cache)
    results[f"time/{schedule}"] = np.asarray((time.perf_counter() - t0) / 40 * 1e3)
  np.savez(out_path, **results)


def captured(dump_dir: str, program: str) -> set:
  """jaxfuse targets that XLA runs inside command buffers in `program`. The thunk sequence lists
  each command buffer's thunks indented below it by id; thunk_metadata names each id's HLO
  instruction; the optimized HLO gives each custom-call instruction's target."""
  def one(pattern):
    paths = glob.glob(os.path.join(dump_dir, f"*jit_{program}.{pattern}"))
    return open(paths[0]).read() if paths else ""

  sequence = one("thunk_sequence_after_thunk_passes.txt") or one("thunk_sequence.txt")
  names = dict((int(i), n) for n, i in re.findall(
      r'profile_annotation: "([^"]+)"\s*thunk_id: (\d+)', one("thunk_metadata.txt")))
  targets = dict(re.findall(r'%([\w.-]+) = [^\n]*custom_call_target="(\w+)"',
                            "\n".join(open(p).read() for p in glob.glob(
                                os.path.join(dump_dir, f"*jit_{program}.*gpu_after_optimizations.txt")))))
  found, inside = set(), None
  for line in sequence.splitlines():
    indent = len(line) - len(line.lstrip())
    if inside is not None and indent <= inside:
      inside = None
    m = re.match(r"\s*(\d+): (\w+)", line)
    if not m:
      continue
    if m.group(2) == "kCommandBuffer":
      inside = indent
    elif inside is not None and m.group(2) == "kCustomCall":
      found.add(targets.get(names.get(int(m.group(1)), ""), f"unknown thunk {m.group(1)}"))
  return {t for t in found if t.startswith("jaxfuse_") or t.startswith("unknown")}


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--dump", default=None, help="where XLA's dumps go (default: a temporary dir)")
  ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.child:
    child(args.child)
    return 0
  import numpy as np

  dump_root = args.dump or tempfile.mkdtemp(prefix="jaxfuse_cmdbuf_")
  results, ok = {}, True
  for name, flags in CONFIGS.items():
    dump = os.path.join(dump_root, name)
    env = dict(os.environ, XLA_FLAGS=f"{flags} --xla_dump_to={dump} --xla_dump_hlo_as_text")
    out = os.path.join(dump_root, f"{name}.npz")
    proc = subprocess.run([sys.executable, __file__, "--child", out], env=env)
    if proc.returncode != 0:
      print(f"{name}: the run failed (exit {proc.returncode})")
      ok = False
      continue
    results[name] = dict(np.load(out))
    for program, wanted in TARGETS.items():
      got = captured(dump, program)
      print(f"{name:8s} {program:12s} jaxfuse targets inside command buffers: {sorted(got)}")
      if name == "off" and got:
        print("  captured with command buffers off: the flag no longer disables them")
        ok = False
      if name != "off" and not wanted <= got:
        print(f"  NOT captured: {sorted(wanted - got)}")
        ok = False
  times = {}  # config -> schedule -> ms a step
  for name, r in results.items():
    times[name] = {s: float(r.pop(f"time/{s}")) for s in SCHEDULES}
    print(f"{name:8s} decode step, ms (wall, warm): "
          + ", ".join(f"{s} {t:.3f}" for s, t in times[name].items()))
    diff = [key for key in r if key.startswith("decode/stage_kernels/") and not np.array_equal(
        r[key], r[key.replace("stage_kernels", "persistent")], equal_nan=True)]
    if diff:
      print(f"  the stage kernels' results differ from the persistent kernel's: {diff}")
      ok = False
  if "off" in results:
    for name in ("default", "forced"):
      if name not in results:
        continue
      in_graph, on_stream = times[name]["stage_kernels"], times["off"]["stage_kernels"]
      if in_graph > 1.05 * on_stream:
        print(f"  WARNING {name}: the stage kernels take {in_graph:.3f} ms a step in a graph, "
              f"{on_stream:.3f} on the stream: the graph has lost their programmatic edges?")
      diff = [key for key, a in results["off"].items()
              if not np.array_equal(a, results[name][key], equal_nan=True)]
      print(f"{name:8s} vs off: {len(results['off']) - len(diff)}/{len(results['off'])} results "
            f"bitwise equal" + (f"; differ: {diff}" if diff else ""))
      ok &= not diff
  print("OK" if ok else "FAILED")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
