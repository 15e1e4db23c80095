"""Generate text from the character model trained by train_char_lm.py with ``jaxfuse.generate``
(the persistent decoder) and with the same loop on the plain-JAX reference decoder, and compare
their decode speed.

The trained ``params["layers"]`` hold exactly the decoder's layer weights (the training
forward's layer math is the decoder's: RMSNorm, rotate-half RoPE, grouped-query attention,
SwiGLU, pre-norm residuals; :func:`check_decoders` verifies it numerically), so
:func:`decoder_model` wraps them, the embedding, the final norm and the head as a
``jaxfuse.DecoderModel``. Then, for a batch of prompts (byte strings, any lengths), ONE jitted
``jaxfuse.generate`` call prefills all prompts at once (plain XLA) and runs every decode step in
a ``lax.while_loop``: sample (temperature, or argmax with ``--greedy``), embed, all layers in one
``jaxfuse.persistent_decoder`` call, final norm and head. ``decoder="reference"`` runs the same
loop with ``jaxfuse.decoder_reference``.

Timed: the whole generate call (prefill included), compiled ahead, best of ``--repeats``. Both
decoders get the same prompts and key, so their texts agree unless two candidate logits are so
close that the two fp32 computations order them differently.

    python3 examples/generate.py                          # params from examples/out/
    python3 examples/generate.py --greedy --max-new 200 --prompt 'def main(' --prompt 'import '
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxfuse
from train_char_lm import ModelConfig, Params, forward, load_params

DEFAULT_PROMPTS = ("def __init__(self, ", "import os\nimport ", "class ", "    for i in range(")


def decoder_model(params: Params, cfg: ModelConfig, max_seq_len: int) -> jaxfuse.DecoderModel:
  """The trained model as a jaxfuse.DecoderModel supporting sequences of `max_seq_len`."""
  dcfg = jaxfuse.DecoderConfig(
      num_layers=cfg.n_layers, hidden_size=cfg.dim, num_heads=cfg.n_heads,
      num_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, intermediate_size=cfg.hidden_dim,
      max_seq_len=max_seq_len, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta)
  layers = jaxfuse.DecoderWeights(**{name: jnp.asarray(a) for name, a in params["layers"].items()})
  head = None if cfg.tie_embeddings else jnp.asarray(params["lm_head"]).T  # [V, D], as HF's
  return jaxfuse.DecoderModel(dcfg, layers, jnp.asarray(params["embed"]),
                              jnp.asarray(params["final_norm"]), head)


def check_decoders(params: Params, cfg: ModelConfig, tokens) -> dict[str, float]:
  """Logits of the training `forward` on `tokens` [B, T] vs the same logits through jaxfuse:
  `jaxfuse.prefill` of all T tokens (its logits after the last one), `decoder_reference` over
  all T positions (the logits after every prefix), and T `jaxfuse.decode_step` calls (a scan, one
  token per step). Returns the largest absolute differences and the largest |logit|. Matmuls run
  at full fp32 precision (on GPUs the default would be TF32)."""
  tokens = jnp.asarray(tokens, jnp.int32)
  B, T = tokens.shape
  model = decoder_model(params, cfg, T)

  @jax.jit
  def run(params, model, tokens):
    cache = jaxfuse.init_cache(model, B, T)
    last, _ = jaxfuse.prefill(model, tokens, jnp.full((B,), T, jnp.int32), cache)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    h, _ = jaxfuse.decoder_reference(model.embed_tokens(tokens), positions, model.layers, cache,
                                     model.config)

    def step(cache, t):
      logits, cache = jaxfuse.decode_step(model, tokens[:, t], jnp.full((B,), t, jnp.int32), cache)
      return cache, logits

    _, steps = jax.lax.scan(step, cache, jnp.arange(T))  # [T, B, V]
    return forward(params, tokens, cfg), last, model.logits(h), steps.swapaxes(0, 1)

  with jax.default_matmul_precision("highest"):
    want, last, reference, steps = run(params, model, tokens)
  return {"prefill": float(jnp.abs(last - want[:, -1]).max()),
          "reference": float(jnp.abs(reference - want).max()),
          "steps": float(jnp.abs(steps - want).max()),
          "max_logit": float(jnp.abs(want).max())}


def quantized_accuracy(params: Params, cfg: ModelConfig, tokens) -> dict[str, dict[str, float]]:
  """The trained model in bf16 and with its matrices and LM head in int8 and fp8
  (jaxfuse.quantize), each teacher-forced through the persistent decoder (one
  `jaxfuse.decode_step` per position) over `tokens` [B, T]. Returns per mode the next-byte loss
  (nats), its perplexity and the fraction of positions whose argmax equals bf16's."""
  tokens = jnp.asarray(tokens, jnp.int32)
  B, T = tokens.shape
  bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), decoder_model(params, cfg, T))
  models = {"bf16": bf16, "int8": jaxfuse.quantize(bf16, "int8"),
            "fp8": jaxfuse.quantize(bf16, "fp8")}

  @jax.jit
  def logits_of(model, tokens):
    def step(cache, t):
      logits, cache = jaxfuse.decode_step(model, tokens[:, t], jnp.full((B,), t, jnp.int32), cache)
      return cache, logits
    return jax.lax.scan(step, jaxfuse.init_cache(model, B, T), jnp.arange(T))[1].swapaxes(0, 1)

  logits = {name: logits_of(model, tokens)[:, :-1] for name, model in models.items()}
  results = {}
  for name, lg in logits.items():
    nll = -jnp.take_along_axis(jax.nn.log_softmax(lg), tokens[:, 1:, None], axis=-1)
    loss = float(nll.mean())
    results[name] = {"loss": loss, "perplexity": float(np.exp(loss)),
                     "top1_agreement": float(jnp.mean(lg.argmax(-1) == logits["bf16"].argmax(-1)))}
  return results


def encode(prompts: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
  """Byte prompts -> (tokens int32 [B, T] zero-padded on the right, lengths int32 [B])."""
  if not prompts or not all(prompts):
    raise ValueError("need at least one prompt, and no empty prompt")
  lengths = np.array([len(p) for p in prompts], np.int32)
  tokens = np.zeros((len(prompts), lengths.max()), np.int32)
  for row, p in zip(tokens, prompts):
    row[:len(p)] = np.frombuffer(p, np.uint8)
  return tokens, lengths


def generate(params: Params, cfg: ModelConfig, prompts: list[bytes], n_new: int, *,
             decoder: str = "persistent", temperature: float = 0.8, seed: int = 0,
             repeats: int = 5) -> dict[str, Any]:
  """`n_new` bytes after each of `prompts` with ``jaxfuse.generate`` on `decoder` ("persistent"
  or "reference"); temperature 0 is greedy. Runs `repeats` times (same key, so the same tokens)
  and times the fastest call, compiled beforehand.

  Returns {"tokens": int [B, n_new], "texts": list[bytes] (prompt + continuation),
  "decode_s", "tokens_per_s" (B * n_new / decode_s), "compile_s"}.
  """
  device = jax.devices()[0]
  tokens, lengths = encode(prompts)
  with jax.default_device(device):
    model = decoder_model(params, cfg, tokens.shape[1] + n_new)
    key = jax.random.key(seed)
  options = dict(temperature=temperature, key=key, decoder=decoder)
  if temperature > 0:
    options["top_k"] = 40
  t0 = time.perf_counter()
  out, _ = jax.block_until_ready(jaxfuse.generate(model, tokens, lengths, n_new, **options))
  compile_s = time.perf_counter() - t0  # the first call: tracing, compiling and one run
  times = []
  for _ in range(max(1, repeats)):
    t0 = time.perf_counter()
    out, _ = jax.block_until_ready(jaxfuse.generate(model, tokens, lengths, n_new, **options))
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
  for name, decoder, label in (
      ("jaxfuse", "persistent", "jaxfuse.generate (persistent_decoder)"),
      ("reference", "reference", "same loop, decoder_reference (plain JAX)")):
    r = results[name] = generate(params, cfg, prompts, n_new, decoder=decoder,
                                 temperature=temperature, seed=seed, repeats=repeats)
    print(f"  {label:42s} {r['tokens_per_s']:9,.0f} tokens/s  ({1e3 * r['decode_s']:7.2f} ms "
          f"for prefill + {n_new} steps, best of {repeats}; first call {r['compile_s']:.2f} s)")
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
  print(f"decoder check on prompt 0, max |logits - forward logits|: prefill "
        f"{diffs['prefill']:.1e}, decoder_reference {diffs['reference']:.1e}, persistent_decoder "
        f"steps {diffs['steps']:.1e} (max |logit| {diffs['max_logit']:.1f})")
  compare(params, cfg, prompts, n_new, temperature=0.0 if args.greedy else args.temperature,
          seed=args.seed, repeats=args.repeats)


if __name__ == "__main__":
  main()
