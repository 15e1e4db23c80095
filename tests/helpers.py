"""Helpers shared by the test modules (imported as `from helpers import ...`; pytest puts tests/
on sys.path through tests/conftest.py, and running a single test file does the same). Fixtures
and hooks live in conftest.py."""

import dataclasses
import functools
import os
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np

import jaxfuse
from jaxfuse._core import ffi as _ffi


EMULATED = "cuda_on_cpu"  # the CPU handler set of the CUDA handlers compiled for the host


@functools.cache
def emulated_cuda_module():
  """The CUDA handlers compiled for the host (tools/cuda_on_cpu.sh's build, a test tool that the
  package does not know), registered as the CPU handler set "cuda_on_cpu" where
  JAXFUSE_EXTENSION_DIR holds that build; None where it does not. JAXFUSE_CPU_TARGETS=cuda_on_cpu
  (tools/cuda_on_cpu.sh's suite stage) traces every test with them."""
  module = (_ffi.load_native_module("_jaxfuse_cuda_on_cpu")
            if os.environ.get("JAXFUSE_EXTENSION_DIR") else None)
  if module is not None:
    _ffi.add_cpu_handlers(EMULATED, module, cuda_kernels=True)
  wanted = os.environ.get("JAXFUSE_CPU_TARGETS", "native")
  if wanted not in ("native", EMULATED):
    raise ValueError(f"JAXFUSE_CPU_TARGETS={wanted!r}: expected native or {EMULATED}")
  if wanted == EMULATED:
    if module is None:
      raise RuntimeError("JAXFUSE_CPU_TARGETS=cuda_on_cpu needs JAXFUSE_EXTENSION_DIR to hold a "
                         "_jaxfuse_cuda_on_cpu build (tools/cuda_on_cpu.sh makes one)")
    _ffi.use_cpu_handlers(EMULATED)
  return module


# The attributes of an optimizer or trust-sums call with no packed list (tensor_lists.h).
UNPACKED = dict(packed_lists=np.int64(0), packed_offsets=np.zeros(0, np.int64),
                tensor_sizes=np.zeros(0, np.int64))


def stable_seed(*parts):
  """A random seed derived from `parts` (strings, numbers) that is the same in every run.

  Python's hash() of a str changes from one interpreter to the next (PYTHONHASHSEED), so a seed
  taken from it would make a failure impossible to reproduce."""
  return zlib.crc32("/".join(str(p) for p in parts).encode())


def random_tree(seed, shapes, dtype=jnp.float32, scale=1.0, device=None):
  """A dict pytree of fresh random normal leaves (never zeros) with the given shapes (complex
  dtypes: random real and imaginary parts)."""
  rng = np.random.default_rng(seed)
  dtypes = dtype if isinstance(dtype, (list, tuple)) else [dtype] * len(shapes)

  def leaf(shape, dt):
    x = scale * rng.standard_normal(shape)
    if jnp.issubdtype(dt, jnp.complexfloating):
      x = x + 1j * scale * rng.standard_normal(shape)
    return jnp.asarray(x, dtype=dt)

  tree = {f"leaf{i:04d}": leaf(shape, dt) for i, (shape, dt) in enumerate(zip(shapes, dtypes))}
  return jax.device_put(tree, device) if device is not None else tree


def normal_grads(seed, params, scale=1.0):
  """Random normal gradients shaped, typed and placed like `params` (lockstep.training_tree
  draws them at training's magnitudes)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda p: jax.device_put(jnp.asarray(scale * rng.standard_normal(p.shape), p.dtype),
                               p.devices().pop()), params)


def random_decoder_problem(cfg, batch, dtype, seed, device=None):
  """(x, weights, cache) for jaxfuse.persistent_decoder: random weights scaled so activations
  stay O(1) (norm weights near 1, matrices by 1/sqrt(fan-in)), a random (filled) cache. With
  ``cfg.quantization`` the matrices are drawn in ``dtype`` then quantized
  (jaxfuse.quantize_weights)."""
  rng = np.random.default_rng(seed)
  quantization = cfg.quantization
  cfg = dataclasses.replace(cfg, quantization=None)
  ws = {}
  for name, shape in cfg.weight_shapes().items():  # the fields cfg uses; the others stay None
    if "norm" in name:
      a = 1.0 + 0.1 * rng.standard_normal(shape)
    elif "bias" in name:
      a = 0.5 * rng.standard_normal(shape)
    else:
      a = rng.standard_normal(shape) / np.sqrt(shape[1])
    ws[name] = jnp.asarray(a, dtype)
  cache = jaxfuse.KVCache(*[jnp.asarray(rng.standard_normal(cfg.cache_shape(batch)), dtype)
                            for _ in range(2)])
  x = jnp.asarray(rng.standard_normal((batch, cfg.hidden_size)), dtype)
  w = jaxfuse.DecoderWeights(**ws)
  if quantization is not None:
    w, _ = jaxfuse.quantize_weights(w, cfg, quantization)
  problem = (x, w, cache)
  return jax.device_put(problem, device) if device is not None else problem


def init_beside(tx, params):
  """``tx.init(params)`` with the whole state on the params' device: optax makes its step count
  on jax's default device, which on a GPU machine is not where CPU params are."""
  device = next(iter(jax.tree.leaves(params)[0].devices()))
  return jax.device_put(tx.init(params), device)


def ulp(dtype):
  """Relative spacing of floats of `dtype` (2^-23 for fp32, 2^-7 for bf16, 2^-10 for fp16)."""
  return float(jnp.finfo(dtype).eps)


# The persistent decoder against decoder_reference on the same weights, as max |diff| over max
# |reference|: they sum in different orders (fp32: under 1e-4 over these tests' short K and few
# layers) and a 16-bit output or cached k/v can round to the neighbouring value, which the layers
# after it pass on (bf16: 2.5 ulps, fp16: 5 ulps of the largest value).
DECODER_TOL = {jnp.float32: 1e-4, jnp.bfloat16: 2.5 * ulp(jnp.bfloat16),
               jnp.float16: 5 * ulp(jnp.float16)}


fused_decoder = jax.jit(jaxfuse.persistent_decoder, static_argnums=(4,))
reference_decoder = jax.jit(jaxfuse.decoder_reference, static_argnums=(4,))


def f32(a):
  """`a` as a float32 NumPy array (through jax, which converts every dtype it holds)."""
  return np.asarray(jnp.asarray(a, jnp.float32))


def rel_err(got, want):
  """max |got - want| / max |want|, in float64 (exact for every dtype the decoder takes)."""
  got, want = _exact(got), _exact(want)
  return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def assert_decoder_matches_reference(x, positions, w, cache, cfg, dtype):
  """One persistent_decoder step against decoder_reference's on the same operands: the output
  of x's shape in `dtype`, finite and within DECODER_TOL; the k/v rows the step writes (each row
  at its position, in every layer) within DECODER_TOL too; every other cache entry bitwise
  unchanged. Returns the step's (out, cache)."""
  out, new = fused_decoder(x, positions, w, cache, cfg)
  ref, ref_cache = reference_decoder(x, positions, w, cache, cfg)
  assert out.dtype == dtype and out.shape == x.shape
  assert np.isfinite(f32(out)).all()
  assert rel_err(out, ref) < DECODER_TOL[dtype]
  written = np.zeros(cache.k.shape[:3], bool)
  written[:, np.arange(x.shape[0]), np.asarray(positions)] = True
  for name in ("k", "v"):
    got, want, old = (np.asarray(getattr(c, name)) for c in (new, ref_cache, cache))
    assert rel_err(got[written], want[written]) < DECODER_TOL[dtype], name
    assert_bitwise_equal(got[~written], old[~written], f"cache.{name} outside the written rows")
  return out, new


def small_decoder_problem(device, quantization=None, dtype=jnp.float32):
  """(cfg, x, positions, w, cache) of a 2-row step with every optional weight of `quantization`
  (biases, q/k norms, and the scales when quantized): the argument-checking tests' operands."""
  cfg = jaxfuse.DecoderConfig(2, 64, 4, 2, 32, 96, 16, qkv_bias=True, qk_norm=True,
                              quantization=quantization)
  x, w, cache = random_decoder_problem(cfg, 2, dtype, 1, device)
  return cfg, x, jnp.array([1, 2], jnp.int32), w, cache


@jax.jit
def reference_logits(model, tokens):
  """fp32 logits [B, T, V] of decoder_reference (fp32 activations) over ``tokens`` [B, T] from
  position 0, causal: the logits at t depend on tokens[:, :t + 1] only (one compilation per
  model config, dtype and tiedness: the config is static in the DecoderModel pytree)."""
  B, T = tokens.shape
  cfg = dataclasses.replace(model.config, max_seq_len=T)
  cache = jaxfuse.KVCache(*(jnp.zeros(cfg.cache_shape(B), model.dtype),) * 2)
  positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  h, _ = jaxfuse.decoder_reference(model.embed_tokens(tokens), positions, model.layers, cache, cfg)
  return model.logits(h)


# Matrices larger than one CPU GEMV work item: K = 600 and 1104 rows (2 and 3 splits of 512, the
# last one partial), N = 600 and 1104 (neither a multiple of the 64-column strips; 5 column
# ranges at 17 rows), enough work for the thread pool; sizes multiples of 8, as the CUDA kernel
# needs. (DecoderConfig's fields in order: layers, hidden, heads, kv heads, head_dim,
# intermediate, max_seq_len.)
SPLIT_CONFIG = jaxfuse.DecoderConfig(1, 600, 4, 2, 32, 1104, 8)


def assert_trees_close(actual, expected, rtol, atol, what=""):
  """Leaf-wise |actual - expected| <= atol + rtol * max|expected leaf|.

  The bound is relative to the leaf's largest magnitude, not element-wise: an element that is the
  small difference of large terms (mu = (1-b1) g + b1 mu) carries the rounding error of those
  terms, not of itself. NaNs must match."""
  paths = jax.tree_util.tree_flatten_with_path(expected)[0]
  assert len(paths) == len(jax.tree.leaves(actual)), what
  for (path, e), a in zip(paths, jax.tree.leaves(actual)):
    a64, e64 = _exact(a), _exact(e)
    assert a64.shape == e64.shape, (what, jax.tree_util.keystr(path))
    finite = np.isfinite(e64)
    scale = float(np.max(np.abs(e64[finite]))) if finite.any() else 0.0
    np.testing.assert_allclose(a64, e64, rtol=0, atol=atol + rtol * scale, equal_nan=True,
                               err_msg=f"{what} {jax.tree_util.keystr(path)}")


def _exact(x):
  """A leaf as float64 or complex128 NumPy values (exact for every dtype jaxfuse takes)."""
  x = np.asarray(x)
  return x.astype(np.complex128 if np.iscomplexobj(x) else np.float64)


def count_custom_calls(hlo_text, target):
  """Custom calls to handler `target` in compiled HLO text or lowered StableHLO text."""
  target = _ffi.target(target)  # the CUDA-on-CPU check runs the suite under other target names
  return (hlo_text.count(f'custom_call_target="{target}"')
          + hlo_text.count(f"custom_call @{target}("))


def zero_size_float_operands(lowered):
  """The zero-size floating-point operands of the custom calls (kernels, custom_partitioning) and
  shard_maps in a lowered function's StableHLO, as "op: type" strings. Integer operands are left
  out: the global norm's peer-sum rows (uint32) are empty by design on one device."""
  found = []

  def walk(op):
    name = op.operation.name
    if name in ("stablehlo.custom_call", "sdy.manual_computation"):
      if name == "stablehlo.custom_call":
        name = str(op.attributes["call_target_name"]).strip('"')
      for value in op.operands:
        m = re.fullmatch(r"tensor<((?:\d+x)*)(.+)>", str(value.type))
        if m and "0" in m[1].split("x") and not re.fullmatch(r"u?i\d+", m[2]):
          found.append(f"{name}: {value.type}")
    for region in op.regions:
      for block in region:
        for inner in block:
          walk(inner)

  for op in lowered.compiler_ir("stablehlo").body.operations:
    walk(op)
  return found


class Snapshot:
  """A tree's structure and every leaf's dtype, shape and raw bytes, copied to the host (so that
  it survives the donation of the tree's buffers)."""

  def __init__(self, tree):
    self.treedef = jax.tree.structure(tree)
    self.paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    self.leaves = []
    for x in jax.tree.leaves(tree):
      a = np.asarray(x)
      self.leaves.append((a.dtype, a.shape,
                          np.ascontiguousarray(a).reshape(-1).view(np.uint8).copy()))

  def differences(self, other):
    """Where `other` differs from this snapshot (empty when bitwise equal)."""
    if self.treedef != other.treedef:
      return [f"tree structure {other.treedef} != {self.treedef}"]
    out = []
    for path, (ed, es, eb), (ad, as_, ab) in zip(self.paths, self.leaves, other.leaves):
      if (ed, es) != (ad, as_):
        out.append(f"{path}: {ad}{list(as_)} != {ed}{list(es)}")
      elif not np.array_equal(eb, ab):
        out.append(f"{path}: {int(np.count_nonzero(eb != ab))} of {eb.size} bytes differ")
    return out


def assert_bitwise_equal(actual, expected, what):
  """`actual` and `expected` (trees or Snapshots) are equal bit for bit, leaf by leaf."""
  snap = lambda t: t if isinstance(t, Snapshot) else Snapshot(t)
  diffs = snap(expected).differences(snap(actual))
  assert not diffs, f"{what}: " + "; ".join(diffs)


def assert_timeline_in_order(timeline, names, blocks=None):
  """A decoder StageTimeline holds ``names`` for every block (``blocks`` of them, when given),
  each block's stages one after another, each wait within its stage and the shares adding up to
  the step."""
  assert timeline.names == tuple(names)
  if blocks is not None:
    assert timeline.blocks == blocks
  begin, ready, end = timeline.begin, timeline.ready, timeline.end
  assert begin.min() == 0 and (begin <= end).all()
  assert (end[:, :-1] <= begin[:, 1:]).all(), "a block's stages overlap"
  waited = ready >= 0
  assert ((begin <= ready) & (ready <= end))[waited].all()
  assert (waited == (timeline.waits > 0)).all()
  assert (timeline.waited <= end - begin).all()
  shares = sum(row["share"] for row in timeline.stage_rows())
  np.testing.assert_allclose(shares, timeline.step_ns / 1e3)
