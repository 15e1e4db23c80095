"""The decoder's rows in one process, each on both of the kernel's schedules (the persistent
launch; the stage kernels chained by programmatic dependent launch) beside plain XLA on the same
weights: the 16 layers alone and the whole model step (embedding, layers, final norm, LM head and
the draw at temperature 0.8), with bf16, int8 and fp8 matrices (jaxfuse.quantize: the head too),
batch 1, 4 and 16, context 1k, 4k and 16k (every row at position context - 1, cache donated).

plain XLA, on the row's own weights (XLA widens 8-bit matrices inside the step):
  layers:  jaxfuse.decoder_reference with bf16 activations and with fp32 activations (the faster
           one is the baseline: at batch 1 on the H200 it was fp32's);
  model:   the same bf16-activation layers with XLA's embedding, final norm, head and draw.
A row's cache holds its context (as a plain JAX decoder sizes it).

The rows run in order of importance (context 1k, then 4k, then 16k); a context's steps are compiled
together on a pool of threads before its rows are timed (XLA's compiler releases the GIL; the
unrolled reference's compiles would otherwise be most of the run), and each row is timed in
interleaved rounds with its baselines (medians). The table is written to --out after every row, so a
run cut off by its time limit keeps what it measured, and rows past --budget-s are listed as not
reached.

Columns: ms per step of each schedule; the faster plain's and its ratio to the faster schedule;
the bytes a step reads (weights, the head's scales included, the embedding rows only as the
head, and the K and V rows up to the position) and their floor at the copy rate measured here;
and the target where one is named (H100 figures).

On a GPU: Llama-3.2-1B (16 x D2048, 32/8 heads, hd 64, I 8192, vocab 128256 tied). On the CPU a
small model (4 x D512, 8/2 heads, hd 64, I 1536, vocab 32000), context 64/128/256, so the
script's logic runs anywhere.

  python benchmarks/bench_decoder_grid.py [--quick] [--out grid.md] [--budget-s 170]
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxfuse
from _common import copy_bandwidth, device_arguments, emit_table
from bench_decoder import LLAMA_1B_LAYERS, log, pick_device
from bench_generate import STAGES, TEMPERATURE, make_model, steps, time_step
from jaxfuse import KVCache, decoder_reference, persistent_decoder

FORMATS = ("bf16", "int8", "fp8")
SCOPES = ("layers", "model")
# The targets (ms on an H100), by (scope, matrices, batch, context): Hazy Research's megakernel
# and ~100 kernels in a CUDA graph with programmatic dependent launch run the step in 0.973 and
# 0.980 ms; int8 at 0.6x bf16; batch 16's 1.3x batch 1's and every row 1.5x plain XLA.
TARGETS = {("model", "bf16", 1, 1024): 0.95, ("layers", "bf16", 1, 1024): 0.80,
           ("model", "int8", 1, 1024): 0.57, ("model", "fp8", 1, 1024): 0.57}
JAXFUSE = ("jaxfuse", "jaxfuse stages")  # the schedules' columns


def plan(args, on_gpu):
  if on_gpu:
    return dict(base=LLAMA_1B_LAYERS, vocab=128256, batches=(1, 4, 16),
                contexts=(1024, 4096, 16384), steps=args.steps or 10, warmup=3, rounds=2,
                copy_bytes=1 << 30,
                title="Llama-3.2-1B (16 x D2048, 32/8 heads, hd 64, I 8192, vocab 128256 tied)")
  return dict(base=dict(num_layers=4, hidden_size=512, num_heads=8, num_kv_heads=2, head_dim=64,
                        intermediate_size=1536), vocab=32000,
              batches=(1, 16) if args.quick else (1, 4, 16),
              contexts=(64, 256) if args.quick else (64, 128, 256),
              steps=args.steps or 2, warmup=1, rounds=1, copy_bytes=1 << 26,
              title="4 x D512, 8/2 heads, hd 64, I 1536, vocab 32000 tied")


def make_models(p, device):
  """The bf16 model (bench_generate's) and its int8 and fp8 forms (matrices and head)."""
  models = {"bf16": make_model(dict(p, context=max(p["contexts"]), quantize=None), device)[0]}
  for fmt in FORMATS[1:]:
    log(f"quantizing to {fmt} ...")
    models[fmt] = jax.block_until_ready(jaxfuse.quantize(models["bf16"], fmt))
  return models


def with_context(model, context):
  return dataclasses.replace(model, config=dataclasses.replace(model.config,
                                                               max_seq_len=context))


# The layers' step functions, with bench_generate's whole-model ones (steps()): (model, inputs,
# positions, cache, key) -> (outputs, cache); the model an argument, as in a user's jitted step
# (closed over, XLA would fold its weights in as constants).
def fused_layers(schedule):
  def step(model, x, positions, cache, key):
    del key
    return persistent_decoder(x, positions, model.layers, cache, model.config, schedule=schedule)
  return step


def plain_layers(activation_dtype):
  def step(model, x, positions, cache, key):
    del key
    return decoder_reference(x, positions, model.layers, cache, model.config,
                             activation_dtype=activation_dtype)
  return step


@dataclasses.dataclass
class Row:
  scope: str
  fmt: str
  batch: int
  context: int
  times: dict = dataclasses.field(default_factory=dict)  # function name -> seconds
  read_bytes: int = 0

  def functions(self):
    """(name, jitted step, cache donated) of the row: jaxfuse's on each schedule, then its plain
    XLA baselines."""
    if self.scope == "layers":
      fns = [("jaxfuse", fused_layers("persistent")),
             ("jaxfuse stages", fused_layers("stage_kernels")),
             ("plain-bf16", plain_layers(jnp.bfloat16)), ("plain-f32", plain_layers(None))]
      return [(name, jax.jit(fn, donate_argnums=(3,))) for name, fn in fns]
    model_steps = steps(filtered=False)
    return [("jaxfuse", model_steps["jaxfuse"]), ("jaxfuse stages", model_steps[STAGES]),
            ("plain", model_steps["plain XLA"])]

  def inputs(self, model, device):
    cfg = model.config
    if self.scope == "layers":
      rng = np.random.default_rng(self.batch)
      x = jnp.asarray(rng.standard_normal((self.batch, cfg.hidden_size)), jnp.bfloat16)
    else:
      x = jnp.arange(self.batch, dtype=jnp.int32) * 7 % model.vocab_size
    positions = np.full((self.batch,), self.context - 1, np.int32)
    return jax.device_put((x, positions), device)

  def cache_struct(self, model):
    shape = model.config.cache_shape(self.batch)
    return KVCache(*[jax.ShapeDtypeStruct(shape, jnp.bfloat16)] * 2)


def step_read_bytes(row, model):
  """The bytes a step reads: the matrices and norms (and for the model its final norm and head,
  the embedding only as the tied head), and the K and V rows up to the position."""
  cfg = model.config
  leaves = [model.layers]
  if row.scope == "model":
    leaves += [model.final_norm, (model.embed,) if model.tied else
               (model.lm_head, model.lm_head_scale)]
  weights = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(leaves))
  return weights + cfg.num_layers * row.batch * row.context * cfg.kv_dim * 2 * 2


def compile_rows(rows, models, device, workers):
  """{(row, name): compiled step} for `rows`: lowered in turn, compiled on `workers` threads."""
  lowered = {}
  for row in rows:
    model = with_context(models[row.fmt], row.context)
    args = (model, *row.inputs(model, device), row.cache_struct(model), jax.random.key(0))
    for name, fn in row.functions():
      lowered[id(row), name] = fn.lower(*args)
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    futures = {key: pool.submit(low.compile) for key, low in lowered.items()}
    return {key: f.result() for key, f in futures.items()}


def time_row(row, compiled, model, device, p):
  """Interleaved rounds of each function of the row (bench_generate's time_step); medians into
  row.times."""
  x, positions = row.inputs(model, device)
  shape = model.config.cache_shape(row.batch)
  names = [name for key, name in compiled if key == id(row)]
  caches = {name: jax.device_put(KVCache(*(jnp.full(shape, v, jnp.bfloat16) for v in (0.5, 1.0))),
                                 device) for name in names}
  rounds = {name: [] for name in names}
  for _ in range(p["rounds"]):
    for name in names:
      t, caches[name] = time_step(compiled[id(row), name], model, x, positions, caches[name],
                                  p["steps"], p["warmup"])
      rounds[name].append(t)
  row.times = {name: float(np.median(r)) for name, r in rounds.items()}


def table(rows, p, device, copy_gbs, reached, elapsed):
  lines = [
      f"### decoder step rows, both schedules, {p['title']}",
      f"device: {device.device_kind} ({device.platform}); copy bandwidth measured here "
      f"{copy_gbs:.1f} GB/s; sampling at temperature {TEMPERATURE} (model rows); medians of "
      f"{p['rounds']} interleaved rounds of {p['steps']} steps; {elapsed:.0f} s in all",
      "",
      "| scope | matrices | batch | context | persistent ms | stage kernels ms | plain ms | "
      "vs plain | GB read | floor ms (copy rate) | jaxfuse % of copy rate | target ms (H100) |",
      "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for i, r in enumerate(rows):
    head = f"| {r.scope} | {r.fmt} | {r.batch} | {r.context} |"
    if i >= reached:
      lines.append(head + " not reached | | | | | | | |")
      continue
    persistent, stages = (r.times[name] for name in JAXFUSE)
    t = min(persistent, stages)
    plain = min(v for k, v in r.times.items() if k not in JAXFUSE)
    floor = r.read_bytes / copy_gbs / 1e9
    target = TARGETS.get((r.scope, r.fmt, r.batch, r.context))
    lines.append(f"{head} {persistent * 1e3:.3f} | {stages * 1e3:.3f} | {plain * 1e3:.3f} | "
                 f"{plain / t:.2f}x | "
                 f"{r.read_bytes / 1e9:.3f} | {floor * 1e3:.3f} | {100 * floor / t:.0f}% | "
                 f"{'' if target is None else target} |")
  return "\n".join(lines)


def run_rows(rows, models, device, p, deadline, done):
  """Times `rows` in order, a context's rows compiled together first; stops at `deadline`
  (perf_counter seconds). Calls done(count) after each row."""
  workers = max(1, min(16, os.cpu_count() or 1))
  count = 0
  for ctx in dict.fromkeys(r.context for r in rows):
    group = [r for r in rows if r.context == ctx]
    if time.perf_counter() > deadline:
      return
    t = time.perf_counter()
    compiled = compile_rows(group, models, device, workers)
    log(f"context {ctx}: {len(compiled)} steps compiled in {time.perf_counter() - t:.0f} s")
    for row in group:
      if time.perf_counter() > deadline:
        return
      model = with_context(models[row.fmt], row.context)
      row.read_bytes = step_read_bytes(row, model)
      time_row(row, compiled, model, device, p)
      count += 1
      log(f"  {row.scope} {row.fmt} batch {row.batch} context {row.context}: "
          + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in row.times.items()))
      done(count)


def main():
  ap = device_arguments(__doc__, "fewer rows on the CPU")
  ap.add_argument("--steps", type=int, default=None)
  ap.add_argument("--budget-s", type=float, default=170.0,
                  help="rows that would start after this many seconds are not run")
  args = ap.parse_args()
  t0 = time.perf_counter()
  device = pick_device(args.device)
  p = plan(args, device.platform == "gpu")
  log(f"device: {device} ({device.device_kind}); {p['title']}")
  copy_gbs = copy_bandwidth(device, p["copy_bytes"], 3)
  models = make_models(p, device)
  rows = [Row(scope, fmt, b, ctx) for ctx in p["contexts"] for fmt in FORMATS
          for scope in SCOPES for b in p["batches"]]
  reached = [0]
  text = lambda: table(rows, p, device, copy_gbs, reached[0], time.perf_counter() - t0)

  def done(count):
    reached[0] = count
    if args.out:  # as it goes: a run cut off by its time limit keeps its rows
      with open(args.out, "w") as f:
        f.write(text() + "\n")

  run_rows(rows, models, device, p, t0 + args.budget_s, done)
  emit_table(text(), args.out)


if __name__ == "__main__":
  main()
