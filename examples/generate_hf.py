"""Generate text from a local Hugging Face checkpoint (Llama 2/3/3.1/3.2, Mistral, Qwen2, Qwen3)
with jaxfuse: ``jaxfuse.load_hf`` then ``jaxfuse.generate`` (prefill in XLA, then one jitted
while_loop of persistent-decoder steps).

    python3 examples/generate_hf.py /path/to/Llama-3.2-1B --prompt "The capital of France is"
    python3 examples/generate_hf.py PATH --prompt "Hi" --prompt "Once upon a time" \\
        --temperature 0.7 --top-p 0.9 --max-new 64 --compare

The folder holds ``config.json`` and ``model.safetensors`` (or sharded files with their index),
as downloaded from the Hub; nothing is downloaded here. Text prompts need ``tokenizer.json`` and
the optional ``tokenizers`` package (``pip install "jaxfuse[hf]"``); without them pass token ids
with ``--tokens 128000,791,6864``. ``--compare`` also runs the same loop on the plain-JAX
reference decoder and prints both speeds.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import numpy as np

import jaxfuse


def parse_args() -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("path", help="checkpoint folder (config.json + *.safetensors)")
  parser.add_argument("--prompt", action="append", help="a text prompt (repeat for a batch)")
  parser.add_argument("--tokens", action="append",
                      help="a prompt as comma-separated token ids (no tokenizer needed)")
  parser.add_argument("--max-new", type=int, default=32, help="new tokens per prompt (32)")
  parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
  parser.add_argument("--top-k", type=int, help="sample from the k most likely tokens")
  parser.add_argument("--top-p", type=float, help="nucleus sampling mass")
  parser.add_argument("--seed", type=int, default=0, help="sampling key (0)")
  parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                      help="weights dtype (default: the checkpoint's)")
  parser.add_argument("--no-stop", action="store_true",
                      help="ignore the checkpoint's end-of-sequence tokens")
  parser.add_argument("--compare", action="store_true",
                      help="also run the plain-JAX reference decoder and compare speed")
  args = parser.parse_args()
  if not args.prompt and not args.tokens:
    parser.error("give at least one --prompt or --tokens")
  return args


def load_tokenizer(path: str):
  """The checkpoint's tokenizer.json through the `tokenizers` package, or None."""
  file = os.path.join(path, "tokenizer.json")
  if not os.path.exists(file):
    return None
  try:
    from tokenizers import Tokenizer
  except ImportError:
    return None
  return Tokenizer.from_file(file)


def encode(args, tokenizer) -> tuple[np.ndarray, np.ndarray]:
  """The prompts as right-padded int32 [B, T] ids and their lengths."""
  prompts = [[int(t) for t in s.split(",")] for s in args.tokens or []]
  if args.prompt:
    if tokenizer is None:
      raise SystemExit("text prompts need tokenizer.json in the checkpoint folder and the "
                       "`tokenizers` package (pip install \"jaxfuse[hf]\"); or pass --tokens")
    prompts += [tokenizer.encode(p).ids for p in args.prompt]
  lengths = np.array([len(p) for p in prompts], np.int32)
  tokens = np.zeros((len(prompts), lengths.max()), np.int32)
  for row, p in zip(tokens, prompts):
    row[:len(p)] = p
  return tokens, lengths


def timed_generate(model, tokens, lengths, args, decoder: str):
  """Runs generate twice (the first call compiles); returns (tokens, lengths, seconds, first)."""
  kwargs = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                key=jax.random.key(args.seed), decoder=decoder,
                stop_tokens=() if args.no_stop else model.stop_tokens)
  t0 = time.perf_counter()
  jax.block_until_ready(jaxfuse.generate(model, tokens, lengths, args.max_new, **kwargs))
  first = time.perf_counter() - t0
  t0 = time.perf_counter()
  out, count = jax.block_until_ready(jaxfuse.generate(model, tokens, lengths, args.max_new,
                                                      **kwargs))
  return np.asarray(out), np.asarray(count), time.perf_counter() - t0, first


def main() -> None:
  args = parse_args()
  t0 = time.perf_counter()
  model = jaxfuse.load_hf(args.path, dtype=args.dtype)
  c = model.config
  n_params = sum(a.size for a in jax.tree.leaves(model))
  print(f"{args.path}: {n_params / 1e6:,.1f} M params in {model.dtype}, L={c.num_layers} "
        f"D={c.hidden_size} heads {c.num_heads}/{c.num_kv_heads} hd={c.head_dim} "
        f"I={c.intermediate_size} vocab {model.vocab_size}, qkv_bias={c.qkv_bias} "
        f"qk_norm={c.qk_norm} rope_scaling={c.rope_scaling}; loaded in "
        f"{time.perf_counter() - t0:.1f} s on {jax.devices()[0]}")
  tokenizer = load_tokenizer(args.path)
  tokens, lengths = encode(args, tokenizer)
  runs = {"persistent": timed_generate(model, tokens, lengths, args, "persistent")}
  if args.compare:
    runs["reference"] = timed_generate(model, tokens, lengths, args, "reference")
  for decoder, (out, count, seconds, first) in runs.items():
    print(f"{decoder:10s}: {count.sum()} tokens in {1e3 * seconds:.1f} ms "
          f"({count.sum() / seconds:,.1f} tokens/s incl. prefill; first call {first:.1f} s)")
  out, count = runs["persistent"][:2]
  if args.compare:
    same = np.array_equal(out, runs["reference"][0])
    print(f"persistent / reference speed: {runs['reference'][2] / runs['persistent'][2]:.2f}x; "
          f"tokens {'identical' if same else 'differ (near-ties order differently)'}")
  for b in range(len(lengths)):
    prompt, new = tokens[b, :lengths[b]].tolist(), out[b, :count[b]].tolist()
    if tokenizer is not None:
      print(f"\n[{b}] {tokenizer.decode(prompt)}|{tokenizer.decode(new)}")
    else:
      print(f"\n[{b}] {prompt} | {new}")


if __name__ == "__main__":
  main()
