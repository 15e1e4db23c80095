"""jaxfuse.generate / decode_step / prefill against a teacher-forced full-model reference: the
logits after row b's first n tokens from decoder_reference (fp32 activations) over those n tokens,
no cache reuse. Each generated token must be the reference's argmax given the tokens before it,
up to a near-tie (TIE_TOL); teacher forcing keeps every step comparable after a tie."""

import dataclasses
import functools
import os
import runpy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jaxfuse
from jaxfuse._decode import generation
from hf_checkpoints import write_checkpoint
from helpers import assert_bitwise_equal, random_decoder_problem, reference_logits

# Near-tie tolerance on logits, relative to the largest |logit| of the step: fp32 differs by
# summation order only (~1e-6); a 16-bit model by its prefill's 16-bit matrix inputs and one
# rounding of the layer output and the cached k/v at slightly different values (bf16: 2^-8
# relative), compounding over two layers.
TIE_TOL = {jnp.float32: 1e-4, jnp.bfloat16: 3e-2}


def random_model(dtype=jnp.float32, vocab=61, tied=False, seed=0, hidden=64, **features):
  """A small random DecoderModel whose logits are O(3) (not dominated by the embedding)."""
  cfg = jaxfuse.DecoderConfig(2, hidden, 4, 2, 16, 96, 48, **features)
  _, w, _ = random_decoder_problem(cfg, 1, dtype, seed)
  rng = np.random.default_rng(seed + 1)
  embed = jnp.asarray(rng.standard_normal((vocab, hidden)), dtype)
  head = None if tied else jnp.asarray(0.4 * rng.standard_normal((vocab, hidden)), dtype)
  final_norm = jnp.asarray(1.0 + 0.1 * rng.standard_normal(hidden), dtype)
  return jaxfuse.DecoderModel(cfg, w, embed, final_norm, head)


def assert_follows_reference(model, prompts, lengths, out, count, tol):
  """Each of row b's first count[b] tokens is the reference's argmax up to a near-tie."""
  prompts, lengths, out, count = (np.asarray(a) for a in (prompts, lengths, out, count))
  (B, T), N = prompts.shape, out.shape[1]
  # Each row's prompt, then its generated tokens.
  seq = np.pad(np.where(np.arange(T) < lengths[:, None], prompts, 0), ((0, 0), (0, N)))
  seq[np.arange(B)[:, None], lengths[:, None] + np.arange(N)] = np.maximum(out, 0)
  # Causal: the logits after token t see tokens 0..t only, so one pass teacher-forces every step.
  ref = np.asarray(reference_logits(model, jnp.asarray(seq)))
  ref = ref[np.arange(B)[:, None], lengths[:, None] - 1 + np.arange(N)]  # [B, N, V]
  for b in range(B):
    for i in range(count[b]):
      logits = ref[b, i]
      best = logits.max()
      assert logits[out[b, i]] >= best - tol * np.abs(logits).max(), (
          f"row {b} token {i}: generated {out[b, i]} (logit {logits[out[b, i]]:.6f}), reference "
          f"argmax {logits.argmax()} (logit {best:.6f})")
    assert np.all(out[b, count[b]:] == -1)


def prompts_for(model, batch, width, seed):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, model.vocab_size, (batch, width)).astype(np.int32)
  lengths = np.array([width, 1, max(1, width // 2), width - 1][:batch], np.int32)
  return tokens, lengths


# Each architecture from Hugging Face files (tests/hf_checkpoints.py; test_hf.py checks load_hf's
# logits against an independent NumPy forward pass): fp32 and bf16, tied and untied, scaled RoPE;
# and an int8 model (load_hf(quantize=)), against the reference on the same quantized weights.
HF_CASES = [("LlamaForCausalLM", "llama3", "float32", False, None),
            ("MistralForCausalLM", "default", "bfloat16", False, None),
            ("Qwen2ForCausalLM", "default", "float32", True, None),
            ("Qwen3ForCausalLM", "default", "bfloat16", False, None),
            ("MistralForCausalLM", "default", "bfloat16", False, "int8")]


@pytest.mark.parametrize("arch,rope,dtype,tied,quantize", HF_CASES,
                         ids=[c[0][:-11] + (f"-{c[4]}" if c[4] else "") for c in HF_CASES])
def test_greedy_follows_reference(tmp_path, arch, rope, dtype, tied, quantize):
  write_checkpoint(tmp_path, arch, dtype=dtype, tied=tied, rope=rope, seed=len(arch))
  model = jaxfuse.load_hf(tmp_path, quantize=quantize)
  dtype = model.dtype.type
  prompts, lengths = prompts_for(model, 4, 7, seed=1)
  out, count = jaxfuse.generate(model, prompts, lengths, 9)
  assert out.shape == (4, 9) and out.dtype == jnp.int32 and np.all(np.asarray(count) == 9)
  assert_follows_reference(model, prompts, lengths, out, count, TIE_TOL[dtype])
  if jax.default_backend() == "gpu":  # the CPU handler has one schedule
    assert_bitwise_equal(jaxfuse.generate(model, prompts, lengths, 9, schedule="stage_kernels"),
                         (out, count), "either schedule: the same bits, the same tokens")
  ref_out, ref_count = jaxfuse.generate(model, prompts, lengths, 9, decoder="reference")
  if dtype == jnp.float32:  # the same loop with the plain-JAX step: identical tokens
    np.testing.assert_array_equal(out, ref_out)
  np.testing.assert_array_equal(count, ref_count)


def test_decode_step_logits():
  model = random_model(jnp.float32, tied=True)
  prompts, lengths = prompts_for(model, 3, 5, seed=2)
  cache = jaxfuse.init_cache(model, 3, 12)
  logits, cache = jax.jit(jaxfuse.prefill)(model, prompts, lengths, cache)
  token = np.asarray(jnp.argmax(logits, -1), np.int32)
  step = jax.jit(jaxfuse.decode_step, donate_argnums=3)
  got, cache = step(model, token, jnp.asarray(lengths), cache)
  seq = np.pad(np.where(np.arange(5) < lengths[:, None], prompts, 0), ((0, 0), (0, 7)))
  seq[np.arange(3), lengths] = token  # each row's prompt, then the token
  want = np.asarray(reference_logits(model, jnp.asarray(seq)))[np.arange(3), lengths]
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * float(np.abs(want).max()))
  # A traced out-of-range position: NaN logits for that row, the others unaffected.
  bad_positions = jnp.asarray([-1, 5, 12], jnp.int32)
  bad, _ = step(model, token, bad_positions, jaxfuse.init_cache(model, 3, 12))
  assert np.isnan(np.asarray(bad)[[0, 2]]).all() and np.isfinite(np.asarray(bad)[1]).all()
  # With check_positions under checkify, the same call reports the first bad row.
  checked = checkify.checkify(jax.jit(functools.partial(jaxfuse.decode_step, check_positions=True)))
  err, (logits, _) = checked(model, token, bad_positions, jaxfuse.init_cache(model, 3, 12))
  with pytest.raises(checkify.JaxRuntimeError, match=r"decode_step: positions\[0\] = -1 is outside "
                     r"\[0, 12\) \(the cache length\)"):
    err.throw()
  np.testing.assert_array_equal(logits, bad)


_model_step = jax.jit(generation._model_step, static_argnums=(1, 5, 7, 8))
_sample = jax.jit(generation._sample, static_argnames=("temperature", "top_k", "top_p"))


@pytest.mark.parametrize("dtype,tied", [(jnp.float32, False), (jnp.bfloat16, True)])
def test_whole_step_draws_what_jax_draws(dtype, tied):
  """One call for the whole model: its logits are the reference's, and its next tokens are
  jnp.argmax of them (temperature 0) or exactly jax.random.categorical's draw from them with the
  same key (the same threefry bits and Gumbel noise, sampling_math.h)."""
  model = random_model(dtype, vocab=300, tied=tied, seed=7)
  prompts, lengths = prompts_for(model, 4, 5, seed=8)
  cache = jaxfuse.init_cache(model, 4, 9)
  logits, cache = jax.jit(jaxfuse.prefill)(model, prompts, lengths, cache)
  tokens, positions = jnp.argmax(logits, -1).astype(jnp.int32), jnp.asarray(lengths)
  cfg = generation._cache_config(model, cache)
  want, _ = jaxfuse.decode_step(model, tokens, positions, cache, decoder="reference")
  tol = TIE_TOL[dtype] * float(np.abs(want).max())
  for temperature, seed in ((0.0, 0), (0.7, 1), (1.5, 2)):
    key = jax.random.key(seed)
    got, drawn, _, _ = _model_step(model, cfg, tokens, positions, cache, temperature,
                                   jax.random.key_data(key))
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)
    expected = (jnp.argmax(got, -1) if temperature == 0.0
                else jax.random.categorical(key, got / jnp.float32(temperature)))
    np.testing.assert_array_equal(drawn, expected)
  # Which keys the kernel draws with: threefry ones, typed or raw; others sample in XLA.
  data = generation._kernel_key_data
  np.testing.assert_array_equal(data(jax.random.PRNGKey(3)), jax.random.key_data(jax.random.key(3)))
  assert data(jax.random.key(3, impl="rbg")) is None


def test_filtered_draws_in_the_kernel():
  """top-k and top-p in the kernel's draw are _sample's (XLA's top_k, sort and cumsum, then
  jax.random.categorical) for 24 keys, four rows, each filter alone and together. Ten head rows
  are one row scaled up, so each batch row has ten tied logits at its top or bottom: top_k=4
  must keep all ten at the top (as _sample's ``logits < kth`` does), and so must a nucleus."""
  model = random_model(vocab=2500, seed=11)
  head = np.asarray(model.lm_head).copy()
  head[100:110] = 4.0 * head[100]
  model = dataclasses.replace(model, lm_head=jnp.asarray(head))
  cache = jaxfuse.init_cache(model, 4, 8)
  cfg = generation._cache_config(model, cache)
  tokens, positions = jnp.asarray([3, 77, 1200, 2499], jnp.int32), jnp.asarray([0, 3, 5, 7])
  tied_draws = 0
  for temperature, top_k, top_p in ((1.0, 4, None), (0.7, None, 0.8), (1.5, 50, 0.95),
                                    (1.0, 2400, 0.05)):
    for seed in range(24):
      key = jax.random.key(seed)
      logits, drawn, _, _ = _model_step(model, cfg, tokens, positions, cache, temperature,
                                        jax.random.key_data(key), top_k, top_p)
      want = _sample(logits, key, temperature=temperature, top_k=top_k, top_p=top_p)
      np.testing.assert_array_equal(drawn, want, err_msg=f"{temperature, top_k, top_p, seed}")
      tied_draws += int(np.isin(np.asarray(drawn), np.arange(101, 110)).sum())
  assert tied_draws > 20  # the ties at the top were kept, and drawn


def test_whole_step_bad_tokens():
  """A traced token outside the vocabulary is a bad row (NaN logits, its cache untouched, the
  others unaffected); a concrete one is refused."""
  model = random_model(vocab=40, seed=9)
  cache = jaxfuse.init_cache(model, 3, 6)
  step = jax.jit(jaxfuse.decode_step)
  tokens, positions = jnp.asarray([40, 3, -2], jnp.int32), jnp.asarray([0, 0, 1], jnp.int32)
  logits, new = step(model, tokens, positions, cache)
  logits = np.asarray(logits)
  assert np.isnan(logits[[0, 2]]).all() and np.isfinite(logits[1]).all()
  changed = np.asarray(new.k != cache.k).any(axis=(0, 2, 3, 4))
  np.testing.assert_array_equal(changed, [False, True, False])
  good, _ = step(model, tokens.at[0].set(3).at[2].set(3), positions, cache)
  np.testing.assert_array_equal(logits[1], np.asarray(good)[1])
  with pytest.raises(ValueError, match=r"decode_step: tokens\[0\] = 40 is outside \[0, 40\)"):
    jaxfuse.decode_step(model, np.asarray(tokens), positions, cache)


def test_decode_step_under_vmap():
  """vmap over tokens, positions and cache folds the mapped axis into the kernel's batch: each
  mapped element's logits and cache are those of its own call; a mapped key is refused."""
  model = random_model(seed=2)
  cache = jaxfuse.init_cache(model, 2, 8)
  caches = jax.tree.map(lambda a: jnp.stack([a, a + 0.1, a - 0.1]), cache)
  tokens = jnp.array([[1, 2], [3, 4], [5, 6]], jnp.int32)
  positions = jnp.array([[0, 1], [2, 3], [4, 5]], jnp.int32)
  step = lambda t, p, c: jaxfuse.decode_step(model, t, p, c)
  logits, new = jax.jit(jax.vmap(step))(tokens, positions, caches)
  for i in range(3):
    want, want_cache = step(tokens[i], positions[i], jax.tree.map(lambda a: a[i], caches))
    assert_bitwise_equal((logits[i], new.k[i]), (want, want_cache.k), f"mapped element {i}")
  cfg = generation._cache_config(model, cache)
  with pytest.raises(NotImplementedError, match=r"vmap over the weights \(sample_key\)"):
    jax.vmap(lambda k: generation._model_step(model, cfg, tokens[0], positions[0], cache, 0.7,
                                              k))(jnp.zeros((3, 2), jnp.uint32))  # mapped keys


def test_stop_tokens_per_row():
  model = random_model()
  prompts, lengths = prompts_for(model, 4, 6, seed=3)
  free = np.asarray(jaxfuse.generate(model, prompts, lengths, 8)[0])
  # Stop each row at a token it generates anyway (row 3 never stops).
  stops = [[free[0, 2], -1], [free[1, 0], free[1, 5]], [free[2, 6], -1], [-1, -1]]
  out, count = map(np.asarray, jaxfuse.generate(model, prompts, lengths, 8, stop_tokens=stops))
  for b in range(4):
    first = next((i + 1 for i, t in enumerate(free[b]) if t in stops[b]), 8)
    assert count[b] == first
    np.testing.assert_array_equal(out[b, :first], free[b, :first])
    assert np.all(out[b, first:] == -1)
  # One shared set of stop tokens, and every row stopping at once ends the loop early.
  out, count = jaxfuse.generate(model, prompts, lengths, 8, stop_tokens=free[:, 0].tolist())
  assert np.all(np.asarray(count) == 1) and np.all(np.asarray(out)[:, 1:] == -1)


def test_sampling_in_generate():
  model = random_model(seed=5)
  prompts, lengths = prompts_for(model, 4, 5, seed=4)
  sample = functools.partial(jaxfuse.generate, model, prompts, lengths, 6, temperature=1.3,
                             top_k=20, top_p=0.95)
  a, b, c = (sample(key=jax.random.key(seed))[0] for seed in (0, 0, 1))
  np.testing.assert_array_equal(a, b)  # reproducible with a key
  assert not np.array_equal(a, c)
  # The kernel's draws (a typed or a raw threefry key) and XLA's (an rbg key, which the kernel
  # cannot draw with) are jax.random's, as the reference loop's: the same tokens (an fp32 model:
  # logits within ~1e-6 of each other).
  for kw in (dict(temperature=0.9, key=jax.random.key(2)),
             dict(temperature=1.3, top_k=20, top_p=0.95, key=jax.random.PRNGKey(3)),
             dict(temperature=1.3, top_k=20, top_p=0.95, key=jax.random.key(3, impl="rbg"))):
    assert_bitwise_equal(jaxfuse.generate(model, prompts, lengths, 6, **kw),
                         jaxfuse.generate(model, prompts, lengths, 6, decoder="reference", **kw),
                         f"kernel against reference loop, {kw}")


def test_sampling_rules():
  """Temperature, top-k and top-p on one row of logits repeated 4096 times."""
  rows = 4096
  logits = np.random.default_rng(6).normal(0.0, 2.0, 31).astype(np.float32)
  batch = jnp.asarray(np.tile(logits, (rows, 1)))
  draw = lambda seed, **kw: np.asarray(_sample(batch, jax.random.key(seed), **kw))
  p = np.exp((logits - logits.max()) / 1.3)
  p /= p.sum()
  freq = np.bincount(draw(0, temperature=1.3, top_k=None, top_p=None), minlength=31) / rows
  assert 0.5 * np.abs(freq - p).sum() < 0.05  # total variation; sampling noise is ~0.02
  order = np.argsort(logits)[::-1]
  assert set(draw(1, temperature=1.3, top_k=3, top_p=None)) == set(order[:3])
  nucleus = order[:np.searchsorted(np.cumsum(p[order]), 0.6) + 1]  # smallest set reaching 0.6
  assert set(draw(2, temperature=1.3, top_k=None, top_p=0.6)) == set(nucleus)
  assert len(nucleus) < 31
  for kw in (dict(top_k=1, top_p=None), dict(top_k=None, top_p=1e-6)):
    assert np.all(draw(3, temperature=1.3, **kw) == order[0])
  assert np.all(draw(4, temperature=0.0, top_k=None, top_p=None) == order[0])


def test_inside_jit_and_edge_lengths():
  """Under jit the tokens of an eager call; traced prompt lengths (which set every position)
  under checkify with check_positions: a bad row is reported, a good batch passes with those
  tokens; the longest generation the model supports."""
  model = random_model()
  prompts, lengths = prompts_for(model, 2, 4, seed=6)
  want, want_n = jaxfuse.generate(model, prompts, lengths, 1)
  assert want.shape == (2, 1) and np.all(np.asarray(want_n) == 1)
  got, got_n = jax.jit(lambda t, n: jaxfuse.generate(model, t, n, 1))(prompts, lengths)
  np.testing.assert_array_equal(got, want)
  checked = checkify.checkify(jax.jit(
      lambda t, n: jaxfuse.generate(model, t, n, 1, check_positions=True)))
  err, (got, _) = checked(prompts, lengths)
  assert err.get() is None
  np.testing.assert_array_equal(got, want)
  for bad, row in (([4, 0], 1), ([5, 1], 0)):
    err, _ = checked(prompts, np.array(bad, np.int32))
    with pytest.raises(checkify.JaxRuntimeError, match=rf"generate: prompt_lengths\[{row}\] = "
                       rf"{bad[row]} is outside \[1, 4\] \(the prompt width\)"):
      err.throw()
  # prompt width + new tokens == max_seq_len
  out, n = jaxfuse.generate(model, prompts, lengths, model.config.max_seq_len - 4)
  assert np.all(np.asarray(n) == model.config.max_seq_len - 4)


def test_bad_arguments():
  model = random_model()
  prompts, lengths = prompts_for(model, 2, 4, seed=7)
  gen = functools.partial(jaxfuse.generate, model)
  step = functools.partial(jaxfuse.decode_step, model)
  hot = dict(temperature=1.0, key=jax.random.key(0))  # sampling
  first, cache = prompts[:, 0], jaxfuse.init_cache(model, 2, 8)  # (every call refuses: not run)
  cases = [
      (lambda: gen(prompts, lengths, 0), "max_new_tokens must be a positive integer"),
      (lambda: gen(prompts, lengths, 45), r"4 \+ max_new_tokens 45 = 49 exceeds the model's "
                                          r"max_seq_len 48 \(max_position_embeddings\); the "
                                          "longest prompt, row 0, has 4 tokens"),
      (lambda: gen(np.pad(prompts, ((0, 0), (0, 2))), lengths[::-1], 43),
       r"6 \+ max_new_tokens 43 = 49 exceeds .*; the longest prompt, row 1, has 4 tokens"),
      (lambda: gen(prompts, np.array([0, 2]), 3),
       r"generate: prompt_lengths\[0\] = 0 is outside \[1, 4\] \(the prompt width\)"),
      (lambda: gen(prompts, np.array([2, 5]), 3), r"prompt_lengths\[1\] = 5 is outside \[1, 4\]"),
      (lambda: gen(prompts, lengths[:1], 3), r"prompt_lengths must be an integer array \[2\]"),
      (lambda: gen(prompts[0], lengths, 3), "prompt_tokens must be an integer array"),
      (lambda: gen(prompts.astype(np.float32), lengths, 3), "prompt_tokens must be an integer"),
      (lambda: gen(prompts + 100, lengths, 3), r"ids outside \[0, 61\)"),
      (lambda: gen(prompts, lengths, 3, temperature=1.0), "needs a PRNG key"),
      (lambda: gen(prompts, lengths, 3, temperature=-1.0), "temperature must be finite"),
      (lambda: gen(prompts, lengths, 3, top_k=5), "set temperature > 0"),
      (lambda: gen(prompts, lengths, 3, **hot, top_k=0), "top_k must be a positive integer"),
      (lambda: gen(prompts, lengths, 3, **hot, top_p=1.5), r"top_p must be in \(0, 1\]"),
      (lambda: gen(prompts, lengths, 3, stop_tokens=[[1], [2], [3]]), "stop_tokens must be"),
      (lambda: gen(prompts, lengths, 3, stop_tokens=[[1, 2], [3]]), "stop_tokens must be"),
      (lambda: gen(prompts, lengths, 3, decoder="xla"), "decoder must be one of"),
      (lambda: gen(prompts, lengths, 3, schedule="graph"), "generate: schedule must be one of"),
      (lambda: step(first, lengths, cache, schedule="graph"),
       "decode_step: schedule must be one of"),
      (lambda: jaxfuse.generate(model.layers, prompts, lengths, 3),
       "model must be a jaxfuse.DecoderModel"),
      (lambda: jaxfuse.generate(dataclasses.replace(model, final_norm=model.final_norm[:-1]),
                                prompts, lengths, 3), r"model.final_norm has shape \(63,\)"),
      (lambda: jaxfuse.generate(dataclasses.replace(model, lm_head=model.lm_head[:-1]), prompts,
                                lengths, 3), r"model.lm_head has shape \(60, 64\), expected the"),
      (lambda: jaxfuse.init_cache(model, 2, 49), r"max_seq_len=49 must be in \[1, 48\]"),
      (lambda: step(first, lengths, (1, 2)), "cache must be a jaxfuse.KVCache"),
      (lambda: step(first, lengths, jaxfuse.init_cache(model, 3, 8)), "cache.k has shape"),
      (lambda: jaxfuse.prefill(model, prompts, lengths, jaxfuse.init_cache(model, 2, 3)),
       r"prompts \(4 tokens wide\) do not fit the cache \(3 positions\)"),
      (lambda: jaxfuse.prefill(model, prompts, [1, 0], cache),
       r"prefill: prompt_lengths\[1\] = 0 is outside \[1, 4\]"),
      (lambda: step(first, lengths[:, None], cache),
       r"decode_step: positions must be an integer array \[2\], got int32\[2, 1\]"),
  ]
  for call, match in cases:
    with pytest.raises((ValueError, TypeError), match=match):
      call()
  # Concrete positions outside the cache, with either decoder (the kernel is never reached).
  for decoder in ("persistent", "reference"):
    for positions, row in (([3, 8], 1), ([-1, 7], 0), ([9, -4], 0)):
      with pytest.raises(ValueError, match=rf"decode_step: positions\[{row}\] = {positions[row]} "
                         r"is outside \[0, 8\) \(the cache length\)"):
        step(first, np.array(positions, np.int32), cache, decoder=decoder)
  # A dtype the kernel does not take: named before anything runs (the reference takes it).
  with jax.enable_x64(True):
    wide = jax.tree.map(lambda a: a.astype(jnp.float64), model)
    with pytest.raises(TypeError, match="decode_step: the persistent decoder takes float32, "
                       "bfloat16 or float16 models, got float64"):
      jaxfuse.decode_step(wide, prompts[:, 0], lengths, jaxfuse.init_cache(wide, 2, 8))


def test_generate_hf_example(tmp_path, monkeypatch, capsys):
  """examples/generate_hf.py on a tiny checkpoint: token-id prompts, and text prompts through a
  word-level tokenizer.json when the optional `tokenizers` package is installed."""
  write_checkpoint(tmp_path, "Qwen3ForCausalLM", dtype="bfloat16", seed=3)
  argv = ["generate_hf.py", str(tmp_path), "--tokens", "5,17,3", "--max-new", "6", "--compare"]
  try:
    from tokenizers import Tokenizer, models, pre_tokenizers
  except ImportError:
    Tokenizer = None
  else:
    vocab = {f"w{i}": i for i in range(96)} | {"[UNK]": 96}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    argv += ["--prompt", "w1 w2 w40"]
  monkeypatch.setattr("sys.argv", argv)
  example = os.path.join(os.path.dirname(__file__), "..", "examples", "generate_hf.py")
  runpy.run_path(example, run_name="__main__")
  out = capsys.readouterr().out
  assert "persistent / reference speed" in out and "tokens identical" in out
  if Tokenizer is None:  # token ids in, token ids out
    assert "[0] [5, 17, 3] | [" in out
  else:  # both prompts decoded through tokenizer.json
    assert "[0] w5 w17 w3|" in out and "[1] w1 w2 w40|w" in out
