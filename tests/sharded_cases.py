"""jaxfuse on sharded arrays, on 8 fake CPU devices: tests/test_sharding.py runs this in a process
of its own (the device count must be set before jax starts its backend) with its `-m` expression;
collected alone it skips. Slow cases repeat a faster one's check on other jax APIs (CI's older-jax
legs leave them out). Every case compares with optax (or the unsharded op) on the same inputs and
checks what sharding is for: outputs keep their operands' shardings, nothing is gathered, the norm
costs one small all-reduce, and each device holds and moves only its share."""

import contextlib
import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxfuse
from helpers import (assert_bitwise_equal, assert_trees_close, random_decoder_problem,
                     random_tree, ulp, zero_size_float_operands)

pytestmark = pytest.mark.skipif(jax.device_count() != 8,
                                reason="needs 8 devices (tests/test_sharding.py runs this file)")

MESHES = {  # name: (shape, axis names)
    "fsdp": ((8,), ("fsdp",)),
    "data_model": ((4, 2), ("data", "model")),
}
# Leaves: (shape, spec per mesh). Mostly sharded, some replicated (shapes the mesh does not
# divide); a scalar; an empty leaf.
LEAVES = {
    "fsdp": [((256, 64), P("fsdp")), ((64, 128), P(None, "fsdp")), ((512,), P("fsdp")),
             ((7, 3), P()), ((), P()), ((0, 8), P())],
    "data_model": [((256, 64), P("data", "model")), ((64, 128), P("model", "data")),
                   ((512,), P(("data", "model"))), ((96,), P("data")), ((7, 3), P()), ((), P())],
}
LR, WD, MAX_NORM = 1e-2, 0.05, 1.0


def make_mesh(name, kind):
  shape, axes = MESHES[name]
  axis_type = AxisType.Explicit if kind == "explicit" else AxisType.Auto
  return jax.make_mesh(shape, axes, axis_types=(axis_type,) * len(axes))


def sharded_problem(mesh_name, kind, seed, steps=1, leaves=LEAVES, grad_scale=1.0):
  """(mesh, params as `leaves` says on the host, their specs by leaf, `steps` float32 grads)."""
  shapes = [shape for shape, _ in leaves[mesh_name]]
  params = random_tree(seed, shapes)
  specs = dict(zip(params, [spec for _, spec in leaves[mesh_name]]))
  grads = [random_tree(seed + 1 + t, shapes, scale=grad_scale) for t in range(steps)]
  return make_mesh(mesh_name, kind), params, specs, grads


def put(tree, mesh, specs=None):
  """`tree` on `mesh`, each leaf split as `specs` (a dict by leaf name) says, or replicated."""
  if specs is None:
    return jax.device_put(tree, NamedSharding(mesh, P()))
  return jax.device_put(tree, {k: NamedSharding(mesh, specs[k]) for k in tree})


def full_spec(spec, ndim):
  return P(*spec, *([None] * (ndim - len(spec))))


def assert_split_as(specs, *trees):
  """Every leaf of each tree (a dict keyed like `specs`) is split as `specs` says."""
  for tree in trees:
    got = {k: full_spec(x.sharding.spec, x.ndim) for k, x in tree.items()}
    assert got == {k: full_spec(spec, jnp.ndim(tree[k])) for k, spec in specs.items()}


def collectives(compiled_text, ops=("all-gather", "all-reduce")):
  return tuple(len(re.findall(rf"\b{op}(-start)?\(", compiled_text)) for op in ops)


@pytest.fixture(params=["auto", "explicit"])
def kind(request):
  return request.param


@pytest.fixture(params=list(MESHES))
def mesh_name(request):
  return request.param


def clipped(m=jaxfuse, opt=None, **clip):
  """`m`'s (jaxfuse's or optax's) clip_by_global_norm, then `opt` (default: `m`'s AdamW)."""
  return optax.chain(m.clip_by_global_norm(MAX_NORM, **clip), opt or m.adamw(LR, weight_decay=WD))


def optax_reference(params, grads, opt=None):
  """optax's clip and `opt` (default: AdamW), a step per gradient: (params, state)."""
  tx = clipped(optax, opt)
  state = tx.init(params)
  for g in grads:
    u, state = tx.update(g, state, params)
    params = optax.apply_updates(params, u)
  return params, state


def fused(tx, donate=False, **kwargs):
  """The jitted fused step, (grads, state, params) -> (params, state[, norm])."""
  return jax.jit(lambda g, s, p: jaxfuse.fused_step(tx, g, s, p, **kwargs),
                 donate_argnums=(1, 2) if donate else ())


def run(step, tx, params, grads, mesh=None, specs=None, in_place=False):
  """`step` from tx.init(params), once per gradient, on one device (no mesh) or on `mesh` split as
  `specs` says (None: replicated), `in_place`: each deleting its params; the last step's outputs."""
  place = (lambda t: t) if mesh is None else (lambda t: put(t, mesh, specs))
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    params = place(params)
    state = tx.init(params)
    for g in grads:
      out = step(place(g), state, params)
      assert not in_place or all(x.is_deleted() for x in jax.tree.leaves(params) if x.size)
      params, state = out[:2]
  return out


def compiled_on(step, tx, params, grads, mesh, specs=None):
  """`step` compiled for (grads, tx.init(params), params) on `mesh`, split as `specs` says."""
  with jax.set_mesh(mesh):
    p = put(params, mesh, specs)
    return step.lower(put(grads, mesh, specs), tx.init(p), p).compile()


def test_fused_clip_adamw_step(mesh_name, kind):
  """The fused clip+AdamW step on sharded params: optax's values; params, mu and nu keep their
  shardings; no all-gather and one all-reduce; donated buffers are used in place; per-device
  memory about an eighth of the replicated step's."""
  mesh, params, specs, grads = sharded_problem(mesh_name, kind, 1, steps=2)
  expected, expected_state = optax_reference(params, grads)
  tx = clipped()
  step = fused(tx, donate=True, return_grad_norm=True)
  compiled = compiled_on(step, tx, params, grads[0], mesh, specs)
  assert collectives(compiled.as_text()) == (0, 1), compiled.as_text()
  replicated = compiled_on(step, tx, params, grads[0], mesh)  # before the params are donated
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # "Some donated buffers were not usable" fails the test
    p, state, norm = run(step, tx, params, grads, mesh, specs, in_place=True)
  adam, want = state[1][0], expected_state[1][0]
  assert_split_as(specs, p, adam.mu, adam.nu)
  tol = 4 * ulp(jnp.float32)
  assert_trees_close((p, adam.mu, adam.nu), (expected, want.mu, want.nu), rtol=tol, atol=0)
  np.testing.assert_allclose(float(norm), float(optax.tree.norm(grads[1])), rtol=2 * tol)
  sharded, full = (c.memory_analysis().argument_size_in_bytes for c in (compiled, replicated))
  assert sharded < full / 6, (sharded, full)


def test_optax_protocol(mesh_name, kind):
  """tx.update + optax.apply_updates: optax's values, updates sharded as the grads, no gather."""
  mesh, params, specs, (grads,) = sharded_problem(mesh_name, kind, 4)
  expected, _ = optax_reference(params, [grads])
  tx = clipped()

  @jax.jit
  def step(g, s, p):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), u

  assert collectives(compiled_on(step, tx, params, grads, mesh, specs).as_text()) == (0, 1)
  new_p, updates = run(step, tx, params, [grads], mesh, specs)
  assert_split_as(specs, updates)
  assert_trees_close(new_p, expected, rtol=4 * ulp(jnp.float32), atol=0)


def test_global_norm(mesh_name, kind):
  """The norm of the whole arrays on every device: the float64 norm rounded (within one float32
  ulp), the same bits as the unsharded jaxfuse norm's and run to run; one all-reduce."""
  mesh, tree, specs, _ = sharded_problem(mesh_name, kind, 6, steps=0)
  exact = np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in tree.values()))
  unsharded = jax.jit(jaxfuse.global_norm)(jax.device_put(tree, jax.devices()[0]))
  with jax.set_mesh(mesh):
    t = put(tree, mesh, specs)
    norm_fn = jax.jit(jaxfuse.global_norm)
    assert collectives(norm_fn.lower(t).compile().as_text()) == (0, 1)
    first, second = norm_fn(t), norm_fn(t)
  assert first.sharding.is_fully_replicated
  np.testing.assert_allclose(float(first), exact, rtol=ulp(jnp.float32))
  assert_bitwise_equal([second, unsharded], [first, first], "run to run, unsharded")


def test_zero_size_leaves_reach_no_kernel(mesh_name, kind):
  """No zero-size leaf is an operand of a kernel or of the shard_map (Explicit axes) or
  custom_partitioning op (Auto axes) around it: jaxlib 0.11.2 segfaults on one."""
  mesh, params, specs, _ = sharded_problem(mesh_name, kind, 19, steps=0)
  params.update(empty=jnp.zeros((0, 8)), empty_split=jnp.zeros((8, 0)))
  specs.update(empty=P(), empty_split=P(mesh.axis_names[0]))
  tx = clipped()
  around = "sdy.manual_computation" if kind == "explicit" else "@CustomSPMDPartitioning"
  with jax.set_mesh(mesh):
    p = put(params, mesh, specs)
    for step in (fused(tx, return_grad_norm=True), jax.jit(tx.update)):
      lowered = step.lower(p, tx.init(p), p)
      assert around in lowered.as_text()
      assert zero_size_float_operands(lowered) == []


def test_training_loop_in_scan_and_fori_loop(kind):
  """The fused step as a lax.scan / fori_loop carry (the Explicit-axes case failed with a carry
  type mismatch before); three steps equal optax's."""
  mesh, params, specs, (grads,) = sharded_problem("fsdp", kind, 7)
  expected, _ = optax_reference(params, [grads] * 3)
  tx = clipped()
  with jax.set_mesh(mesh):
    p, g = put(params, mesh, specs), put(grads, mesh, specs)
    step = lambda carry: jaxfuse.fused_step(tx, g, carry[1], carry[0])
    scanned = jax.jit(lambda c: jax.lax.scan(lambda c, _: (step(c), None), c, None, length=3)[0])
    looped = jax.jit(lambda c: jax.lax.fori_loop(0, 3, lambda i, c: step(c), c))
    for loop in (scanned, looped):
      new_p, _ = loop((p, tx.init(p)))
      assert_split_as(specs, new_p)
      assert_trees_close(new_p, expected, rtol=8 * ulp(jnp.float32), atol=0)


def test_jit_with_in_and_out_shardings():
  """No mesh context: shardings given to jit only (Auto axes)."""
  mesh, params, specs, (grads,) = sharded_problem("fsdp", "auto", 9)
  expected, _ = optax_reference(params, [grads])
  tx = clipped()
  sh = {k: NamedSharding(mesh, specs[k]) for k in params}
  state = tx.init(params)
  # Eager init on sharded params: the moments take the params' shardings (the count is a scalar).
  state_sh = jax.tree.map(lambda x: x.sharding if x.ndim else NamedSharding(mesh, P()),
                          tx.init(jax.device_put(params, sh)))
  step = jax.jit(lambda p, s, g: jaxfuse.fused_step(tx, g, s, p),
                 in_shardings=(sh, state_sh, sh), out_shardings=(sh, state_sh),
                 donate_argnums=(0, 1))
  assert collectives(step.lower(params, state, grads).compile().as_text()) == (0, 1)
  new_p, _ = step(*jax.device_put((params, state, grads), (sh, state_sh, sh)))
  assert_trees_close(new_p, expected, rtol=4 * ulp(jnp.float32), atol=0)


def test_inside_shard_map_with_axis_name():
  """In a shard_map body each call sees one device's shards: clip_by_global_norm's axis_name
  makes the norm the whole tree's (without it, it is the shard's own)."""
  mesh = make_mesh("fsdp", "explicit")
  params, grads = random_tree(11, [(64, 16), (32,)]), random_tree(12, [(64, 16), (32,)])
  expected, _ = optax_reference(params, [grads])
  specs = {k: P("fsdp") for k in params}
  with jax.set_mesh(mesh):
    p, g = put(params, mesh, specs), put(grads, mesh, specs)
    for axis_name in ("fsdp", None):
      tx = clipped(axis_name=axis_name)
      s = tx.init(p)
      state_specs = jax.tree.map(lambda x: P("fsdp") if jnp.ndim(x) else P(), s)
      step = jax.jit(jax.shard_map(
          lambda p, s, g: jaxfuse.fused_step(tx, g, s, p, return_grad_norm=True),
          in_specs=(P("fsdp"), state_specs, P("fsdp")), out_specs=(P("fsdp"), state_specs, P())))
      new_p, _, norm = step(p, s, g)
      if axis_name:
        assert_trees_close(new_p, expected, rtol=4 * ulp(jnp.float32), atol=0)
        np.testing.assert_allclose(float(norm), float(optax.tree.norm(grads)), rtol=1e-6)
      else:  # each device clipped by its own shard's norm: device 0's is not the global one
        assert float(norm) < float(optax.tree.norm(grads))


def test_vmap_over_an_ensemble_on_many_devices():
  """vmap over the optimizer when several devices exist (the custom-partitioned op runs once
  per ensemble member)."""
  params = jax.tree.map(lambda x: jnp.stack([x, 2 * x]), random_tree(13, [(3, 4), (5,)]))
  grads = jax.tree.map(lambda x: 0.5 * x + 1.0, params)
  tx, to = jaxfuse.adamw(LR), optax.adamw(LR)
  uf, _ = jax.jit(jax.vmap(tx.update))(grads, jax.vmap(tx.init)(params), params)
  uo, _ = jax.vmap(to.update)(grads, jax.vmap(to.init)(params), params)
  assert_trees_close(uf, uo, rtol=4 * ulp(jnp.float32), atol=0)


DECODER = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
               intermediate_size=96, max_seq_len=24)
BATCH, WHOLE, CACHE_ROWS = P("fsdp"), P(), P(None, "fsdp")


def _batch_sharded(mesh, step, args, specs):
  """`step` on `args` split as `specs` (the cache last, donated): one device's bits, no
  collective; (the split args, the lowered step, its outputs)."""
  want = jax.jit(step)(*jax.device_put(args, jax.devices()[0]))
  with jax.set_mesh(mesh):
    args = [jax.device_put(a, NamedSharding(mesh, spec)) for a, spec in zip(args, specs)]
    lowered = jax.jit(step, donate_argnums=(3,)).lower(*args)
    compiled = lowered.compile()
    assert collectives(compiled.as_text()) == (0, 0)
    got = compiled(*args)
  assert_bitwise_equal(got, want, "batch-sharded")
  return args, lowered, got


def test_batch_sharded_decoder(kind):
  """The decoder and the whole-model step (decode_step), also int8, with batch rows and the cache
  split over devices, weights (and scales) replicated: the unsharded bits, the cache keeps its
  sharding, nothing is gathered; heads split over devices is refused, saying what is supported."""
  mesh = make_mesh("fsdp", kind)
  for quantization in (None, "int8"):
    cfg = jaxfuse.DecoderConfig(**DECODER, quantization=quantization)
    x, w, cache = random_decoder_problem(cfg, 16, jnp.float32, 14)
    positions = jnp.arange(16, dtype=jnp.int32) % cfg.max_seq_len
    decoder = lambda x, p, w, c: jaxfuse.persistent_decoder(x, p, w, c, cfg)
    (xs, ps, ws, _), lowered, (_, new_cache) = _batch_sharded(
        mesh, decoder, (x, positions, w, cache), (BATCH, BATCH, WHOLE, CACHE_ROWS))
    # The kernel takes empty stand-ins of the unused weights; what runs it on shards takes none.
    assert all(o.startswith("jaxfuse_decoder:") for o in zero_size_float_operands(lowered))
    assert full_spec(new_cache.k.sharding.spec, 5) == P(None, "fsdp", None, None, None)
    # Explicit axes: a ValueError at trace time; Auto axes: the same message from the
    # partitioner at compile time.
    head_dims = jax.device_put(cache, NamedSharding(mesh, P(None, None, None, None, "fsdp")))
    with jax.set_mesh(mesh), pytest.raises((ValueError, jax.errors.JaxRuntimeError),
                                           match="cache.k is sharded over mesh axes .* along "
                                           "dimension 4.*splits only x along dimension"):
      jax.jit(lambda c: jaxfuse.persistent_decoder(xs, ps, ws, c, cfg))(head_dims)
    # The whole-model step, a tied head (int8: jaxfuse.quantize, the head's own rows and scales).
    plain = jaxfuse.DecoderConfig(**DECODER)
    _, w, cache = random_decoder_problem(plain, 16, jnp.float32, 15)
    rng = np.random.default_rng(16)
    model = jaxfuse.DecoderModel(plain, w, jnp.asarray(rng.standard_normal((40, 64)), jnp.float32),
                                 jnp.ones((64,), jnp.float32))
    model = jaxfuse.quantize(model, quantization) if quantization else model
    tokens = jnp.asarray(rng.integers(0, 40, 16), jnp.int32)
    _, _, (logits, _) = _batch_sharded(mesh, jaxfuse.decode_step, (model, tokens, positions, cache),
                                       (WHOLE, BATCH, BATCH, CACHE_ROWS))
    assert full_spec(logits.sharding.spec, 2) == P("fsdp", None)


def test_grads_split_otherwise_than_params(kind):
  """Gradients split along another dimension than the params: the params and moments keep their
  sharding (the gradients are resharded to it), values are optax's."""
  mesh = make_mesh("fsdp", kind)
  params, grads = random_tree(17, [(64, 32), (16, 40)]), random_tree(18, [(64, 32), (16, 40)])
  expected, _ = optax_reference(params, [grads])
  tx = clipped()
  p_specs = {"leaf0000": P("fsdp"), "leaf0001": P(None, "fsdp")}
  g_specs = {"leaf0000": P(None, "fsdp"), "leaf0001": P("fsdp")}
  with jax.set_mesh(mesh):
    p = put(params, mesh, p_specs)
    new_p, new_s = fused(tx, donate=True)(put(grads, mesh, g_specs), tx.init(p), p)
  assert_split_as(p_specs, new_p, new_s[1][0].mu)
  assert_trees_close(new_p, expected, rtol=4 * ulp(jnp.float32), atol=0)


@pytest.mark.parametrize("family", ["lamb", "lars"])
def test_trust_ratio_families(mesh_name, kind, family):
  """LAMB and LARS on sharded params: each leaf's norms are its whole array's (the devices that
  split a leaf add their sums; a replicated leaf counts once), so optax's values; shardings kept;
  no all-gather, and one all-reduce per call besides the clip's."""
  mesh, params, specs, grads = sharded_problem(mesh_name, kind, 19, steps=2)
  make = lambda m: (m.lamb(LR, weight_decay=WD) if family == "lamb"
                    else m.lars(0.5, weight_decay=WD, momentum=0.8))
  expected, _ = optax_reference(params, grads, opt=make(optax))
  tx = clipped(opt=make(jaxfuse))
  step = fused(tx, donate=True)
  text = compiled_on(step, tx, params, grads[0], mesh, specs).as_text()
  assert collectives(text) == (0, 2), text
  p, _ = run(step, tx, params, grads, mesh, specs)
  assert_split_as(specs, p)
  assert_trees_close(p, expected, rtol=8 * ulp(jnp.float32), atol=0, what="params")


@pytest.mark.parametrize("family,seed,kernel,ulps", [("adamw", 15, "jaxfuse_adam", 4),
                                                     ("lamb", 22, "jaxfuse_lamb_trust_sums", 8)])
def test_uneven_shards_inside_jit(family, seed, kernel, ulps):
  """On Auto axes the compiler may split a dimension the mesh does not divide (here by a
  sharding constraint inside jit), padding the last shards: the norm and LAMB's per-leaf sums
  must not count the padding, and the step must still be optax's."""
  mesh = make_mesh("fsdp", "auto")
  params, grads = random_tree(seed, [(100, 3), (13,)]), random_tree(seed + 1, [(100, 3), (13,)])
  make = lambda m: getattr(m, family)(LR, weight_decay=WD)
  expected, _ = optax_reference(params, [grads], opt=make(optax))
  tx = clipped(opt=make(jaxfuse))
  split = lambda t: jax.tree.map(
      lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("fsdp"))), t)

  @functools.partial(jax.jit, in_shardings=NamedSharding(mesh, P()))  # inputs whole
  def step(p, s, g):
    p, g = split(p), split(jax.tree.map(lambda x: x * 1.0, g))
    return jaxfuse.fused_step(tx, g, s, p, return_grad_norm=True)

  with jax.set_mesh(mesh):
    text = step.lower(params, tx.init(params), grads).compile().as_text()
    # The kernels run on 13-row shards (8 x 13 = 104 rows, 4 of padding) with one all-reduce
    # (and one of LAMB's sums); the outputs are gathered after them only because a jit output
    # cannot be split unevenly.
    calls = [line for line in text.splitlines() if f'custom_call_target="{kernel}"' in line]
    assert len(calls) == 1 and "f32[13,3]" in calls[0] and "f32[100,3]" not in calls[0]
    assert collectives(text)[1] == (2 if family == "lamb" else 1)
    new_p, _, norm = step(params, tx.init(params), grads)
  exact = np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in grads.values()))
  np.testing.assert_allclose(float(norm), exact, rtol=ulp(jnp.float32))
  assert_trees_close(new_p, expected, rtol=ulps * ulp(jnp.float32), atol=0)


def _bf16_steps(tx, mesh_name, kind=None):
  """Three fused steps of `tx` on bf16 params split as LEAVES says on a `kind` mesh (None: whole,
  on one device): (params, state) on the host."""
  mesh, params, specs, grads = sharded_problem(mesh_name, kind or "auto", 24, steps=3)
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  p, s = run(fused(tx), tx, params, grads, mesh if kind else None, specs)
  if kind:
    assert_split_as(specs, p)
  return jax.device_get((p, s))


def test_remainders_on_sharded_params(mesh_name, kind):
  """Element-wise, so the sharded masters are the unsharded ones bit for bit."""
  tx = jaxfuse.adamw(LR, weight_decay=WD, master_weights="remainder")
  sharded, whole = (jaxfuse.master_params(*_bf16_steps(tx, mesh_name, k)) for k in (kind, None))
  assert_bitwise_equal(sharded, whole, "masters")


def test_stochastic_rounding_on_sharded_params(mesh_name, kind):
  """Each shard draws from its own stream (its place among the leaf's shards), replicas of a
  shard alike: a replicated leaf, and the first shard of a leaf split along its first dimension,
  store the unsharded step's bits; the other shards other bits, the same in every run."""
  tx = jaxfuse.adamw(LR, weight_decay=WD, stochastic_rounding=True, seed=3)
  p, again, whole = (_bf16_steps(tx, mesh_name, k)[0] for k in (kind, kind, None))
  assert_bitwise_equal(p, again, "run to run")
  bits, sizes = lambda x: np.asarray(x).view(np.uint16), make_mesh(mesh_name, kind).shape
  for (shape, spec), k in zip(LEAVES[mesh_name], p):
    if spec == P():
      np.testing.assert_array_equal(bits(p[k]), bits(whole[k]))
    elif (len(spec) == 1 or spec[1] is None) and isinstance(spec[0], str):
      rows = shape[0] // sizes[spec[0]]
      np.testing.assert_array_equal(bits(p[k])[:rows], bits(whole[k])[:rows])
      assert np.any(bits(p[k])[rows:] != bits(whole[k])[rows:])  # other streams


@pytest.mark.parametrize("kind", ["explicit", pytest.param("auto", marks=pytest.mark.slow)])
def test_moments8_on_sharded_params(kind):
  """8-bit moments on params split along dimensions their blocks do not run along: each device
  quantizes its own whole blocks, the unsharded step's bits; a leaf split along a dimension its
  blocks run along is refused."""
  mesh = make_mesh("fsdp", kind)
  tx = jaxfuse.adamw(LR, weight_decay=WD, moment_bits=8)
  shapes = [(64, 256), (32, 128), (512,), (8, 64, 64), (64, 100)]
  params, grads = random_tree(40, shapes), random_tree(41, shapes)
  step = fused(tx)
  whole = jax.device_get(step(grads, tx.init(params), params))
  sharded = lambda specs: jax.device_get(run(step, tx, params, [grads], mesh,
                                             dict(zip(params, specs))))
  out = sharded([P("fsdp"), P(), P("fsdp"), P("fsdp"), P()])
  assert isinstance(out[1][0].mu["leaf0000"], jaxfuse.QuantizedMoment)
  assert_bitwise_equal(out, whole, "sharded vs unsharded 8-bit step")
  for specs in ([P(), P(None, "fsdp"), P(), P(), P()], [P(), P(), P(), P(), P("fsdp")]):
    with pytest.raises(Exception, match="which its 8-bit blocks of 128 elements run along"):
      sharded(specs)


def test_packed_state_on_replicated_params(kind):
  """Data parallelism: params replicated on the mesh, the packed state too; the fused step runs
  whole on every device, no collective, the unsharded step's bits. Params split over devices
  are refused, naming the leaf (their states stay per leaf)."""
  mesh = make_mesh("fsdp", kind)
  params, grads = random_tree(40, [(64, 32), (40,), ()]), random_tree(41, [(64, 32), (40,), ()])
  tx = jaxfuse.adamw(LR, weight_decay=WD, packed=True)
  step = fused(tx)
  expected = step(grads, tx.init(params), params)
  assert collectives(compiled_on(step, tx, params, grads, mesh).as_text()) == (0, 0)
  assert_bitwise_equal(run(step, tx, params, [grads], mesh), expected, "replicated packed step")
  split = put(params, mesh, {"leaf0000": P("fsdp"), "leaf0001": P(), "leaf0002": P()})
  with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"leaf \['leaf0000'\] is split over "
                                                           r"mesh axes \('fsdp',\)"):
    tx.init(split)


# ---- a packed state split over the data-parallel devices (packed="fsdp": ZeRO's first stage) ---

# A leaf large enough to be gathered alone (257 x 257: padded in its last chunk), small ones
# gathered packed, odd sizes, a scalar, an empty leaf.
SPLIT_SHAPES = [(257, 257), (5, 7), (), (33,), (16, 24), (40,), (0, 3)]
SPLIT_VARIANTS = [v for family in jaxfuse._optim.families.registered() for v in family.variants]


def _split_problem(seed, dtypes=(jnp.float32,) * 4 + (jnp.bfloat16,) * 3):
  return (random_tree(seed, SPLIT_SHAPES, dtypes),
          [random_tree(seed + 1 + t, SPLIT_SHAPES, dtypes) for t in range(2)])


def _split_like_unsplit(make, params, grads, mesh, what, donate=False):
  """Two fused steps of make(packed="fsdp") on `mesh` give make()'s params and (converted) state
  bit for bit, and each device holds an eighth of every packed buffer: returns the split tx."""
  ref_params, ref_state = run(fused(make()), make(), params, grads)
  tx = make(packed="fsdp")
  new_params, state = run(fused(tx, donate=donate), tx, params, grads, mesh, in_place=donate)
  with jax.set_mesh(mesh):
    converted = jaxfuse.convert_state(state, new_params, make())[1]
  assert_bitwise_equal((new_params, converted), (ref_params, ref_state), what)
  for b in [x for x in jax.tree.leaves(state) if x.ndim == 1 and x.size > 64]:
    assert b.sharding.spec == P("fsdp") and b.addressable_shards[0].data.size * 8 == b.size
  return tx


@pytest.mark.parametrize("variant", SPLIT_VARIANTS, ids=[v.label for v in SPLIT_VARIANTS])
def test_split_packed_state_every_family(variant):
  """Every variant of every family on a split state (see _split_like_unsplit); the collectives are
  one all-gather per params dtype of the new params' segments (small leaves gathered packed; never
  the state) and, for the trust-ratio families, one all-reduce of the per-leaf sums."""
  mesh = make_mesh("fsdp", "auto")
  params, grads = _split_problem(50)
  tx = _split_like_unsplit(variant, params, grads, mesh, variant.label)
  text = compiled_on(fused(tx), tx, params, grads[0], mesh).as_text()
  trust = "trust_sums_op" in variant.spec().contract.names
  assert collectives(text) == (3, 1 if trust else 0)  # the large leaf; f32 and bf16 small ones
  # The gathers' sizes are the params' (XLA:CPU gathers bf16 as f32), not the state's.
  small = {k: x for k, x in params.items() if x.size < 65536}
  spec = variant.spec(packed="fsdp")
  layout = jaxfuse._core.packing.layout_of(small, 8, ("fsdp",), spec.split_chunks(small, 8))
  gathered = re.findall(r"= \w+\[(\d+)\]\S* all-gather\(", text)
  assert sorted(map(int, gathered)) == sorted([*layout.buffer_sizes, 8 * 8257]), gathered


def test_split_schedule_free_eval_params():
  """jaxfuse.schedule_free_eval_params of a split state (z split over the devices, gathered):
  the unsplit state's params to evaluate at, x = (y - 0.1 z) / 0.9, within the rounding of its
  three operations (XLA compiles the two programs' arithmetic apart) and of x's dtype."""
  mesh = make_mesh("fsdp", "auto")
  params, grads = _split_problem(55)
  make = lambda **o: jaxfuse.schedule_free_adamw(LR, weight_decay=WD, **o)
  ref_params, ref_state = run(fused(make()), make(), params, grads)
  tx = make(packed="fsdp")
  new_params, state = run(fused(tx), tx, params, grads, mesh)
  with jax.set_mesh(mesh):
    x = jax.jit(jaxfuse.schedule_free_eval_params)(state, new_params)
  ref = jaxfuse.schedule_free_eval_params(ref_state, ref_params)
  for k in ref:
    wide = lambda t: np.asarray(t[k], np.float64)
    magnitude = (np.abs(wide(ref_params)) + 0.1 * np.abs(wide(ref_state.z))) / 0.9
    bound = 4 * ulp(jnp.float32) * magnitude + ulp(ref[k].dtype) * np.abs(wide(ref))
    assert np.all(np.abs(wide(x) - wide(ref)) <= bound), k


@pytest.mark.slow
def test_split_packed_state_optax_protocol():
  """tx.update on a split state: every device's updates of its chunks, gathered (the large leaf
  alone, the small ones per updates dtype), the unsplit protocol's within ulps (XLA may contract
  a multiply and an add in one program and not the other); the new state converts to it too."""
  mesh = make_mesh("fsdp", "explicit")
  params, grads = _split_problem(60)
  for make in (jaxfuse.adamw, jaxfuse.lamb):
    ref, tx = make(LR, weight_decay=WD), make(LR, weight_decay=WD, packed="fsdp")
    ref_updates, ref_state = jax.jit(ref.update)(grads[0], ref.init(params), params)
    update = jax.jit(tx.update)
    assert collectives(compiled_on(update, tx, params, grads[0], mesh).as_text())[0] == 3
    updates, new_state = run(update, tx, params, grads[:1], mesh)  # one step: the updates
    with jax.set_mesh(mesh):
      converted = jaxfuse.convert_state(new_state, params, ref)[1]
    assert_split_as({k: P() for k in params}, updates)
    assert_trees_close((updates, converted), (ref_updates, ref_state),
                       rtol=8 * ulp(jnp.float32), atol=0)


SPLIT_OPTIONS = {
    "master weights": dict(master_weights=True),
    "remainders": dict(master_weights="remainder"),
    "8-bit moments": dict(moment_bits=8),
    "skip non-finite": dict(skip_nonfinite=True),
}


@pytest.mark.parametrize("kind", ["auto", pytest.param("explicit", marks=pytest.mark.slow)])
@pytest.mark.parametrize("option", SPLIT_OPTIONS)
def test_split_packed_state_options(option, kind):
  """AdamW with the clip folded in and each opt-in on a split state (bf16 params, a non-finite
  second step): the master copy, remainders, 8-bit codes and scales split alike, bit for bit."""
  mesh = make_mesh("fsdp", kind)
  params, grads = _split_problem(70, [jnp.bfloat16] * 7)
  grads[1]["leaf0001"] = grads[1]["leaf0001"].at[2, 3].set(jnp.inf)
  make = lambda **o: clipped(opt=jaxfuse.adamw(LR, weight_decay=WD, **SPLIT_OPTIONS[option], **o))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # 8-bit: the small leaves' float states
    _split_like_unsplit(make, params, grads, mesh, option, donate=True)


@pytest.mark.slow
def test_split_packed_state_where_steps_run():
  """The split step over two mesh axes, inside the caller's shard_map, under
  optax.inject_hyperparams and jaxfuse.multi_steps, with packed params, and with stochastic
  rounding (one stream per chunk: deterministic, not the unsplit step's bits)."""
  params, grads = _split_problem(80, [jnp.float32] * 7)
  fsdp, data_model = make_mesh("fsdp", "auto"), make_mesh("data_model", "auto")

  def in_shard_map(tx):
    with jax.set_mesh(fsdp):
      specs = jax.tree.map(lambda x: x.sharding.spec, tx.init(put(params, fsdp)))
    return jax.jit(jax.shard_map(lambda g, s, p: jaxfuse.fused_step(tx, g, s, p),
                                 in_specs=(P(), specs, P()), out_specs=(P(), specs),
                                 check_vma=False))

  inject = optax.inject_hyperparams(jaxfuse.adamw, static_args=("packed",))
  multi = lambda **o: jaxfuse.multi_steps(jaxfuse.adamw(**o), 2)
  packed_grads = lambda tx: jax.jit(lambda g, s, p: jaxfuse.fused_step(tx, jaxfuse.pack(g), s, p))
  cases = {  # what: (the transform, given `packed`; its mesh; the split step; its `packed`)
      "('data', 'model')": (jaxfuse.lamb, data_model, fused, ("data", "model")),
      "model": (jaxfuse.lamb, data_model, fused, "model"),
      "shard_map": (jaxfuse.adamw, fsdp, in_shard_map, "fsdp"),
      "inject_hyperparams": (inject, fsdp, fused, "fsdp"),
      "multi_steps": (multi, fsdp, fused, "fsdp"),
      "packed params": (jaxfuse.adamw, fsdp, packed_grads, "fsdp"),
  }
  for what, (make, mesh, step, axes) in cases.items():
    ref, tx = (make(learning_rate=LR, weight_decay=WD, **o) for o in ({}, dict(packed=axes)))
    packed = what == "packed params"
    got = run(step(tx), tx, jaxfuse.pack(params) if packed else params, grads, mesh)[0]
    assert_bitwise_equal(got.unpack() if packed else got, run(fused(ref), ref, params, grads)[0],
                         what)
  bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  rounded = jaxfuse.adamw(LR, weight_decay=WD, stochastic_rounding=True, packed="fsdp")
  first, second = (run(fused(rounded), rounded, bf16, grads, fsdp)[0] for _ in range(2))
  assert_bitwise_equal(first, second, "stochastic rounding")
  unsplit = jaxfuse.adamw(LR, weight_decay=WD, stochastic_rounding=True)
  assert_trees_close(first, run(fused(unsplit), unsplit, bf16, grads)[0],
                     rtol=2 * ulp(jnp.bfloat16), atol=0)


def test_split_packed_state_errors():
  """Clear errors: no mesh with the axis, params split over devices, a state split otherwise than
  the transform says, a `packed` that is no axis name."""
  params = random_tree(90, [(16, 8), (8,)])
  with pytest.raises(ValueError, match=r"packed='fsdp' splits the state over mesh axes "
                                       r"\('fsdp',\), and no mesh has them"):
    jaxfuse.adamw(LR, packed="fsdp").init(params)
  with pytest.raises(TypeError, match=r"packed=3; expected a bool, or the name of a mesh axis"):
    jaxfuse.adamw(LR, packed=3)
  mesh = make_mesh("data_model", "auto")
  with jax.set_mesh(mesh):
    p = put(params, mesh)
    split = dict(p, leaf0000=jax.device_put(params["leaf0000"], NamedSharding(mesh, P("model"))))
    with pytest.raises(ValueError, match=r"leaf \['leaf0000'\] is split over mesh axes "
                                         r"\('model',\)"):
      jaxfuse.adamw(LR, packed="data").init(split)
    state = jaxfuse.adamw(LR, packed="data").init(p)
    with pytest.raises(ValueError, match=r"opt_state was packed for other params: it is split "
                                         r"over \('data',\) in 4 segments"):
      fused(jaxfuse.adamw(LR, packed="model"))(p, state, p)


# Muon's matrices FSDP-sharded every way a mesh splits them (rows, columns, both axes), a tall
# one that stacks with two wide ones as its transpose, and AdamW leaves.
MUON_LEAVES = {
    "fsdp": [((64, 128), P("fsdp")), ((64, 128), P(None, "fsdp")), ((128, 64), P("fsdp")),
             ((32, 32), P("fsdp")), ((32, 32), P()), ((128,), P("fsdp")), ((), P())],
    "data_model": [((64, 128), P("data", "model")), ((64, 128), P("model", "data")),
                   ((128, 64), P("data")), ((32, 32), P(None, "model")), ((32, 32), P()),
                   ((128,), P(("data", "model"))), ((), P())],
}


def _muon_collectives(tx, params, grads, mesh, specs, fused_step=True):
  """(all-gathers, all-reduces, all-to-alls) in the compiled step (or tx.update)."""
  step = fused(tx, donate=True) if fused_step else jax.jit(tx.update, donate_argnums=(1, 2))
  return collectives(compiled_on(step, tx, params, grads, mesh, specs).as_text(),
                     ("all-gather", "all-reduce", "all-to-all"))


@pytest.mark.parametrize("mesh_name,kind", [
    pytest.param("fsdp", "auto", marks=pytest.mark.slow),
    pytest.param("fsdp", "explicit", marks=pytest.mark.slow), ("data_model", "explicit")])
def test_muon_owner_compute(mesh_name, kind):
  """jaxfuse.muon with a folded clip on sharded matrices, each device orthogonalizing whole
  matrices of its own: the unsharded step to the matmuls' rounding, shardings kept, as many
  collectives for 5 as for 7 Newton-Schulz iterations (none inside them); on FSDP no all-gather,
  one all-reduce for the clip's norm and one for the replicated matrix, all-to-alls for the rest
  (XLA gathers a matrix split over two axes whole, once a step). optax's Muon (Auto only: on
  Explicit meshes XLA refuses its x @ x.T of split matrices) all-gathers in every iteration
  (benchmarks/bench_muon.py --fsdp counts both)."""
  mesh, params, specs, (grads,) = sharded_problem(mesh_name, kind, 1, leaves=MUON_LEAVES,
                                                  grad_scale=0.5)
  make = lambda steps: clipped(opt=jaxfuse.muon(LR, ns_steps=steps, weight_decay=WD))
  counts = [_muon_collectives(make(n), params, grads, mesh, specs)
            for n in ((5, 7) if mesh_name == "fsdp" else (5,))]
  if mesh_name == "fsdp":
    assert counts[0] == counts[1] and counts[0][:2] == (0, 2), counts
  if mesh_name == "fsdp" and kind == "auto":
    ref = optax.contrib.muon(LR)
    optax_counts = _muon_collectives(ref, params, grads, mesh, specs, fused_step=False)
    assert optax_counts[0] >= 5 * 3, optax_counts  # all-gathers: some per iteration and stack
  tx = make(5)
  step = fused(tx, donate=True)
  expected, _ = step(grads, tx.init(params), jax.tree.map(jnp.copy, params))  # one device
  new, _ = run(step, tx, params, [grads], mesh, specs)
  assert_trees_close(new, expected, rtol=64 * ulp(jnp.float32), atol=0, what="owner compute")
  assert_split_as(specs, new)
