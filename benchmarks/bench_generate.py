"""Whole-model decode benchmark: a step that takes tokens and returns the next tokens, and
jaxfuse.generate's tokens per second, side by side with plain XLA.

Step (one token per batch row, every row at position context - 1, cache donated, sampling at
temperature 0.8 with the step's key, with `--filter` from the top-k 50 and then top-p 0.9
scores; each function timed in interleaved rounds, the median reported):
  jaxfuse:       one jaxfuse_decoder call for the whole model (jaxfuse.decode_step's path with the
                 draw): embedding gather, every layer, final norm, LM head and the draw, on the
                 persistent schedule (one launch);
  jaxfuse stages: the same call on the stage-kernel schedule (a launch per stage, chained by
                 programmatic dependent launch);
  layers+XLA:    the layers in the kernel (jaxfuse.persistent_decoder), the embedding, final
                 norm, head and draw in XLA: the path before the head moved into the kernel;
  plain XLA:     jaxfuse.decoder_reference(activation_dtype=bf16) with the same XLA embedding,
                 head and draw.
Bytes per step = every weight (layers, and the head's V x D) + the K and V rows read; GB/s and %
of a device copy measured here.

`--quantize int8|fp8`: the same model with its matrices and its LM head quantized
(jaxfuse.quantize; the tied head becomes its own 8-bit rows), every step on those weights, plus
one more column: the kernel's step with the head kept in bf16 (quantize(..., head=False)).
`--filter`: two more columns, the kernel's step returning its logits and XLA filtering and
drawing (jaxfuse._decode.generation._sample, as every XLA column does: the path before the
filters moved into the kernel), and the kernel's step drawing without the filters (what they cost in it).

generate: jaxfuse.generate (prefill and every decode step in one jitted call, one kernel call
per token), on either schedule, against decoder="reference" (the same loop in plain XLA), from 16-token prompts, N
new tokens per row (no stop tokens), tokens/s = batch * N / wall time: greedy, or with
`--filter` sampled and filtered as the steps.

On a GPU: Llama-3.2-1B (16 x D2048, 32/8 heads, hd 64, I 8192, vocab 128256 tied, bf16), batch
1/4/16, context 1024. On the CPU: 4 x D512, 8/2 heads, hd 64, I 1536, vocab 32000 tied, batch
1/4/16, context 128 (`--quick`: fewer steps; batch 1 and 16 on the CPU).

  python benchmarks/bench_generate.py [--quick] [--filter] [--out results.md] [--device cpu|gpu]
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxfuse
from _common import copy_bandwidth, device_arguments, emit_table
from bench_decoder import LLAMA_1B_LAYERS, log, make_weights, pick_device
from jaxfuse import DecoderConfig, KVCache, decoder_reference, persistent_decoder
from jaxfuse._decode import generation

TEMPERATURE = 0.8
FILTER = dict(top_k=50, top_p=0.9)  # --filter: Hugging Face's default top-k with a nucleus


def plan(args, on_gpu):
  if on_gpu:
    p = dict(base=LLAMA_1B_LAYERS, vocab=128256, batches=[1, 4, 16], context=1024,
             steps=args.steps or 20, warmup=3, rounds=3, new_tokens=128, gen_batches=[1, 16],
             title="Llama-3.2-1B (16 x D2048, 32/8 heads, hd 64, I 8192, vocab 128256 tied), bf16",
             copy_bytes=1 << 30)
  else:
    p = dict(base=dict(num_layers=4, hidden_size=512, num_heads=8, num_kv_heads=2, head_dim=64,
                       intermediate_size=1536), vocab=32000, batches=[1, 4, 16], context=128,
             steps=args.steps or 10, warmup=2, rounds=5, new_tokens=32, gen_batches=[1, 4],
             title="4 x D512, 8/2 heads, hd 64, I 1536, vocab 32000 tied, bf16",
             copy_bytes=1 << 28)
  if args.quick:  # on a GPU, tools/gpu_check.sh quick: issue 40's batch rows
    p.update(batches=[1, 4, 16] if on_gpu else [1, 16], steps=args.steps or (10 if on_gpu else 3),
             rounds=2, gen_batches=[1], new_tokens=p["new_tokens"] // 2)
  return p


def make_model(p, device):
  """The benchmark's model, and with p["quantize"] the same model with its head in bf16 (else
  None)."""
  cfg = DecoderConfig(**p["base"], max_seq_len=p["context"])
  layers = make_weights(cfg, jnp.bfloat16, device)
  D = cfg.hidden_size
  with jax.default_device(device):
    embed = jax.jit(lambda k: (jax.random.normal(k, (p["vocab"], D)) * 0.5).astype(
        jnp.bfloat16))(jax.random.PRNGKey(7))
    model = jaxfuse.DecoderModel(cfg, layers, embed, jnp.ones((D,), jnp.bfloat16))
  model = jax.block_until_ready(jax.device_put(model, device))
  if p["quantize"] is None:
    return model, None
  log(f"quantizing the matrices and the head to {p['quantize']} ...")
  quantized = jax.block_until_ready(jaxfuse.quantize(model, p["quantize"]))
  return quantized, dataclasses.replace(quantized, lm_head=None, lm_head_scale=None)


def step_bytes(model):
  """The bytes a step reads of the model: the layers, the final norm and the head (its scales
  included); the embedding only when it is the head (the gather reads B rows of it)."""
  head = (model.embed,) if model.tied else (model.lm_head, model.lm_head_scale)
  leaves = jax.tree.leaves((model.layers, model.final_norm, head))
  return sum(a.size * a.dtype.itemsize for a in leaves)


def steps(filtered: bool):
  """The step functions: (model, tokens, positions, cache, key) -> (next tokens, cache), the
  model an argument as in a user's jitted step (closed over, its 2.5 GB would be compiled in as
  constants); with `filtered`, drawn from the FILTER scores, and one more: the kernel's logits
  drawn in XLA."""
  top_k, top_p = (FILTER["top_k"], FILTER["top_p"]) if filtered else (None, None)

  def jaxfuse_on(schedule):
    def jaxfuse_step(model, tokens, positions, cache, key):
      data = jax.random.key_data(key)
      _, nxt, k, v = generation._model_step(model, model.config, tokens, positions, cache,
                                            TEMPERATURE, data, top_k, top_p, schedule=schedule)
      return nxt, KVCache(k, v)
    return jaxfuse_step

  def draw(logits, key):
    return generation._sample(logits, key, TEMPERATURE, top_k, top_p)

  def kernel_logits(model, tokens, positions, cache, key):
    logits, k, v = generation._model_step(model, model.config, tokens, positions, cache)
    return draw(logits, key), KVCache(k, v)

  def layers_xla(model, tokens, positions, cache, key):
    h, cache = persistent_decoder(model.embed_tokens(tokens), positions, model.layers, cache,
                                  model.config)
    return draw(model.logits(h), key), cache

  def plain(model, tokens, positions, cache, key):
    h, cache = decoder_reference(model.embed_tokens(tokens), positions, model.layers, cache,
                                 model.config, activation_dtype=jnp.bfloat16)
    return draw(model.logits(h), key), cache

  fns = [("jaxfuse", jaxfuse_on("persistent")), ("layers+XLA", layers_xla), ("plain XLA", plain),
         (STAGES, jaxfuse_on("stage_kernels"))]
  if filtered:
    fns.append((FILTERED_IN_XLA, kernel_logits))
  fns = {name: jax.jit(fn, donate_argnums=(3,)) for name, fn in fns}
  if filtered:
    fns[UNFILTERED] = steps(False)["jaxfuse"]
  return fns


STAGES = "jaxfuse stages"
FILTERED_IN_XLA = "jaxfuse, filter in XLA"
UNFILTERED = "jaxfuse, no filter"


def time_step(fn, model, tokens, positions, cache, n, warmup):
  """Seconds per step of n steps after warmup ones, and the cache to go on with (donated)."""
  key = jax.random.key(0)
  for i in range(warmup):
    tokens, cache = fn(model, tokens, positions, cache, jax.random.fold_in(key, i))
  jax.block_until_ready((tokens, cache))
  t0 = time.perf_counter()
  for i in range(n):
    tokens, cache = fn(model, tokens, positions, cache, jax.random.fold_in(key, i))
  jax.block_until_ready((tokens, cache))
  return (time.perf_counter() - t0) / n, cache


def measure_steps(model, bf16_head, p, device, copy_gbs):
  cfg = model.config
  weight_bytes = step_bytes(model)
  rows = []
  for B in p["batches"]:
    tokens = jax.device_put(jnp.arange(B, dtype=jnp.int32) * 7 % p["vocab"], device)
    positions = jax.device_put(jnp.full((B,), p["context"] - 1, jnp.int32), device)
    fns = {name: (fn, model) for name, fn in steps(p["filter"]).items()}
    if bf16_head is not None:
      fns["jaxfuse, bf16 head"] = (fns["jaxfuse"][0], bf16_head)
    caches = {name: jax.device_put(KVCache(*(jnp.full(cfg.cache_shape(B), v, jnp.bfloat16)
                                             for v in (0.5, 1.0))), device) for name in fns}
    rounds = {name: [] for name in fns}
    for _ in range(p["rounds"]):  # interleaved: the machine's speed drifts between rounds
      for name, (fn, m) in fns.items():
        t, caches[name] = time_step(fn, m, tokens, positions, caches[name], p["steps"],
                                    p["warmup"])
        rounds[name].append(t)
    times = {name: float(np.median(r)) for name, r in rounds.items()}
    for name, t in times.items():
      log(f"  batch {B} {name:18s} {t * 1e3:8.3f} ms/step")
    kv_bytes = cfg.num_layers * B * p["context"] * cfg.kv_dim * 2 * 2
    gbs = (weight_bytes + kv_bytes) / times["jaxfuse"] / 1e9
    extra = [times[name] * 1e3 for name in extra_columns(p)]
    rows.append((B, times["jaxfuse"] * 1e3, times["layers+XLA"] * 1e3, times["plain XLA"] * 1e3,
                 times["plain XLA"] / times["jaxfuse"], B / times["jaxfuse"],
                 (weight_bytes + kv_bytes) / 1e9, gbs, 100 * gbs / copy_gbs, extra))
  return rows


def extra_columns(p):
  """The step columns after the common ones: the stage kernels', the bf16 head's (--quantize),
  the XLA filter's."""
  return ([STAGES] + (["jaxfuse, bf16 head"] if p["quantize"] is not None else [])
          + ([FILTERED_IN_XLA, UNFILTERED] if p["filter"] else []))


def measure_generate(model, p, device):
  rows = []
  N = p["new_tokens"]
  for B in p["gen_batches"]:
    rng = np.random.default_rng(B)
    prompts = jax.device_put(rng.integers(0, p["vocab"], (B, 16)).astype(np.int32), device)
    lengths = jax.device_put(np.full((B,), 16, np.int32), device)
    rates = {}
    for name, decoder, schedule in (("persistent", "persistent", "persistent"),
                                    ("stages", "persistent", "stage_kernels"),
                                    ("reference", "reference", "persistent")):
      sampling = (dict(temperature=TEMPERATURE, key=jax.random.key(1), **FILTER) if p["filter"]
                  else {})
      run = lambda: jaxfuse.generate(model, prompts, lengths, N, decoder=decoder,
                                     schedule=schedule, **sampling)
      jax.block_until_ready(run())
      t0 = time.perf_counter()
      out, count = jax.block_until_ready(run())
      rates[name] = B * N / (time.perf_counter() - t0)
      assert int(np.asarray(count).min()) == N
      log(f"  generate batch {B} {name:10s} {rates[name]:8.1f} tokens/s")
    rows.append((B, N, rates["persistent"], rates["stages"], rates["reference"],
                 max(rates["persistent"], rates["stages"]) / rates["reference"]))
  return rows


def table(step_rows, gen_rows, p, device, copy_gbs):
  weights = (f"; {p['quantize']} matrices and LM head (jaxfuse.quantize), every column on them"
             if p["quantize"] is not None else "")
  draw = (f"temperature {TEMPERATURE}, top-k {FILTER['top_k']}, top-p {FILTER['top_p']}"
          if p["filter"] else f"temperature {TEMPERATURE}")
  extra = extra_columns(p)
  lines = [
      f"### whole-model decode step and generate, {p['title']}{weights}",
      f"device: {device.device_kind} ({device.platform}); copy bandwidth measured here "
      f"{copy_gbs:.1f} GB/s; context {p['context']}; sampling at {draw}; "
      f"cache donated; medians of {p['rounds']} interleaved rounds of {p['steps']} steps",
      "",
      "| batch | jaxfuse ms/step | layers+XLA ms/step | plain XLA ms/step | vs plain | tokens/s | "
      "GB read | jaxfuse GB/s | % of copy BW |" + "".join(f" {c} ms/step |" for c in extra),
      "|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(extra),
  ]
  for r in step_rows:
    lines.append(f"| {r[0]} | {r[1]:.3f} | {r[2]:.3f} | {r[3]:.3f} | {r[4]:.2f}x | {r[5]:.0f} | "
                 f"{r[6]:.3f} | {r[7]:.1f} | {r[8]:.0f}% |" + "".join(f" {ms:.3f} |" for ms in r[9]))
  lines += ["", "| generate batch | new tokens | jaxfuse tokens/s | jaxfuse stages tokens/s | "
            "plain XLA tokens/s | speedup (the faster jaxfuse) |", "|---:|---:|---:|---:|---:|---:|"]
  for r in gen_rows:
    lines.append(f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.1f} | {r[4]:.1f} | {r[5]:.2f}x |")
  return "\n".join(lines)


def main():
  ap = device_arguments(__doc__, "fewer cases and steps")
  ap.add_argument("--steps", type=int, default=None)
  ap.add_argument("--quantize", choices=("int8", "fp8"), default=None,
                  help="the matrices and the LM head in int8 or fp8 (jaxfuse.quantize)")
  ap.add_argument("--filter", action="store_true",
                  help=f"draw from the top-k {FILTER['top_k']}, top-p {FILTER['top_p']} scores")
  args = ap.parse_args()
  device = pick_device(args.device)
  p = dict(plan(args, device.platform == "gpu"), quantize=args.quantize, filter=args.filter)
  log(f"device: {device} ({device.device_kind}); {p['title']}")
  copy_gbs = copy_bandwidth(device, p["copy_bytes"], 5)
  log(f"measured copy bandwidth: {copy_gbs:.1f} GB/s; initializing the model ...")
  model, bf16_head = make_model(p, device)
  step_rows = measure_steps(model, bf16_head, p, device, copy_gbs)
  gen_rows = measure_generate(model, p, device)
  emit_table(table(step_rows, gen_rows, p, device, copy_gbs), args.out)


if __name__ == "__main__":
  main()
