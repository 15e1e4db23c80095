"""Checks that XLA captures jaxfuse's custom calls into CUDA graphs (command buffers).

Run with XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text" on a GPU machine:
  python3 tools/check_command_buffers.py DIR
It jits a small training step (model + optax.chain(jaxfuse.clip_by_global_norm, jaxfuse.adamw)
through jaxfuse.fused_step), runs it, and looks for the jaxfuse custom calls inside command
buffers: in the optimized HLO (older XLA formed them in an HLO pass, as command_buffer*
computations) and in the thunk dumps (newer XLA converts thunks: *thunk_sequence*.txt, where a
command-buffer thunk's nested thunks are indented below it). Exit status 1 if they are not
captured.
"""

import glob
import os
import re
import sys

# Capture even small graphs, so the check does not depend on the step's size.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_graph_min_graph_size=1"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import jaxfuse  # noqa: E402


def main(dump_dir: str) -> int:
  if jax.devices()[0].platform != "gpu":
    print("no GPU: nothing to check")
    return 0
  k = jax.random.split(jax.random.key(0), 3)
  params = {"w1": jax.random.normal(k[0], (256, 512)) * 0.05, "b1": jnp.zeros((512,)),
            "w2": jax.random.normal(k[1], (512, 10)) * 0.05}
  x = jax.random.normal(k[2], (64, 256))
  y = jnp.arange(64) % 10
  tx = optax.chain(jaxfuse.clip_by_global_norm(1.0), jaxfuse.adamw(1e-3))

  def loss_fn(p):
    h = jax.nn.relu(x @ p["w1"] + p["b1"])
    return optax.softmax_cross_entropy_with_integer_labels(h @ p["w2"], y).mean()

  @jax.jit
  def train_step(p, s):
    loss, g = jax.value_and_grad(loss_fn)(p)
    p, s, norm = jaxfuse.fused_step(tx, g, s, p, return_grad_norm=True)
    return p, s, loss, norm

  state = tx.init(params)
  for _ in range(3):
    params, state, loss, norm = train_step(params, state)
  print("loss", float(loss), "grad norm", float(norm))

  texts = [open(f).read() for f in glob.glob(os.path.join(dump_dir, "*train_step*after_optimizations.txt"))]
  if not texts:
    print("no optimized HLO dump found in", dump_dir)
    return 1
  text = max(texts, key=len)
  # Command-buffer computations are named command_buffer*; find the ones with our targets.
  captured = set()
  for m in re.finditer(r"\n(%?command_buffer[\w.]*)[^\n]*\{\n(.*?)\n\}", text, re.S):
    captured |= set(re.findall(r'custom_call_target="(jaxfuse_\w+)"', m.group(2)))
  captured |= captured_in_thunk_dumps(dump_dir)
  wanted = {"jaxfuse_global_norm", "jaxfuse_adam"}
  print("jaxfuse targets inside command buffers:", sorted(captured))
  if not wanted <= captured:
    print("NOT captured:", sorted(wanted - captured))
    return 1
  return 0


def captured_in_thunk_dumps(dump_dir: str) -> set:
  """jaxfuse targets on lines nested (indented) below a command-buffer thunk in XLA's thunk
  dumps; the lines involved are printed for the log."""
  captured = set()
  for path in glob.glob(os.path.join(dump_dir, "*train_step*thunk_sequence*.txt")):
    inside_indent = None
    for line in open(path):
      indent = len(line) - len(line.lstrip())
      if inside_indent is not None and indent <= inside_indent:
        inside_indent = None
      if re.search(r"command.?buffer", line, re.I):
        inside_indent = indent if inside_indent is None else inside_indent
        print(os.path.basename(path), "|", line.rstrip()[:160])
      elif inside_indent is not None:
        found = set(re.findall(r"jaxfuse_\w+", line))
        if found:
          print(os.path.basename(path), "|", line.rstrip()[:160])
        captured |= found
  return captured


if __name__ == "__main__":
  sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/jaxfuse_hlo_dump"))
