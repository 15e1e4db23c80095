"""Generate text from the character model trained by train_char_lm.py, with jaxfuse's persistent
decoder and with the plain-JAX reference, and compare their decode speed.

The trained ``params["layers"]`` are a ``jaxfuse.DecoderWeights`` as they are: the training
forward's layer math is the decoder's (RMSNorm, rotate-half RoPE, grouped-query attention,
SwiGLU, pre-norm residuals; :func:`check_decoders` verifies it numerically). The decoder returns
the hidden state after the last layer; the final RMSNorm and the LM head are applied here.

For a batch of prompts (byte strings, any lengths):

  1. prefill: one ``jaxfuse.decoder_reference`` call over all prompt tokens at once (causal
     attention; the padding of shorter prompts gets position -1, which never touches the
     cache), giving the KV cache and each row's next-token logits. Both decoders continue from
     this same prefill.
  2. decode: ONE jitted call, the KV cache donated, runs a ``lax.fori_loop`` of ``n_new`` steps:
     sample a token per row (temperature, or argmax with ``--greedy``), embed it, run the
     decoder step (``jaxfuse.persistent_decoder``: all layers in one custom call; or
     ``jaxfuse.decoder_reference``), apply the head. Rows decode at their own positions.

Only the decode call is timed (compiled ahead, best of ``--repeats``, ``block_until_ready``).
Both decoders get the same prefill and PRNG key, so their texts agree unless two candidate logits
are so close that the two fp32 computations order them differently.

    python3 examples/generate.py                          # params from examples/out/
    python3 examples/generate.py --greedy --max-new 200 --prompt 'def main(' --prompt 'import '
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jaxfuse
from train_char_lm import ModelConfig, Params, forward, lm_logits, load_params

DECODERS = {"jaxfuse": jaxfuse.persistent_decoder, "reference": jaxfuse.decoder_reference}

DEFAULT_PROMPTS = ("def __init__(self, ", "import os\nimport ", "class ", "    for i in range(")


def decoder_config(cfg: ModelConfig, max_seq_len: int) -> jaxfuse.DecoderConfig:
  """The decoder's view of the model, with a KV cache of `max_seq_len` positions."""
  return jaxfuse.DecoderConfig(
      num_layers=cfg.n_layers, hidden_size=cfg.dim, num_heads=cfg.n_heads,
      num_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, intermediate_size=cfg.hidden_dim,
      max_seq_len=max_seq_len, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta)


def decoder_weights(params: Params) -> jaxfuse.DecoderWeights:
  return jaxfuse.DecoderWeights(**{name: params["layers"][name]
                                   for name in jaxfuse.DecoderWeights._fields})


def empty_cache(dcfg: jaxfuse.DecoderConfig, batch: int, dtype=jnp.float32) -> jaxfuse.KVCache:
  return jaxfuse.KVCache(jnp.zeros(dcfg.cache_shape(batch), dtype),
                         jnp.zeros(dcfg.cache_shape(batch), dtype))


def check_decoders(params: Params, cfg: ModelConfig, tokens) -> dict[str, float]:
  """Logits of the training `forward` on `tokens` [B, T] vs the same logits through the decoders:
  a `decoder_reference` prefill of all T tokens, and T `persistent_decoder` steps (a scan, one
  token per step). Returns the largest absolute differences and the largest |logit|.
  Matmuls run at full fp32 precision (on GPUs the default would be TF32)."""
  tokens = jnp.asarray(tokens, jnp.int32)
  B, T = tokens.shape
  dcfg = decoder_config(cfg, T)

  @jax.jit
  def run(params, tokens):
    w, x = decoder_weights(params), params["embed"][tokens]
    h, _ = jaxfuse.decoder_reference(x, jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)),
                                     w, empty_cache(dcfg, B), dcfg)

    def step(cache, t):
      h_t, cache = jaxfuse.persistent_decoder(x[:, t], jnp.full((B,), t, jnp.int32), w, cache,
                                              dcfg)
      return cache, h_t

    _, h_steps = lax.scan(step, empty_cache(dcfg, B), jnp.arange(T))  # [T, B, D]
    return (forward(params, tokens, cfg), lm_logits(params, h, cfg),
            lm_logits(params, h_steps.swapaxes(0, 1), cfg))

  with jax.default_matmul_precision("highest"):
    want, prefill, steps = run(params, tokens)
  return {"prefill": float(jnp.abs(prefill - want).max()),
          "steps": float(jnp.abs(steps - want).max()),
          "max_logit": float(jnp.abs(want).max())}


def encode(prompts: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
  """Byte prompts -> (tokens int32 [B, T] zero-padded on the right, lengths int32 [B])."""
  if not prompts or not all(prompts):
    raise ValueError("need at least one prompt, and no empty prompt")
  lengths = np.array([len(p) for p in prompts], np.int32)
  tokens = np.zeros((len(prompts), lengths.max()), np.int32)
  for row, p in zip(tokens, prompts):
    row[:len(p)] = np.frombuffer(p, np.uint8)
  return tokens, lengths


def prefill(params: Params, tokens: jax.Array, lengths: jax.Array, *, cfg: ModelConfig,
            dcfg: jaxfuse.DecoderConfig) -> tuple[jax.Array, jaxfuse.KVCache]:
  """One decoder_reference call over the padded prompts: (next-token logits [B, V], KV cache)."""
  B, T = tokens.shape
  t = jnp.arange(T, dtype=jnp.int32)
  positions = jnp.where(t < lengths[:, None], t, -1)  # padding: position -1, never cached
  h, cache = jaxfuse.decoder_reference(params["embed"][tokens], positions,
                                       decoder_weights(params), empty_cache(dcfg, B), dcfg)
  return lm_logits(params, h[jnp.arange(B), lengths - 1], cfg), cache


def decode(params: Params, cache: jaxfuse.KVCache, logits: jax.Array, lengths: jax.Array,
           key: jax.Array, *, decoder, n_new: int, temperature: float, cfg: ModelConfig,
           dcfg: jaxfuse.DecoderConfig) -> tuple[jax.Array, jaxfuse.KVCache]:
  """n_new steps of sample -> decoder step -> next logits, in one fori_loop. Row b's i-th new
  token goes to position lengths[b] + i. Returns (new tokens int32 [B, n_new], KV cache)."""
  w = decoder_weights(params)

  def body(i, carry):
    cache, logits, out = carry
    if temperature > 0:
      token = jax.random.categorical(jax.random.fold_in(key, i), logits / temperature)
    else:
      token = jnp.argmax(logits, axis=-1)
    token = token.astype(jnp.int32)
    h, cache = decoder(params["embed"][token], lengths + i, w, cache, dcfg)
    return cache, lm_logits(params, h, cfg), out.at[:, i].set(token)

  out = jnp.zeros((logits.shape[0], n_new), jnp.int32)
  cache, _, out = lax.fori_loop(0, n_new, body, (cache, logits, out))
  return out, cache


def generate(params: Params, cfg: ModelConfig, prompts: list[bytes], n_new: int, *,
             decoder: str = "jaxfuse", temperature: float = 0.8, seed: int = 0,
             repeats: int = 5) -> dict[str, Any]:
  """Prefills `prompts` and decodes `n_new` bytes for each with `decoder` ("jaxfuse" or
  "reference"); temperature 0 is greedy. Decodes `repeats` times from a fresh prefill (same key,
  so the same tokens) and times the fastest decode call, compiled beforehand.

  Returns {"tokens": int [B, n_new], "texts": list[bytes] (prompt + continuation),
  "decode_s", "tokens_per_s" (B * n_new / decode_s), "compile_s"}.
  """
  device = jax.devices()[0]
  params = jax.device_put(params, device)
  tokens, lengths = encode(prompts)
  tokens, lengths = jax.device_put((tokens, lengths), device)
  key = jax.device_put(jax.random.key(seed), device)
  dcfg = decoder_config(cfg, int(lengths.max()) + n_new)
  run_prefill = jax.jit(functools.partial(prefill, cfg=cfg, dcfg=dcfg))
  run_decode = jax.jit(functools.partial(decode, decoder=DECODERS[decoder], n_new=n_new,
                                         temperature=temperature, cfg=cfg, dcfg=dcfg),
                       donate_argnums=1)  # the KV cache

  logits, cache = run_prefill(params, tokens, lengths)
  t0 = time.perf_counter()
  compiled = run_decode.lower(params, cache, logits, lengths, key).compile()
  compile_s = time.perf_counter() - t0
  times = []
  for _ in range(max(1, repeats)):
    logits, cache = jax.block_until_ready(run_prefill(params, tokens, lengths))
    t0 = time.perf_counter()
    out, cache = jax.block_until_ready(compiled(params, cache, logits, lengths, key))
    times.append(time.perf_counter() - t0)
  out = np.asarray(out)
  decode_s = min(times)
  return {"tokens": out, "texts": [p + bytes(row.astype(np.uint8)) for p, row in zip(prompts, out)],
          "decode_s": decode_s, "tokens_per_s": out.size / decode_s, "compile_s": compile_s}


def compare(params: Params, cfg: ModelConfig, prompts: list[bytes], n_new: int, *,
            temperature: float = 0.8, seed: int = 0, repeats: int = 5,
            show_text: bool = True) -> dict[str, dict[str, Any]]:
  """`generate` with both decoders; prints tokens/s, their ratio, whether the texts match and
  (with `show_text`) the texts. Returns {"jaxfuse": result, "reference": result}."""
  mode = "greedy" if temperature <= 0 else f"temperature {temperature}, seed {seed}"
  longest = max(len(p) for p in prompts)
  print(f"decode: batch {len(prompts)} x {n_new} new bytes ({mode}), prompts up to {longest} "
        f"bytes, KV cache {longest + n_new} positions")
  if longest + n_new > cfg.max_seq_len:
    print(f"  note: positions beyond the trained context ({cfg.max_seq_len}) are extrapolation; "
          "expect the text to degrade there")
  results = {}
  for name, label in (("jaxfuse", "jaxfuse.persistent_decoder"),
                      ("reference", "jaxfuse.decoder_reference (plain JAX)")):
    r = results[name] = generate(params, cfg, prompts, n_new, decoder=name,
                                 temperature=temperature, seed=seed, repeats=repeats)
    print(f"  {label:38s} {r['tokens_per_s']:9,.0f} tokens/s  ({1e3 * r['decode_s']:7.2f} ms "
          f"for {n_new} steps, best of {repeats}; compile {r['compile_s']:.2f} s)")
  speedup = results["jaxfuse"]["tokens_per_s"] / results["reference"]["tokens_per_s"]
  print(f"  jaxfuse / reference: {speedup:.2f}x")
  same = [bool(np.array_equal(a, b)) for a, b in
          zip(results["jaxfuse"]["tokens"], results["reference"]["tokens"])]
  if all(same):
    print(f"  texts: identical ({len(same)}/{len(same)} prompts)")
  else:
    for b, ok in enumerate(same):
      if not ok:
        first = int(np.argmax(results["jaxfuse"]["tokens"][b] != results["reference"]["tokens"][b]))
        print(f"  texts: prompt {b} differs from new byte {first} on (normally a near-tie "
              "between two logits, ordered differently by the two fp32 computations)")
  if show_text:
    for name in results:
      print(f"\n----- {name} " + "-" * 60)
      for b, text in enumerate(results[name]["texts"]):
        print(f"[{b}] " + text.decode("utf-8", errors="replace"))
  return results


def main() -> None:
  here = os.path.dirname(os.path.abspath(__file__))
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out-dir", default=os.path.join(here, "out"),
                      help="where train_char_lm.py saved params.npz and config.json")
  parser.add_argument("--prompt", action="append",
                      help="a prompt (repeat for a batch; default: 4 Python snippets)")
  parser.add_argument("--max-new", type=int,
                      help="bytes to generate per prompt (default: up to the trained context)")
  parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (0.8)")
  parser.add_argument("--greedy", action="store_true", help="argmax decoding (temperature 0)")
  parser.add_argument("--seed", type=int, default=0, help="sampling key (0)")
  parser.add_argument("--repeats", type=int, default=5, help="timed decode calls per decoder (5)")
  args = parser.parse_args()

  params, cfg = load_params(args.out_dir)
  prompts = [p.encode() for p in (args.prompt or DEFAULT_PROMPTS)]
  n_new = args.max_new or max(16, cfg.max_seq_len - max(len(p) for p in prompts))
  device = jax.devices()[0]
  print(f"device: {device} ({device.platform}) | model from {args.out_dir}: L={cfg.n_layers} "
        f"D={cfg.dim} H={cfg.n_heads} KV={cfg.n_kv_heads} hd={cfg.head_dim} I={cfg.hidden_dim}")

  diffs = check_decoders(params, cfg, encode(prompts[:1])[0])
  print(f"decoder check on prompt 0, max |logits - forward logits|: reference prefill "
        f"{diffs['prefill']:.1e}, persistent_decoder steps {diffs['steps']:.1e} "
        f"(max |logit| {diffs['max_logit']:.1f})")
  compare(params, cfg, prompts, n_new, temperature=0.0 if args.greedy else args.temperature,
          seed=args.seed, repeats=args.repeats)


if __name__ == "__main__":
  main()
