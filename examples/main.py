"""jaxfuse end to end: train a small Llama-style character model with jaxfuse's fused AdamW, then
generate text from it with jaxfuse.generate (the persistent decoder) and with the same loop on the
plain-JAX reference decoder.

  1. train   train_char_lm.train on Python standard-library source (no download; bytes, vocab
             256): clip_by_global_norm + AdamW applied by jaxfuse.fused_step in a jitted,
             donating train step. Saves loss.png, params.npz and config.json to --out-dir.
  2. check   the trained weights through the decoders give the training forward's logits
             (jaxfuse.prefill, decoder_reference, and jaxfuse.decode_step one token at a time).
  3. decode  a batch of prompts with jaxfuse.generate: prefill and a jitted while_loop of
             decoder steps in one call (generate.py), timed: tokens/s with the persistent decoder
             and with decoder_reference, texts compared.
  4. quantize the model in bf16 and with int8 / fp8 matrices and LM head (jaxfuse.quantize)
             through the persistent decoder on validation text: perplexity, and how often each
             picks bf16's next byte.

    python3 examples/main.py            # ~4 minutes on a 2-core CPU (default device: GPU if any)
    python3 examples/main.py --quick    # under a minute
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import jax
import numpy as np

import jaxfuse
from generate import DEFAULT_PROMPTS, check_decoders, compare, quantized_accuracy
from train_char_lm import (PRESETS, build_model_config, count_params, init_params, load_corpus,
                           plot_history, save_params, train)


def parse_args() -> argparse.Namespace:
  here = os.path.dirname(os.path.abspath(__file__))
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="smaller model, fewer steps (<1 min)")
  parser.add_argument("--out-dir", default=os.path.join(here, "out"),
                      help="where loss.png, params.npz and config.json go (examples/out)")
  parser.add_argument("--prompt", action="append",
                      help="a generation prompt (repeat for a batch; default: 4 Python snippets)")
  parser.add_argument("--max-new", type=int,
                      help="bytes to generate per prompt (default: up to the trained context)")
  parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (0.8)")
  parser.add_argument("--greedy", action="store_true", help="argmax decoding (temperature 0)")
  parser.add_argument("--seed", type=int, default=0, help="init, data and sampling seed (0)")
  return parser.parse_args()


def train_model(args, preset, corpus, device):
  """1. Train; saves the loss plot and the params. Returns (params, cfg, history)."""
  cfg = build_model_config(vocab_size=256, dim=preset["dim"], n_layers=preset["layers"],
                           n_heads=preset["heads"], n_kv_heads=preset["kv_heads"],
                           max_seq_len=preset["seq_len"])
  n_params = count_params(jax.eval_shape(functools.partial(init_params, cfg), jax.random.key(0)))
  print(f"\n== train: {n_params / 1e6:.2f} M params (L={cfg.n_layers} D={cfg.dim} H={cfg.n_heads} "
        f"KV={cfg.n_kv_heads} I={cfg.hidden_dim}), {preset['steps']} steps of "
        f"{preset['batch']} x {preset['seq_len']} bytes from {len(corpus) / 2**20:.1f} MiB of "
        "Python stdlib source")
  params, history = train(cfg, corpus, steps=preset["steps"], batch=preset["batch"],
                          seq_len=preset["seq_len"], log_every=preset["log_every"],
                          seed=args.seed, device=device)
  title = (f"char LM on Python stdlib: {n_params / 1e6:.2f}M params, L={cfg.n_layers} "
           f"D={cfg.dim} H={cfg.n_heads} KV={cfg.n_kv_heads}, jaxfuse AdamW on {device.platform}")
  print(f"loss plot: {plot_history(history, os.path.join(args.out_dir, 'loss.png'), title)}")
  print(f"params:    {save_params(params, cfg, args.out_dir)}")
  return params, cfg, history


def check_model(params, cfg, corpus) -> None:
  """2. The decoders compute the trained model: two full-context windows from the end of the
  corpus (the validation split) against the training forward's logits."""
  windows = np.frombuffer(corpus[-2 * cfg.max_seq_len:], np.uint8).reshape(2, cfg.max_seq_len)
  diffs = check_decoders(params, cfg, windows)
  print(f"\n== check: max |logits - training forward logits| over 2 x {cfg.max_seq_len} "
        f"positions: prefill (last position) {diffs['prefill']:.1e}, decoder_reference "
        f"{diffs['reference']:.1e}, decode_step steps {diffs['steps']:.1e} "
        f"(max |logit| {diffs['max_logit']:.1f})")
  tol = 1e-4 * max(1.0, diffs["max_logit"])
  if max(diffs["prefill"], diffs["reference"], diffs["steps"]) > tol:
    raise SystemExit(f"decoder logits differ from the training forward by more than {tol:.1e}")


def check_quantized(params, cfg, corpus) -> dict[str, dict[str, float]]:
  """4. The model with quantized matrices and LM head on 16 validation windows, against itself in
  bf16."""
  windows = np.frombuffer(corpus[-16 * cfg.max_seq_len:], np.uint8).reshape(16, cfg.max_seq_len)
  quantized = quantized_accuracy(params, cfg, windows)
  base = quantized["bf16"]["perplexity"]
  print(f"\n== quantize: validation perplexity through the persistent decoder, 16 x "
        f"{cfg.max_seq_len} bytes")
  for name, r in quantized.items():
    print(f"  {name:5s} perplexity {r['perplexity']:.4f} ({100 * (r['perplexity'] / base - 1):+.2f}%"
          f" vs bf16), next byte as bf16's {100 * r['top1_agreement']:.1f}%")
  return quantized


def print_summary(history, results, quantized, n_prompts, n_new, log_every, wall_s,
                  platform) -> None:
  fused, ref = results["jaxfuse"], results["reference"]
  base = quantized["bf16"]["perplexity"]
  same = sum(np.array_equal(a, b) for a, b in zip(fused["tokens"], ref["tokens"]))
  rows = [
      ("train loss (mean of last %d steps)" % log_every,
       f"{np.mean(history['loss'][-log_every:]):.3f} nats/byte (from {history['loss'][0]:.3f})"),
      ("val loss", f"{history['val_loss'][-1]:.3f} nats/byte (from {history['val_loss'][0]:.3f})"),
      ("train step (jaxfuse AdamW)", f"{history['ms_per_step']:.1f} ms/step"),
      ("train throughput", f"{history['tokens_per_s']:,.0f} tokens/s"),
      ("generate, persistent_decoder", f"{fused['tokens_per_s']:,.0f} tokens/s"),
      ("generate, decoder_reference (plain JAX)", f"{ref['tokens_per_s']:,.0f} tokens/s"),
      ("decode speedup, jaxfuse / reference",
       f"{fused['tokens_per_s'] / ref['tokens_per_s']:.2f}x ({n_prompts} x {n_new} tokens)"),
      ("texts identical (jaxfuse vs reference)", f"{same}/{n_prompts}"),
      *((f"val perplexity, {name} matrices",
         f"{q['perplexity']:.3f} ({100 * (q['perplexity'] / base - 1):+.2f}% vs bf16, next byte "
         f"as bf16's {100 * q['top1_agreement']:.1f}%)") for name, q in quantized.items()),
      ("wall time", f"{wall_s:.0f} s on {platform}"),
  ]
  width = max(len(name) for name, _ in rows)
  print("\n== summary")
  for name, value in rows:
    print(f"  {name:{width}s}  {value}")


def main() -> None:
  args = parse_args()
  preset = PRESETS["quick" if args.quick else "default"]
  t_start = time.perf_counter()
  device = jax.devices()[0]
  print(f"device: {device} ({device.platform}, {device.device_kind}) | "
        f"jaxfuse {jaxfuse.__version__}")
  corpus = load_corpus(seed=args.seed)
  params, cfg, history = train_model(args, preset, corpus, device)
  check_model(params, cfg, corpus)
  # 3. Generate with both decoders.
  prompts = [p.encode() for p in (args.prompt or DEFAULT_PROMPTS)]
  n_new = args.max_new or max(16, cfg.max_seq_len - max(len(p) for p in prompts))
  print("\n== generate")
  results = compare(params, cfg, prompts, n_new, seed=args.seed,
                    temperature=0.0 if args.greedy else args.temperature)
  quantized = check_quantized(params, cfg, corpus)
  print_summary(history, results, quantized, len(prompts), n_new, preset["log_every"],
                time.perf_counter() - t_start, device.platform)


if __name__ == "__main__":
  main()
