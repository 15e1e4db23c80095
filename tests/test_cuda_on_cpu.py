"""The CUDA handlers, compiled for the host by tools/cuda_on_cpu.sh, against the CPU handlers.

Runs only where that build is loaded (JAXFUSE_EXTENSION_DIR holding _jaxfuse_cuda_on_cpu); the
script sets JAXFUSE_REQUIRE_CUDA_ON_CPU=1 so that a missing build fails instead of skipping.
Element-wise results (Adam in every mode, the gradient-control apply) must be bitwise equal to
the CPU handlers': both run the shared math of csrc/optim/families/adam.h and
csrc/optim/norm_math.h.
Reductions (global norm, decoder) sum in another order: they are compared within fp32 rounding,
and must be bitwise the same under every thread schedule and on every emulated grid size.
"""

import functools
import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxfuse
from jaxfuse import sgd
from jaxfuse._core import ffi as _ffi
from jaxfuse._decode import generation
from jaxfuse._optim import clip
from jaxfuse._optim import families
from helpers import (EMULATED, assert_bitwise_equal, assert_timeline_in_order, assert_trees_close,
                     emulated_cuda_module, random_decoder_problem, random_tree, ulp)
from test_generate import TIE_TOL, assert_follows_reference, prompts_for, random_model

if emulated_cuda_module() is None:
  if os.environ.get("JAXFUSE_REQUIRE_CUDA_ON_CPU") == "1":
    raise RuntimeError("JAXFUSE_REQUIRE_CUDA_ON_CPU=1 but no _jaxfuse_cuda_on_cpu build was loaded")
  pytest.skip("needs the CUDA-on-CPU build (tools/cuda_on_cpu.sh)", allow_module_level=True)

# Emulated devices (SMs x co-resident blocks per SM [x KB of shared memory per SM: 228, an
# H100's, unless given [x compute capability: 90 unless given]]); device 0 is the emulator's
# default, the first four are the grids; the last an A100's shared memory and compute capability
# (no programmatic dependent launch).
DEVICES = "4x2,1x1,3x2,16x1,3x2x164x80"
os.environ["JAXFUSE_EMU_DEVICES"] = DEVICES
GRID_SPECS = DEVICES.split(",")[:4]
GRIDS = [pytest.param(str(i), id=f"grid{spec}") for i, spec in enumerate(GRID_SPECS)]
A100_SHARED = "4"  # an A100's 164 KB an SM: the tensor-core GEMV's weight ring has 2 slots
SCHEDULES = ("persistent", "stage_kernels")

SIZES = [(), (0,), (1,), (3,), (5, 7), (33,), (4097,), (2, 32768 + 3)]


def on_both(fn, *args):
  """fn(*args) jitted with the CPU handlers and with the emulated CUDA handlers."""
  with _ffi.cpu_targets("native"):
    native = jax.device_get(jax.jit(fn)(*args))
  with _ffi.cpu_targets(EMULATED):
    emulated = jax.device_get(jax.jit(fn)(*args))
  return native, emulated


def emulated(fn, *args):
  with _ffi.cpu_targets(EMULATED):
    return jax.device_get(jax.jit(fn)(*args))


def assert_same_bits_under_schedules(monkeypatch, seeds, fn, *args):
  """fn(*args) on the emulated handlers gives the same bits under each thread-schedule seed."""
  results = []
  for seed in seeds:
    monkeypatch.setenv("JAXFUSE_EMU_SEED", seed)
    results.append(emulated(fn, *args))
  for seed, r in zip(seeds[1:], results[1:]):
    assert_bitwise_equal(r, results[0], f"schedule seed {seed} vs {seeds[0]}")


# (emulated device, schedule seed) pairs: every grid size once, in-order and shuffled schedules
# alternating (seed 0 runs threads and blocks in index order).
LAUNCHES = [pytest.param((str(i), "0" if i % 2 == 0 else str(17 + i)),
                         id=f"grid{spec}-{'in_order' if i % 2 == 0 else 'shuffled'}")
            for i, spec in enumerate(GRID_SPECS)]


def on_launches(cases):
  """pytest params of each case (a tuple) on one of LAUNCHES, in turn from case to case: every
  launch shape, in-order and shuffled, runs with a share of the modes (the grid's chunking and
  the blocks' order are the driver's, the same for every mode), at a quarter of the cost of every
  case on every launch."""
  return [pytest.param(*case, LAUNCHES[k % len(LAUNCHES)].values[0],
                       id=f"{'-'.join(case)}-{LAUNCHES[k % len(LAUNCHES)].id}")
          for k, case in enumerate(cases)]


@pytest.fixture(params=LAUNCHES)
def launch(request, monkeypatch):
  device, seed = request.param
  monkeypatch.setenv("JAXFUSE_EMU_DEVICE", device)
  monkeypatch.setenv("JAXFUSE_EMU_SEED", seed)
  return request.param


@pytest.fixture(params=GRIDS)
def grid(request, monkeypatch):
  monkeypatch.setenv("JAXFUSE_EMU_DEVICE", request.param)
  return request.param


DTYPE_MIXES = {
    "f32": [jnp.float32] * len(SIZES),
    "bf16": [jnp.bfloat16] * len(SIZES),
    "mixed": [[jnp.float32, jnp.bfloat16, jnp.float16][i % 3] for i in range(len(SIZES))],
    # float64 and complex: double-precision and complex-pair kernels (under jax_enable_x64).
    "wide": [[jnp.float64, jnp.complex64, jnp.complex128][i % 3] for i in range(len(SIZES))],
}


@pytest.fixture(autouse=True)
def x64_for_wide(request):
  """The "wide" mix needs jax_enable_x64 (float64 and complex128 leaves)."""
  wide = "wide" in request.node.name
  with jax.enable_x64(wide):
    yield


def adam_case(mode, dtypes, sizes=SIZES):
  """An optimizer, params, grads and state for one mode, over leaves of `sizes`."""
  master = mode == "master"
  nesterov = mode == "nesterov"
  if master:
    dtypes = [jnp.bfloat16 if d == jnp.float32 else d for d in dtypes]
  if mode == "adam":
    tx = jaxfuse.adam(3e-3)
  else:
    tx = jaxfuse.adamw(3e-3, weight_decay=0.1, nesterov=nesterov, master_weights=master,
                       skip_nonfinite=mode == "skip")
  params = random_tree(1, sizes, dtypes)
  grads = random_tree(2, sizes, dtypes, scale=0.5)
  if mode == "skip":
    grads["leaf0006"] = grads["leaf0006"].at[7].set(jnp.nan)
  state = tx.init(params)
  # A second step's state: moments are then non-trivial.
  state = jax.jit(lambda g, s, p: tx.update(g, s, p)[1])(random_tree(3, sizes, dtypes), state, params)
  return tx, params, grads, state


ADAM_CASES = ([("plain", mix) for mix in DTYPE_MIXES] + [("plain", "c64")] +
              [(mode, "mixed") for mode in ("nesterov", "master", "skip", "loss_scale")] +
              [(mode, "wide") for mode in ("nesterov", "master", "adam")])


@pytest.mark.parametrize("mode,mix,launch", on_launches(ADAM_CASES), indirect=["launch"])
def test_adam_bitwise(mode, mix, launch):
  # complex64 alone: the fp32 signature kernel, with its (re, im) pairs
  dtypes = [jnp.complex64] * len(SIZES) if mix == "c64" else DTYPE_MIXES[mix]
  tx, params, grads, state = adam_case(mode, dtypes)
  scale = jnp.float32(128.0) if mode == "loss_scale" else None
  fn = lambda g, s, p: jaxfuse.fused_step(tx, g, s, p, grad_scale=scale)
  native, emu = on_both(fn, grads, state, params)
  assert_bitwise_equal(emu, native, "emulated CUDA vs CPU handlers")


@pytest.mark.parametrize("mix", list(DTYPE_MIXES))
def test_global_norm(mix, launch):
  tree = random_tree(4, SIZES, DTYPE_MIXES[mix])
  native, emu = on_both(jaxfuse.global_norm, tree)
  exact = np.sqrt(sum(np.sum(np.abs(np.asarray(x, np.complex128)) ** 2)
                      for x in jax.tree.leaves(tree)))
  # Accumulated in float64: a float32 norm is the exact norm rounded once; a float64 one (of
  # float64 leaves, whose squares round) carries float64 summation error.
  rtol = float(jnp.finfo(native.dtype).eps) * (1 if native.dtype == np.float32 else 64)
  np.testing.assert_allclose(emu, exact, rtol=rtol)
  np.testing.assert_allclose(native, exact, rtol=rtol)


def test_global_norm_same_bits_under_every_schedule(grid, monkeypatch):
  tree = random_tree(5, SIZES, DTYPE_MIXES["mixed"])
  assert_same_bits_under_schedules(monkeypatch, ("0", "1", "99"), jaxfuse.global_norm, tree)


@pytest.mark.parametrize("max_norm", [0.5, 1e9])
def test_fused_clip_adamw(max_norm, launch):
  """Norm, clip scale and Adam in three launches: within rounding of the clip scale."""
  dtypes = DTYPE_MIXES["mixed"]
  tx = optax.chain(jaxfuse.clip_by_global_norm(max_norm), jaxfuse.adamw(1e-2, weight_decay=0.05))
  params = random_tree(6, SIZES, dtypes)
  grads = random_tree(7, SIZES, dtypes)
  state = tx.init(params)
  fn = lambda g, s, p: jaxfuse.fused_step(tx, g, s, p, return_grad_norm=True)
  (p_n, s_n, norm_n), (p_e, s_e, norm_e) = on_both(fn, grads, state, params)
  np.testing.assert_allclose(norm_e, norm_n, rtol=2e-6)
  for a, b in zip(jax.tree.leaves((p_e, s_e)), jax.tree.leaves((p_n, s_n))):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * max(1.0, float(np.max(np.abs(b), initial=0))))




# The architecture features (Qwen2's q/k/v biases, Qwen3's per-head q/k RMSNorm, Llama 3.1's
# scaled RoPE) on in the fp32 case, off in the bf16 one: both paths of the kernel run.
FEATURES = dict(qkv_bias=True, qk_norm=True,
                rope_scaling=jaxfuse.RopeScaling("llama3", factor=8.0,
                                                 original_max_position_embeddings=16))


def decoder_case(dtype, batch=3, seq=40, quantization=None):
  features = FEATURES if dtype == jnp.float32 else {}
  cfg = jaxfuse.DecoderConfig(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2,
                              head_dim=32, intermediate_size=256, max_seq_len=seq,
                              quantization=quantization, **features)
  x, w, cache = random_decoder_problem(cfg, batch, dtype, seed=9)
  positions = jnp.asarray([5, seq - 1, 17][:batch], jnp.int32)
  return cfg, x, positions, w, cache


def check_decoder(cfg, x, positions, w, cache):
  """The emulated CUDA decoder step against the CPU handler's: out and the written cache rows
  within fp32 summation-order rounding (of x's dtype), the other cache rows untouched; the
  stage-kernel schedule's results the persistent one's bits (the same work split over the same
  grid)."""
  dtype = x.dtype
  fn = lambda x, p, w, c: jaxfuse.persistent_decoder(x, p, w, c, cfg)
  (h_n, c_n), (h_e, c_e) = on_both(fn, x, positions, w, cache)
  stages = lambda x, p, w, c: jaxfuse.persistent_decoder(x, p, w, c, cfg, schedule="stage_kernels")
  assert_bitwise_equal(emulated(stages, x, positions, w, cache), (h_e, c_e),
                       "the stage kernels' results vs the persistent kernel's")
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  np.testing.assert_allclose(np.asarray(h_e, np.float32), np.asarray(h_n, np.float32), rtol=tol, atol=tol)
  if dtype != jnp.float32:
    # The FMA path sums fp32 products of fp32 inputs, as the CPU does: a 16-bit output's bits
    # differ only where the summation order flips a rounding (~1%). The tensor-core path (bf16
    # activations; fp16 ones with 8-bit matrices) splits its inputs into bf16 hi + lo, products
    # within ~2^-18 of fp32's; over sums of terms that cancel ~16-fold that flips ~1/64 of bf16
    # outputs and ~1/8 of fp16 ones (whose ulp is 8x finer). Inputs rounded to 16 bits (the path
    # without its lo half) flip about half of bf16's, nearly all of fp16's.
    mma_f16 = dtype == jnp.float16 and cfg.quantization is not None
    same = np.mean(np.asarray(h_e).view(np.uint16) == np.asarray(h_n).view(np.uint16))
    assert same >= (0.75 if mma_f16 else 0.9), \
        f"only {same:.1%} of the outputs are the CPU handler's bits"
  written = np.zeros(cache.k.shape, bool)  # [L, B, S, KV, hd]: row positions[b] of every layer
  written[:, np.arange(x.shape[0]), np.asarray(positions)] = True
  for new_e, new_n, old in zip(c_e, c_n, cache):
    np.testing.assert_allclose(np.asarray(new_e, np.float32)[written],
                               np.asarray(new_n, np.float32)[written], rtol=tol, atol=tol)
    assert_bitwise_equal(np.asarray(new_e)[~written], np.asarray(old)[~written],
                         "cache rows the step must not write")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decoder(dtype, launch):
  check_decoder(*decoder_case(dtype))


# The GEMV engines' long paths, which the small case does not reach: K = 400 rows in chunks
# (fp16's FMA engine: each chunk's first weights loaded before its inputs are staged; bf16's
# tensor-core engine: 13 slabs of 32 rows through its weight ring, 3 in flight, or 1 with an
# A100's shared memory), batch rows in several passes (FMA: 4 rows a pass; tensor cores: 16, in
# two 8-row batch tiles), and on the 16-block grid 16 K splits summed in two rounds of loads
# (the ring's slabs then end within an item's rows, zero-filled past them). On the 1-block grid
# the tensor-core case lets each warp run ahead of the others (JAXFUSE_EMU_WARP_AHEAD): a ring
# slot refilled before every warp has read it would show.
@pytest.mark.parametrize("dtype,batch,device,warp_ahead", [
    (jnp.float16, 6, "1", "0"), (jnp.float16, 6, "3", "0"), (jnp.bfloat16, 18, "1", "1"),
    (jnp.bfloat16, 18, "3", "0"), (jnp.bfloat16, 18, A100_SHARED, "0")],
    ids=["fma-f16-batch6-grid1x1", "fma-f16-batch6-grid16x1", "mma-bf16-batch18-grid1x1-ahead",
         "mma-bf16-batch18-grid16x1", "mma-bf16-batch18-ring2"])
def test_decoder_gemv_chunks_passes_and_splits(dtype, batch, device, warp_ahead, monkeypatch):
  monkeypatch.setenv("JAXFUSE_EMU_DEVICE", device)
  monkeypatch.setenv("JAXFUSE_EMU_WARP_AHEAD", warp_ahead)
  cfg = jaxfuse.DecoderConfig(num_layers=1, hidden_size=128, num_heads=4, num_kv_heads=2,
                              head_dim=32, intermediate_size=400, max_seq_len=8)
  x, w, cache = random_decoder_problem(cfg, batch, dtype, seed=10)
  check_decoder(cfg, x, jnp.arange(batch, dtype=jnp.int32) * 5 % 8, w, cache)


# Attention's lane groups: head_dim 64 in bf16 (8 lanes a position, 4 positions a warp), 96 in
# fp16 (12 vectors: groups of 16 lanes, 4 idle) and 128 in fp32 (a whole warp a position), over
# 300 positions, so each warp's loop takes several rounds on the 1-block grid (one split) and
# several splits on the 16-block one.
@pytest.mark.parametrize("dtype,head_dim,device", [(jnp.bfloat16, 64, "1"), (jnp.float16, 96, "3"),
                                                   (jnp.float32, 128, "1")],
                         ids=["bf16-hd64-grid1x1", "f16-hd96-grid16x1", "f32-hd128-grid1x1"])
def test_decoder_attention_lane_groups(dtype, head_dim, device, monkeypatch):
  monkeypatch.setenv("JAXFUSE_EMU_DEVICE", device)
  cfg = jaxfuse.DecoderConfig(num_layers=1, hidden_size=128, num_heads=4, num_kv_heads=2,
                              head_dim=head_dim, intermediate_size=128, max_seq_len=300)
  x, w, cache = random_decoder_problem(cfg, 2, dtype, seed=11)
  check_decoder(cfg, x, jnp.asarray([299, 130], jnp.int32), w, cache)


@pytest.mark.parametrize("dtype,head_dim,message", [
    (jnp.bfloat16, 20,
     "hidden_size, intermediate_size and head_dim to be multiples of 8 for bfloat16"),
    (jnp.float32, 256, "head_dim <= 128 for float32"),
    ("int8", 24, "hidden_size, intermediate_size and head_dim to be multiples of 16 for 8-bit "
                 "weights with float16 activations")])
def test_decoder_head_dim_limits(dtype, head_dim, message):
  """A head the kernel's 16-byte k/v vectors (or its weight ring's 16-byte copies of 8-bit
  rows) cannot cover is refused, naming head_dim."""
  quantization = dtype if isinstance(dtype, str) else None
  dtype = jnp.float16 if quantization else dtype  # 8-bit weights on tensor cores under fp16
  cfg = jaxfuse.DecoderConfig(num_layers=1, hidden_size=128, num_heads=4, num_kv_heads=2,
                              head_dim=head_dim, intermediate_size=128, max_seq_len=8,
                              quantization=quantization)
  x, w, cache = random_decoder_problem(cfg, 1, dtype, seed=12)
  decode = lambda x, p, w, c: jaxfuse.persistent_decoder(x, p, w, c, cfg)
  with pytest.raises(Exception, match=f"jaxfuse_decoder: the CUDA kernel needs {message}"):
    emulated(decode, x, jnp.zeros(1, jnp.int32), w, cache)


def test_greedy_generation_follows_the_reference():
  """A bf16 model's greedy tokens from the emulated CUDA decoder (tensor-core GEMVs with the
  inputs split hi + lo, attention in lane groups of 16-byte loads, here head_dim 16: 16
  positions a warp) are the plain-JAX reference's argmax, up to near-ties, and the same tokens
  on either schedule."""
  model = random_model(jnp.bfloat16, seed=3)
  prompts, lengths = prompts_for(model, 4, 7, seed=2)
  # Three tokens: the prefill's, then two kernel steps, the second reading the first's cache rows.
  tokens = {schedule: emulated(lambda t, n: jaxfuse.generate(model, t, n, 3, schedule=schedule),
                               prompts, lengths) for schedule in SCHEDULES}
  out, count = tokens["persistent"]
  assert np.all(np.asarray(count) == 3)
  assert_follows_reference(model, prompts, lengths, out, count, TIE_TOL[jnp.bfloat16])
  assert_bitwise_equal(tokens["stage_kernels"], tokens["persistent"], "the stage kernels' tokens")


# The whole-model step: embedding gather, final norm, LM head and the draw in the launch. bf16
# with a tied head quantized to fp8 at batch 18 on the 1-block grid: the tensor-core head in two
# passes (16 staged rows in two batch tiles, then 2 in one), its 8-bit rows widened, hidden 144
# making two groups of 128 k a vocabulary tile, the second partial, and 300 rows a partial last
# tile; one block walks every row's top-k / top-p histograms. fp32 untied at batch 3 on 16
# blocks, and an int8 model with its int8 head under fp16 (the FMA head: 8-byte vectors of 8
# weights, 16 a lane in flight); a token outside the vocabulary and a bad position make two rows
# invalid. The draws: greedy (the small cases), plain sampling, and filtered by top-k and top-p
# together, top-k alone (its first pass also finds the largest score) or top-p alone (a pass for
# it), at temperatures high enough that a draw lands anywhere in the kept set (so a wrong
# threshold shows in the tokens).
@pytest.mark.parametrize("dtype,tied,batch,device,quantization,hidden,draws", [
    (jnp.bfloat16, True, 18, "1", "fp8", 144, ((4.0, 20, 0.9),)),
    (jnp.float32, False, 3, "3", None, 64,
     ((0.0, None, None), (4.0, 20, None), (3.0, None, 0.5))),
    (jnp.float16, True, 3, "3", "int8", 64,
     ((0.0, None, None), (0.8, None, None), (4.0, 7, 0.8)))],
    ids=["quantized-fp8-tied-head-bf16-batch18-grid1x1", "f32-untied-batch3-grid16x1",
         "quantized-int8-head-f16-batch3-grid16x1"])
def test_decoder_whole_model_step(dtype, tied, batch, device, quantization, hidden, draws,
                                  monkeypatch):
  """Logits within fp32 summation-order rounding of the CPU handler's and the head inputs'
  rounding (NaN in the same rows), and next tokens that are exactly jnp.argmax /
  jax.random.categorical of the emulated logits (after _sample's top-k and top-p filters;
  filtered, in the valid rows); the stage kernels' logits and tokens the persistent kernel's
  bits."""
  monkeypatch.setenv("JAXFUSE_EMU_DEVICE", device)
  model = random_model(dtype, vocab=300, tied=tied, seed=4, hidden=hidden)
  if quantization is not None:
    model = jaxfuse.quantize(model, quantization)
  cache = jaxfuse.init_cache(model, batch, 12)
  cfg = generation._cache_config(model, cache)
  rng = np.random.default_rng(5)
  tokens = jnp.asarray(rng.integers(0, 300, batch).astype(np.int32)).at[1].set(300)
  positions = jnp.asarray(np.arange(batch, dtype=np.int32) % 12).at[2].set(-1)
  key = jax.random.key(8)
  # The two platforms' layers sum in different orders, so a head input rounded to the model's
  # dtype may land one ulp apart (<= eps |x|), which moves logit n by eps |x| |w_n|: the inputs
  # (RMS-normalized, norm weights near 1) are at most 3.7 here.
  head = model.embed if model.lm_head is None else model.lm_head
  head = np.abs(np.asarray(head.astype(jnp.float32))).max(axis=1)
  if model.lm_head_scale is not None:
    head = head * np.asarray(model.lm_head_scale)
  flip = float(jnp.finfo(dtype).eps) * 4 * head
  for temperature, top_k, top_p in draws:
    step = lambda t, p, c, k: generation._model_step(model, cfg, t, p, c, temperature, k, top_k,
                                                     top_p)
    native, emu = on_both(step, tokens, positions, cache, jax.random.key_data(key))
    stages = lambda t, p, c, k: generation._model_step(model, cfg, t, p, c, temperature, k,
                                                       top_k, top_p, schedule="stage_kernels")
    assert_bitwise_equal(emulated(stages, tokens, positions, cache, jax.random.key_data(key)),
                         emu, "the stage kernels' step vs the persistent kernel's")
    logits_n, logits_e = np.asarray(native[0]), np.asarray(emu[0])
    invalid = np.isnan(logits_e).all(axis=1)
    np.testing.assert_array_equal(invalid, np.isnan(logits_n).all(axis=1))
    np.testing.assert_array_equal(np.flatnonzero(invalid), [1, 2])
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    excess = np.abs(logits_e - logits_n) - (tol + flip + tol * np.abs(logits_n))
    assert not (excess[~invalid] > 0).any(), f"logits off by up to {excess[~invalid].max()}"
    want = generation._sample(jnp.asarray(logits_e), key, temperature, top_k, top_p)
    rows = ~invalid if top_k or top_p else slice(None)  # (XLA's top-k of NaN rows differs)
    np.testing.assert_array_equal(np.asarray(emu[1])[rows], np.asarray(want)[rows])


# Weight-only quantized matrices: each kernel instance (int8, fp8 under fp32 activations, with
# FEATURES, and under bf16 and fp16 ones, without) once, batches 3 and 1 in turn, each case on
# one launch of LAUNCHES in turn (a case takes about 10 s under ASan; the launches' schedules do
# not depend on the weights' dtype).
QUANTIZED_CASES = [("int8", jnp.float32, 3), ("int8", jnp.bfloat16, 1), ("int8", jnp.float16, 3),
                   ("fp8", jnp.float32, 1), ("fp8", jnp.bfloat16, 3), ("fp8", jnp.float16, 1)]
QUANTIZED = [
    pytest.param(quantization, dtype, batch, launch.values[0],
                 id=f"{quantization}-{jnp.dtype(dtype).name}-batch{batch}-{launch.id}")
    for (quantization, dtype, batch), launch in zip(QUANTIZED_CASES, itertools.cycle(LAUNCHES))]


@pytest.mark.parametrize("quantization,dtype,batch,launch", QUANTIZED, indirect=["launch"])
def test_decoder_quantized(quantization, dtype, batch, launch):
  check_decoder(*decoder_case(dtype, batch, quantization=quantization))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_stage_timeline(schedule, monkeypatch):
  """A whole-model step (bf16: the tensor-core GEMVs, the head and the greedy draw) on 16
  blocks records every block's times in every stage in order, without changing a bit of its
  results, on either schedule; the persistent draw's grid sync ends for every block after every
  block has begun the draw."""
  from jaxfuse._decode import timeline
  monkeypatch.setenv("JAXFUSE_EMU_DEVICE", "3")
  model = random_model(jnp.bfloat16, vocab=300, seed=6)
  cache = jaxfuse.init_cache(model, 3, 12)
  tokens, positions = jnp.asarray([4, 200, 31], jnp.int32), jnp.asarray([0, 5, 11], jnp.int32)
  cfg = generation._cache_config(model, cache)
  plain = lambda t, p, c: generation._model_step(model, cfg, t, p, c, 0.0,
                                                 jnp.zeros((2,), jnp.uint32))
  with _ffi.cpu_targets(EMULATED):
    logits, _, tl = timeline.model_timeline(model, tokens, positions, cache, schedule=schedule)
  want = emulated(plain, tokens, positions, cache)[0]
  assert_bitwise_equal(np.asarray(logits), np.asarray(want), "logits")
  layers = [f"{l}.{s}" for l in range(cfg.num_layers) for s in timeline.LAYER_STAGES]
  assert_timeline_in_order(tl, ["embed", *layers, "head", "sample"], blocks=16)
  if schedule == "persistent":
    assert (tl.ready[:, -1] >= tl.begin[:, -1].max()).all()
  assert (tl.waits[:, 1:-2].sum(axis=0) > 0).all(), "a layer stage where no block waited"


def test_decoder_same_bits_under_every_schedule(grid, monkeypatch):
  cfg, x, positions, w, cache = decoder_case(jnp.float32)
  fn = lambda x, p, w, c: jaxfuse.persistent_decoder(x, p, w, c, cfg)
  assert_same_bits_under_schedules(monkeypatch, ("0", "3", "4242"), fn, x, positions, w, cache)


def test_failed_launch_does_not_poison_later_calls(monkeypatch):
  """A launch error is reported by its own call, then cleared: the next calls succeed."""
  cfg, x, positions, w, cache = decoder_case(jnp.float32, batch=1)
  decode = lambda x, p, w, c: jaxfuse.persistent_decoder(x, p, w, c, cfg)
  monkeypatch.setenv("JAXFUSE_EMU_FAIL_COOPERATIVE", "1")
  with pytest.raises(Exception, match="jaxfuse_decoder: launch of the decoder kernel failed: "
                                      "cudaErrorCooperativeLaunchTooLarge"):
    emulated(decode, x, positions, w, cache)
  stages = lambda x, p, w, c: jaxfuse.persistent_decoder(x, p, w, c, cfg, schedule="stage_kernels")
  with pytest.raises(Exception, match=r"launch of the decoder's stage kernel failed: "
                                      r"cudaErrorCooperativeLaunchTooLarge.* \(the call's stage 0\)"):
    emulated(stages, x, positions, w, cache)  # the embedding's launch, cooperative
  monkeypatch.delenv("JAXFUSE_EMU_FAIL_COOPERATIVE")
  tree = random_tree(10, [(5,), (7,)], [jnp.float32] * 2)
  emulated(jaxfuse.global_norm, tree)
  tx = jaxfuse.adam(1e-3)
  emulated(lambda g, s: jaxfuse.fused_step(tx, g, s, tree), tree, tx.init(tree))
  emulated(decode, x, positions, w, cache)


def test_old_driver_is_named(monkeypatch):
  """A driver older than the runtime: backends-style info and the first failing call say so."""
  monkeypatch.setenv("JAXFUSE_EMU_DRIVER_VERSION", "12080")
  info = emulated_cuda_module().cuda_info()
  assert info["runtime_version"] == 13000 and info["driver_version"] == 12080
  assert "install driver 580 or newer" in info["driver_problem"]
  tree = random_tree(11, [(5,)], [jnp.float32])
  with pytest.raises(Exception, match=r"CUDA 12\.8 but jaxfuse's CUDA kernels were built with CUDA 13\.0"):
    emulated(jaxfuse.global_norm, tree)
  monkeypatch.setenv("JAXFUSE_EMU_DRIVER_VERSION", "0")
  assert emulated_cuda_module().cuda_info()["driver_problem"] == "no NVIDIA driver found"
  monkeypatch.delenv("JAXFUSE_EMU_DRIVER_VERSION")
  emulated(jaxfuse.global_norm, tree)  # and nothing sticks


def _norm_in_two_calls(*trees):
  """The sharded global norm's kernels for len(trees) 'devices': each tree's own call (its
  float64 sum of squares as a row of uint32 words), then one call over no gradients that adds
  the rows (the all-reduced matrix) and finishes."""
  call = functools.partial(clip._norm_ffi, norm_dtype=jnp.float32, clip=True,
                           skip_nonfinite=True, clip_apply_loss_scale=True)
  norm_params = jnp.asarray([1.0, 0.5], jnp.float32)  # loss scale, max norm
  rows = [call(norm_params, clip._no_peers(), jax.tree.leaves(t))[2] for t in trees]
  norm, grad_ctrl, own = call(norm_params, jnp.stack(rows), [])
  return jnp.stack(rows), norm, grad_ctrl, own


def test_global_norm_from_peer_rows(launch):
  """Each 'device's row holds the bits of its float64 sum of squares; the finishing call adds the
  rows: both as the CPU handlers do, to float64 rounding (the sums run in another order)."""
  trees = [random_tree(20 + i, SIZES, DTYPE_MIXES["mixed"]) for i in range(3)]
  (rows_n, norm_n, ctrl_n, own_n), (rows_e, norm_e, ctrl_e, own_e) = on_both(
      _norm_in_two_calls, *trees)
  exact = [sum(np.sum(np.abs(np.asarray(x, np.complex128)) ** 2) for x in jax.tree.leaves(t))
           for t in trees]
  for rows in (rows_n, rows_e):
    np.testing.assert_allclose(rows.view(np.float64)[:, 0], exact, rtol=1e-14)
    np.testing.assert_array_equal(rows.view(np.float64)[:, 1], 0.0)  # all finite
  for norm, ctrl, own in ((norm_n, ctrl_n, own_n), (norm_e, ctrl_e, own_e)):
    np.testing.assert_allclose(norm, np.sqrt(sum(exact)), rtol=float(jnp.finfo(jnp.float32).eps))
    np.testing.assert_array_equal(own, np.zeros(4, np.uint32))  # no gradients of its own
  np.testing.assert_array_equal(ctrl_e, ctrl_n)


def test_global_norm_from_peer_rows_same_bits_under_every_schedule(grid, monkeypatch):
  trees = [random_tree(30 + i, SIZES, DTYPE_MIXES["mixed"]) for i in range(3)]
  assert_same_bits_under_schedules(monkeypatch, ("0", "1", "99"), _norm_in_two_calls, *trees)


# ---- launch accounting: what jaxfuse.report counts is what the CUDA handlers enqueue ----------

# Small leaves keep the emulated runs short; in the small build (tools/cuda_on_cpu.sh) they still
# fill several tables, and the 200-element leaf is cut into slices of 3 chunks of 128.
REPORT_SIZES = SIZES[:6] + [(200,)]
MANY_SIZES = REPORT_SIZES * 43  # 301 leaves: two Adam calls
ADAM_MODES = ("plain", "master", "adam")
# Every op and layout over a few leaves; over many (two Adam calls) where the split matters.
REPORT_CASES = ([f"{op}-few" for op in ("fused_clip_adamw", "clip_alone",
                                         *(f"adam_{mode}" for mode in ADAM_MODES))] +
                ["fused_clip_adamw-many", "adam_plain-many", "norm_from_peer_rows",
                 "decoder-batch3", "decoder_stages-batch3"])


def report_case(case):
  """(step, args) of a REPORT_CASES entry."""
  op, _, size = case.partition("-")
  sizes = MANY_SIZES if size == "many" else REPORT_SIZES
  dtypes = (DTYPE_MIXES["mixed"] * 43)[:len(sizes)]
  tree = lambda seed: random_tree(seed, sizes, dtypes)
  if op == "fused_clip_adamw":
    tx = optax.chain(jaxfuse.clip_by_global_norm(1.0), jaxfuse.adamw(1e-3, weight_decay=0.1))
    return (lambda g, s, p: jaxfuse.fused_step(tx, g, s, p)), (tree(1), tx.init(tree(2)), tree(2))
  if op == "clip_alone":
    return (lambda g: jaxfuse.clip_by_global_norm(1.0).update(g, optax.EmptyState())[0]), (tree(3),)
  if op.startswith("adam_"):
    tx, params, grads, state = adam_case(op[5:], dtypes, sizes)
    return (lambda g, s, p: jaxfuse.fused_step(tx, g, s, p)), (grads, state, params)
  if op == "norm_from_peer_rows":
    return _norm_in_two_calls, tuple(random_tree(40 + i, sizes, dtypes) for i in range(2))
  cfg, x, positions, w, cache = decoder_case(jnp.float32, batch=int(size[len("batch"):]))
  schedule = "stage_kernels" if op == "decoder_stages" else "persistent"
  return ((lambda x, p, w, c: jaxfuse.persistent_decoder(x, p, w, c, cfg, schedule=schedule)),
          (x, positions, w, cache))


@pytest.mark.parametrize("case", REPORT_CASES)
def test_report_counts_what_the_handlers_enqueue(case):
  """jaxfuse.report's CUDA launches and memsets (each op's cost() in C++) equal the kernels and
  memsets the emulated runtime saw the CUDA handlers enqueue, with this build's table sizes."""
  fn, args = report_case(case)
  with _ffi.cpu_targets(EMULATED):
    step = jax.jit(fn)
    r = jaxfuse.report(step, *args)
    jax.block_until_ready(step(*args))  # compiled and warm: the run below enqueues one step
    before = emulated_cuda_module().enqueued_work()
    jax.block_until_ready(step(*args))
    after = emulated_cuda_module().enqueued_work()
  assert r.jaxfuse_calls > 0 and r.exact != case.startswith("decoder")
  assert r.jaxfuse_launches == r.jaxfuse_cuda_launches  # the emulated handlers are CUDA's
  assert after["kernels"] - before["kernels"] == r.jaxfuse_cuda_launches
  assert after["memsets"] - before["memsets"] == r.jaxfuse_cuda_memsets


# Every family but Adam (whose modes have tests of their own above): each variant on mixed
# dtypes; its first variant with a master copy, with non-finite skipping (a NaN in one leaf), and
# on float64 and complex leaves (float64 alone where it takes real leaves only).
OTHER_FAMILIES = [f for f in families.registered() if f.name != "adam"]
VARIANTS = {v.label: v for f in OTHER_FAMILIES for v in f.variants}
OPTIONS = {"plain": {}, "master": dict(master_weights=True), "skip": dict(skip_nonfinite=True)}


def family_case(variant, option, dtypes):
  """A family variant's optimizer with an option, params, grads and a second step's state."""
  if option == "master":
    dtypes = [jnp.bfloat16 if d == jnp.float32 else d for d in dtypes]
  tx = VARIANTS[variant](**OPTIONS[option])
  params = random_tree(1, SIZES, dtypes)
  grads = random_tree(2, SIZES, dtypes, scale=0.5)
  if option == "skip":
    grads["leaf0006"] = grads["leaf0006"].at[7].set(jnp.nan)
  state = tx.init(params)
  state = jax.jit(lambda g, s, p: tx.update(g, s, p)[1])(random_tree(3, SIZES, dtypes), state,
                                                         params)
  return tx, params, grads, state


# The families' mixes: those above, and float32 with bfloat16 leaves (see mixed()).
FAMILY_MIXES = {**DTYPE_MIXES, "f32 bf16": [[jnp.float32, jnp.bfloat16][i % 2]
                                             for i in range(len(SIZES))]}


def mixed(family):
  """"mixed" (float32, bfloat16 and float16 leaves), or "f32 bf16" for a family that refuses a
  tree of both 16-bit dtypes without a master copy (schedule-free's state scalars take the
  params' lowest dtype); its master case has float16 leaves."""
  tree = {f"leaf{i}": jax.ShapeDtypeStruct((3,), d) for i, d in enumerate(DTYPE_MIXES["mixed"])}
  try:
    family.variants[0].spec().check_params(tree)
  except TypeError:
    return "f32 bf16"
  return "mixed"


def family_cases(trust_ratio):
  """(variant, option, dtype mix) of the families with (or without) trust ratios."""
  cases = []
  for family in OTHER_FAMILIES:
    if family.trust_ratio == trust_ratio:
      first = family.variants[0].label
      cases += [(v.label, "plain", mixed(family)) for v in family.variants]
      cases += [(first, "master", "mixed"), (first, "skip", mixed(family))]
      cases += [(first, "plain", "wide" if family.takes_complex else "f64")]
  return cases


def family_step(variant, option, mix):
  """A family case's in-place step (loss-scaled) on the CPU handlers and the emulated CUDA ones."""
  dtypes = [jnp.float64] * len(SIZES) if mix == "f64" else FAMILY_MIXES[mix]
  with jax.enable_x64(mix in ("f64", "wide")):
    tx, params, grads, state = family_case(variant, option, dtypes)
    fn = lambda g, s, p: jaxfuse.fused_step(tx, g, s, p, grad_scale=jnp.float32(128.0))
    return on_both(fn, grads, state, params)


@pytest.mark.parametrize("variant,option,mix,launch", on_launches(family_cases(False)),
                         indirect=["launch"])
def test_element_family_bitwise(variant, option, mix, launch):
  native, emu = family_step(variant, option, mix)
  assert_bitwise_equal(emu, native, "emulated CUDA vs CPU handlers")


@pytest.mark.parametrize("variant,option,mix,launch", on_launches(family_cases(True)),
                         indirect=["launch"])
def test_trust_ratio_family(variant, option, mix, launch):
  """Element-wise but for the per-leaf sums, which the GPU adds in another order (in float64):
  a ratio may then differ by an ulp of the compute type, and a 16-bit param round the other way;
  nothing more."""
  native, emu = family_step(variant, option, mix)
  # "wide": float64 leaves and complex ones in float32 (complex64) and float64 math.
  rtol = {"wide": 2 * ulp(jnp.float32), "f64": 4 * ulp(jnp.float64)}.get(mix, ulp(jnp.bfloat16))
  assert_trees_close(emu, native, rtol=rtol, atol=0, what="emulated CUDA vs CPU handlers")


def test_trust_sums_same_bits_under_every_schedule(grid, monkeypatch):
  """The per-leaf sums have one partial per chunk, added in a fixed tree: the step's bits do not
  depend on the thread schedule or the grid size."""
  trust = next(f for f in OTHER_FAMILIES if f.trust_ratio)
  tx, params, grads, state = family_case(trust.variants[0].label, "plain", DTYPE_MIXES["mixed"])
  fn = lambda g, s, p: jaxfuse.fused_step(tx, g, s, p)
  assert_same_bits_under_schedules(monkeypatch, ("0", "99"), fn, grads, state, params)


def precision_case(mode):
  """An AdamW (SGD) keeping fewer bytes per param (test_precision.py), params, grads and a
  second step's state."""
  # 8-bit moments: leaves of whole 128-element blocks too, one over several chunks.
  sizes = SIZES + [(40, 128), (2, 128 * 300)] if mode.startswith("moments8") else SIZES
  alternating = lambda a, b: [[a, b][i % 2] for i in range(len(sizes))]
  dtypes = alternating(jnp.bfloat16, jnp.float32) if mode.startswith("remainder") \
      else (DTYPE_MIXES["mixed"] * 2)[:len(sizes)]
  make = {
      "stochastic": lambda: jaxfuse.adamw(3e-3, weight_decay=0.1, stochastic_rounding=True,
                                          seed=5),
      "stochastic_sgd": lambda: sgd(3e-2, momentum=0.9, stochastic_rounding=True, seed=6,
                                    skip_nonfinite=True),
      "remainder": lambda: jaxfuse.adamw(3e-3, weight_decay=0.1, master_weights="remainder"),
      "remainder_skip": lambda: jaxfuse.adamw(3e-3, master_weights="remainder",
                                              skip_nonfinite=True, nu_dtype=jnp.bfloat16),
      "nu_bf16": lambda: jaxfuse.adamw(3e-3, nu_dtype=jnp.bfloat16, mu_dtype=jnp.float16),
      # fp32 params with bf16 moments: the signature kernel of its own (f16 leaves: the table's)
      "moments_bf16": lambda: jaxfuse.adamw(3e-3, nu_dtype=jnp.bfloat16, mu_dtype=jnp.bfloat16),
      # bf16 params' 8-bit momentum loads few bytes per group: two groups in flight per thread
      "moments8_sgd": lambda: sgd(3e-2, momentum=0.9, moment_bits=8),
      "moments8": lambda: jaxfuse.adamw(3e-3, weight_decay=0.1, moment_bits=8),
      "moments8_master": lambda: jaxfuse.adamw(3e-3, moment_bits=8, master_weights=True,
                                               skip_nonfinite=True),
      # packed states and params: every tensor's lists at offsets in a few buffers
      "packed": lambda: jaxfuse.adamw(3e-3, weight_decay=0.1, packed=True, master_weights=True),
      "moments8_packed": lambda: jaxfuse.adamw(3e-3, moment_bits=8, packed=True),
      "packed_params": lambda: jaxfuse.adamw(3e-3, weight_decay=0.1),
  }
  tx = make[mode]()
  params = random_tree(1, sizes, dtypes)
  grads = random_tree(2, sizes, dtypes, scale=0.5)
  warm = random_tree(3, sizes, dtypes)
  if mode == "packed_params":
    params, grads, warm = jaxfuse.pack(params), jaxfuse.pack(grads), jaxfuse.pack(warm)
  if mode.endswith("skip") or mode == "stochastic_sgd":
    grads["leaf0007"] = grads["leaf0007"].at[0, 7].set(jnp.inf)
  state = tx.init(params)
  state = jax.jit(lambda g, s, p: tx.update(g, s, p)[1])(warm, state, params)
  return tx, params, grads, state


@pytest.mark.parametrize("mode,launch", on_launches(
    [(m,) for m in ("stochastic", "stochastic_sgd", "remainder", "remainder_skip", "nu_bf16",
                    "moments_bf16", "moments8", "moments8_master", "moments8_sgd", "packed",
                    "moments8_packed", "packed_params")]),
    indirect=["launch"])
def test_precision_modes_bitwise(mode, launch):
  """Stochastic rounding's bits come from each element's index in its tensor (also across the
  slices a huge tensor is split into), remainders are integer words, and 8-bit moments' block
  maxima are exact (a warp's on the GPU, a tile's blocks on the CPU), and packed lists only
  move where each tensor's elements are: the same bits on both."""
  tx, params, grads, state = precision_case(mode)
  fn = lambda g, s, p: jaxfuse.fused_step(tx, g, s, p, grad_scale=jnp.float32(4.0))
  native, emu = on_both(fn, grads, state, params)
  assert_bitwise_equal(emu, native, "emulated CUDA vs CPU handlers")


MUON_SIZES = [(40, 24), (24, 40), (16, 16), (3, 5, 7), (33,), (4097,)]


@pytest.mark.parametrize("option,launch", on_launches([("plain",), ("master",)]),
                         indirect=["launch"])
def test_muon_bitwise(option, launch):
  """jaxfuse.muon's in-place step (its element pass over the matrices, AdamW's over the rest)
  on the CPU handlers and the emulated CUDA ones: the Newton-Schulz chains are the same XLA
  program on both, so every bit matches; bf16 matrices with a float32 master."""
  dtypes = [jnp.bfloat16 if option == "master" else jnp.float32] * 3 + [jnp.float32] * 3
  tx = jaxfuse.muon(1e-2, weight_decay=0.1, **OPTIONS[option])
  params = random_tree(1, MUON_SIZES, dtypes)
  state = tx.init(params)
  fn = lambda g, s, p: jaxfuse.fused_step(tx, g, s, p, grad_scale=jnp.float32(128.0))
  native, emu = on_both(fn, random_tree(2, MUON_SIZES, dtypes, scale=0.5), state, params)
  assert_bitwise_equal(emu, native, "emulated CUDA vs CPU handlers")
