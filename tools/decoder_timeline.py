"""Where the persistent decoder's step goes, stage by stage, on each of the kernel's schedules
(jaxfuse/_decode/timeline.py).

For each schedule and batch, one decode step of the layers (Llama-3.2-1B's 16 on a GPU, bf16,
every row at position context - 1) records every block's times in every stage; beside it, the
same step without the timeline, timed as bench_decoder.py times it, so the timeline's step can be
checked against the step users run. Writes a markdown table per schedule and batch (the stages'
shares of the step, their blocks' work, waits and wake latencies) and a PNG of batch 1's blocks
over time per schedule (the stage kernels' named with the schedule). With ``--model`` the whole
step (embedding, layers, head, greedy draw) at batch 1 and 16 too: the head's share at 16 shows
whether it reads its weights once for all 16 rows. In the stage kernels' timeline a block of a
stage is a block of its own launch: one may enter before the previous stage's last block leaves
(its first weights loading), and its first wait ends when the previous launch has finished.

  python3 tools/decoder_timeline.py [--out timeline.md] [--plot timeline.png] [--batches 1,4,16]
      [--schedules persistent,stage_kernels]
"""

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import jaxfuse  # noqa: E402
from bench_decoder import LLAMA_1B_LAYERS, make_weights, pick_device, time_steps  # noqa: E402
from jaxfuse._decode import timeline  # noqa: E402

SMALL_LAYERS = dict(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                    intermediate_size=512)


def log(*a):
  print(*a, file=sys.stderr, flush=True)


def inputs(cfg, batch, context, dtype, device):
  rng = np.random.default_rng(batch)
  x = jax.device_put(jnp.asarray(rng.standard_normal((batch, cfg.hidden_size)), dtype), device)
  positions = jax.device_put(np.full((batch,), context - 1, np.int32), device)
  with jax.default_device(device):
    k = jax.random.normal(jax.random.PRNGKey(1), cfg.cache_shape(batch)).astype(dtype)
  return x, positions, jax.device_put(jaxfuse.KVCache(k, k * 0.5), device)


def recorded(run, repeats=3):
  """The last of ``repeats`` timelines (the first compiles)."""
  for _ in range(repeats):
    result = run()
  return result[-1]


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", help="also write the tables to this markdown file")
  ap.add_argument("--plot", help="save batch 1's timeline as this PNG")
  ap.add_argument("--batches", default="1,4,16")
  ap.add_argument("--context", type=int, default=1024)
  ap.add_argument("--model", action="store_true", help="also the whole step at batch 1 and 16")
  ap.add_argument("--device", choices=["cpu", "gpu"])
  ap.add_argument("--schedules", default="persistent,stage_kernels")
  args = ap.parse_args()
  device = pick_device(args.device)
  on_gpu = device.platform == "gpu"
  shapes = LLAMA_1B_LAYERS if on_gpu else SMALL_LAYERS
  context = args.context if on_gpu else min(args.context, 128)
  cfg = jaxfuse.DecoderConfig(**shapes, max_seq_len=context)
  w = make_weights(cfg, jnp.bfloat16, device)
  sections = [f"# Decoder stage timeline: {device.device_kind}, {cfg.num_layers} x "
              f"D{cfg.hidden_size}, bf16, context {context}"]
  schedules = args.schedules.split(",")
  for schedule in schedules:
    for batch in [int(b) for b in args.batches.split(",")]:
      x, positions, cache = inputs(cfg, batch, context, jnp.bfloat16, device)
      tl = recorded(lambda: timeline.layers_timeline(x, positions, w, cache, cfg, schedule))
      steps = 20 if on_gpu else 3
      # The plain step, cache donated, as bench_decoder.py times it.
      step = jax.jit(lambda x, p, w, c: jaxfuse.persistent_decoder(x, p, w, c, cfg,
                                                                   schedule=schedule),
                     donate_argnums=(3,))
      plain = time_steps(step, x, positions, w, cache, steps, warmup=3)[0] * 1e3
      sections.append(f"## The layers, {schedule}, batch {batch}: the step without the timeline "
                      f"{plain:.3f} ms (wall, the mean of {steps})\n\n{tl.summary()}")
      log(sections[-1] + "\n")
      if batch == 1 and args.plot:
        root, ext = os.path.splitext(args.plot)
        tl.plot(args.plot if schedule == "persistent" else f"{root}_{schedule}{ext}")
  for schedule in schedules if args.model else ():
    for batch in (1, 16):
      sections.append(model_section(cfg, w, device, batch, schedule))
      log(sections[-1])
  if args.out:
    with open(args.out, "w") as f:
      f.write("\n\n".join(sections) + "\n")


def model_section(cfg, layers, device, batch, schedule, vocab=128256):
  """The whole step's timeline: the layers with Llama-3.2-1B's embedding and tied head (on a
  GPU)."""
  vocab = vocab if device.platform == "gpu" else 1000
  with jax.default_device(device):
    embed = jax.random.normal(jax.random.PRNGKey(2), (vocab, cfg.hidden_size)).astype(jnp.bfloat16)
    norm = jnp.ones((cfg.hidden_size,), jnp.bfloat16)
  model = jaxfuse.DecoderModel(cfg, layers, embed, norm, None)
  cache = jax.device_put(jaxfuse.init_cache(model, batch, cfg.max_seq_len), device)
  tokens = jax.device_put(np.arange(7, 7 + batch, dtype=np.int32), device)
  positions = jax.device_put(np.full((batch,), cfg.max_seq_len - 1, np.int32), device)
  tl = recorded(lambda: timeline.model_timeline(model, tokens, positions, cache,
                                                schedule=schedule))
  return (f"## The whole step (vocabulary {vocab}, tied head, greedy draw), {schedule}, batch "
          f"{batch}\n\n" + tl.summary())


if __name__ == "__main__":
  main()
