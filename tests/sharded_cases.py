"""jaxfuse on sharded arrays, on 8 fake CPU devices. Run by tests/test_sharding.py in a process of
its own (the device count must be set before jax starts its backend), with its `-m` expression;
collected alone it skips. Cases marked slow repeat what a faster one checks on other jax APIs
(the other mesh kind, optax's own collectives, more wrappers): CI's legs on older jax versions
leave them out.

Every case compares with optax (or the unsharded jaxfuse op) on the same inputs, and checks what
sharding is for: outputs keep their operands' shardings, nothing is gathered, the norm costs one
small all-reduce, and each device holds and moves only its share.
"""

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


def tree_and_specs(name, seed):
  leaves = LEAVES[name]
  tree = random_tree(seed, [s for s, _ in leaves])
  specs = dict(zip(tree, [spec for _, spec in leaves]))
  return tree, specs


def grads_for(seed, params):
  """Random normal float32 gradients with the params' shapes (and keys: both are random_tree's)."""
  return random_tree(seed, [jnp.shape(x) for x in params.values()])


def put(tree, mesh, specs):
  return jax.device_put(tree, {k: NamedSharding(mesh, specs[k]) for k in tree})


def specs_of(tree):
  """Every leaf's PartitionSpec, one entry per dimension (trailing Nones written out)."""
  return jax.tree.map(lambda x: full_spec(x.sharding.spec, x.ndim), tree)


def full_spec(spec, ndim):
  return P(*spec, *([None] * (ndim - len(spec))))


def collectives(compiled_text):
  gathers = len(re.findall(r"\ball-gather(-start)?\(", compiled_text))
  reduces = len(re.findall(r"\ball-reduce(-start)?\(", compiled_text))
  return gathers, reduces


def padded_specs(specs, tree):
  return {k: full_spec(spec, jnp.ndim(tree[k])) for k, spec in specs.items()}


@pytest.fixture(params=["auto", "explicit"])
def kind(request):
  return request.param


@pytest.fixture(params=list(MESHES))
def mesh_name(request):
  return request.param


def optax_reference(params, grads, steps=1, opt=None):
  """optax's clip and `opt` (default: AdamW), `steps` steps: (params, state)."""
  tx = optax.chain(optax.clip_by_global_norm(MAX_NORM), opt or optax.adamw(LR, weight_decay=WD))
  state = tx.init(params)
  for g in grads[:steps]:
    u, state = tx.update(g, state, params)
    params = optax.apply_updates(params, u)
  return params, state


def test_fused_clip_adamw_step(mesh_name, kind):
  """The fused clip+AdamW step on sharded params: optax's values; params, mu and nu keep their
  shardings; no all-gather and one all-reduce; donated buffers are used in place; per-device
  memory about an eighth of the replicated step's."""
  mesh = make_mesh(mesh_name, kind)
  params, specs = tree_and_specs(mesh_name, 1)
  grads = [grads_for(s, params) for s in (2, 3)]
  expected, expected_state = optax_reference(params, grads, steps=2)
  tx = optax.chain(jaxfuse.clip_by_global_norm(MAX_NORM), jaxfuse.adamw(LR, weight_decay=WD))
  with jax.set_mesh(mesh):
    p = put(params, mesh, specs)
    state = tx.init(p)
    step = jax.jit(lambda p, s, g: jaxfuse.fused_step(tx, g, s, p, return_grad_norm=True),
                   donate_argnums=(0, 1))
    g0 = put(grads[0], mesh, specs)
    compiled = step.lower(p, state, g0).compile()
    gathers, reduces = collectives(compiled.as_text())
    assert (gathers, reduces) == (0, 1), compiled.as_text()
    with warnings.catch_warnings():
      warnings.simplefilter("error")  # "Some donated buffers were not usable" fails the test
      for g in grads:
        p_in = p
        p, state, norm = step(p, state, put(g, mesh, specs))
        assert all(x.is_deleted() for x in jax.tree.leaves(p_in) if x.size)
  want = padded_specs(specs, params)
  assert specs_of(p) == want
  assert specs_of(state[1][0].mu) == want and specs_of(state[1][0].nu) == want
  tol = 4 * ulp(jnp.float32)
  assert_trees_close(p, expected, rtol=tol, atol=0, what="params")
  assert_trees_close(state[1][0].mu, expected_state[1][0].mu, rtol=tol, atol=0, what="mu")
  assert_trees_close(state[1][0].nu, expected_state[1][0].nu, rtol=tol, atol=0, what="nu")
  np.testing.assert_allclose(float(norm), float(optax.tree.norm(grads[1])), rtol=2 * tol)

  replicated = compile_replicated(step, params, tx, grads[0])
  sharded_bytes = compiled.memory_analysis().argument_size_in_bytes
  full_bytes = replicated.memory_analysis().argument_size_in_bytes
  assert sharded_bytes < full_bytes / 6, (sharded_bytes, full_bytes)


def compile_replicated(step, params, tx, grads):
  mesh = make_mesh("fsdp", "auto")
  with jax.set_mesh(mesh):
    rep = lambda t: jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype, sharding=NamedSharding(mesh, P())), t)
    return step.lower(rep(params), rep(tx.init(params)), rep(grads)).compile()


def test_optax_protocol(mesh_name, kind):
  """tx.update + optax.apply_updates: optax's values, updates sharded as the grads, no gather."""
  mesh = make_mesh(mesh_name, kind)
  params, specs = tree_and_specs(mesh_name, 4)
  grads = grads_for(5, params)
  expected, _ = optax_reference(params, [grads])
  tx = optax.chain(jaxfuse.clip_by_global_norm(MAX_NORM), jaxfuse.adamw(LR, weight_decay=WD))
  with jax.set_mesh(mesh):
    p, g = put(params, mesh, specs), put(grads, mesh, specs)

    @jax.jit
    def step(p, s, g):
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), u

    compiled = step.lower(p, tx.init(p), g).compile()
    assert collectives(compiled.as_text()) == (0, 1)
    new_p, updates = step(p, tx.init(p), g)
  assert specs_of(updates) == padded_specs(specs, params)
  assert_trees_close(new_p, expected, rtol=4 * ulp(jnp.float32), atol=0)


def test_global_norm(mesh_name, kind):
  """The norm of the whole arrays on every device: the float64 norm rounded (within one float32
  ulp), the same bits as the unsharded jaxfuse norm's and run to run; one all-reduce."""
  mesh = make_mesh(mesh_name, kind)
  tree, specs = tree_and_specs(mesh_name, 6)
  exact = np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in tree.values()))
  unsharded = jax.jit(jaxfuse.global_norm)(jax.device_put(tree, jax.devices()[0]))
  with jax.set_mesh(mesh):
    t = put(tree, mesh, specs)
    norm_fn = jax.jit(jaxfuse.global_norm)
    assert collectives(norm_fn.lower(t).compile().as_text()) == (0, 1)
    first, second = norm_fn(t), norm_fn(t)
  assert first.sharding.is_fully_replicated
  np.testing.assert_allclose(float(first), exact, rtol=ulp(jnp.float32))
  assert np.asarray(first).tobytes() == np.asarray(second).tobytes()
  assert np.asarray(first).tobytes() == np.asarray(unsharded).tobytes()


def test_zero_size_leaves_reach_no_kernel(mesh_name, kind):
  """No zero-size leaf is an operand of a kernel or of the shard_map (Explicit axes) or
  custom_partitioning op (Auto axes) around it: jaxlib 0.11.2's compiler segfaults on a zero-size
  shard_map operand. (test_fused_clip_adamw_step checks the values.)"""
  mesh = make_mesh(mesh_name, kind)
  params, specs = tree_and_specs(mesh_name, 19)
  params.update(empty=jnp.zeros((0, 8)), empty_split=jnp.zeros((8, 0)))
  specs.update(empty=P(), empty_split=P(mesh.axis_names[0]))
  tx = optax.chain(jaxfuse.clip_by_global_norm(MAX_NORM), jaxfuse.adamw(LR, weight_decay=WD))
  around = "sdy.manual_computation" if kind == "explicit" else "@CustomSPMDPartitioning"
  with jax.set_mesh(mesh):
    p = put(params, mesh, specs)
    for step in (lambda p, s, g: jaxfuse.fused_step(tx, g, s, p, return_grad_norm=True),
                 lambda p, s, g: tx.update(g, s, p)):
      lowered = jax.jit(step).lower(p, tx.init(p), p)
      assert around in lowered.as_text()
      assert zero_size_float_operands(lowered) == []


def test_training_loop_in_scan_and_fori_loop(kind):
  """The fused step as a lax.scan / fori_loop carry (the Explicit-axes case failed with a carry
  type mismatch before); three steps equal optax's."""
  mesh = make_mesh("fsdp", kind)
  params, specs = tree_and_specs("fsdp", 7)
  grads = grads_for(8, params)
  expected, _ = optax_reference(params, [grads] * 3, steps=3)
  tx = optax.chain(jaxfuse.clip_by_global_norm(MAX_NORM), jaxfuse.adamw(LR, weight_decay=WD))
  with jax.set_mesh(mesh):
    p, g = put(params, mesh, specs), put(grads, mesh, specs)
    s = tx.init(p)
    step = lambda carry: jaxfuse.fused_step(tx, g, carry[1], carry[0])
    scanned = jax.jit(lambda c: jax.lax.scan(lambda c, _: (step(c), None), c, None, length=3)[0])
    looped = jax.jit(lambda c: jax.lax.fori_loop(0, 3, lambda i, c: step(c), c))
    for run in (scanned, looped):
      new_p, new_s = run((p, s))
      assert specs_of(new_p) == padded_specs(specs, params)
      assert_trees_close(new_p, expected, rtol=8 * ulp(jnp.float32), atol=0)


def test_jit_with_in_and_out_shardings():
  """No mesh context: shardings given to jit only (Auto axes)."""
  mesh = make_mesh("fsdp", "auto")
  params, specs = tree_and_specs("fsdp", 9)
  grads = grads_for(10, params)
  expected, _ = optax_reference(params, [grads])
  tx = optax.chain(jaxfuse.clip_by_global_norm(MAX_NORM), jaxfuse.adamw(LR, weight_decay=WD))
  sh = {k: NamedSharding(mesh, specs[k]) for k in params}
  state = tx.init(params)
  # Eager init on sharded params: the moments take the params' shardings (the count is a scalar).
  state_sh = jax.tree.map(lambda x: x.sharding if x.ndim else NamedSharding(mesh, P()),
                          tx.init(jax.device_put(params, sh)))
  step = jax.jit(lambda p, s, g: jaxfuse.fused_step(tx, g, s, p),
                 in_shardings=(sh, state_sh, sh), out_shardings=(sh, state_sh),
                 donate_argnums=(0, 1))
  compiled = step.lower(params, state, grads).compile()
  assert collectives(compiled.as_text()) == (0, 1)
  new_p, _ = step(jax.device_put(params, sh), jax.device_put(state, state_sh),
                  jax.device_put(grads, sh))
  assert_trees_close(new_p, expected, rtol=4 * ulp(jnp.float32), atol=0)


def test_inside_shard_map_with_axis_name():
  """In a shard_map body each call sees one device's shards: clip_by_global_norm's axis_name
  makes the norm the whole tree's (without it, it is the shard's own)."""
  mesh = make_mesh("fsdp", "explicit")
  params = random_tree(11, [(64, 16), (32,)])
  grads = random_tree(12, [(64, 16), (32,)])
  expected, _ = optax_reference(params, [grads])
  specs = {k: P("fsdp") for k in params}
  with jax.set_mesh(mesh):
    p, g = put(params, mesh, specs), put(grads, mesh, specs)
    for axis_name, want in (("fsdp", expected), (None, None)):
      tx = optax.chain(jaxfuse.clip_by_global_norm(MAX_NORM, axis_name=axis_name),
                       jaxfuse.adamw(LR, weight_decay=WD))
      s = tx.init(p)
      body = lambda p, s, g: jaxfuse.fused_step(tx, g, s, p, return_grad_norm=True)
      state_specs = jax.tree.map(lambda x: P("fsdp") if jnp.ndim(x) else P(), s)
      run = jax.jit(jax.shard_map(body, in_specs=(P("fsdp"), state_specs, P("fsdp")),
                                  out_specs=(P("fsdp"), state_specs, P())))
      new_p, _, norm = run(p, s, g)
      if want is not None:
        assert_trees_close(new_p, want, rtol=4 * ulp(jnp.float32), atol=0)
        np.testing.assert_allclose(float(norm), float(optax.tree.norm(grads)), rtol=1e-6)
      else:  # each device clipped by its own shard's norm: device 0's is not the global one
        assert float(norm) < float(optax.tree.norm(grads))


def test_vmap_over_an_ensemble_on_many_devices():
  """vmap over the optimizer when several devices exist (the custom-partitioned op runs once
  per ensemble member)."""
  params = random_tree(13, [(3, 4), (5,)])
  params = jax.tree.map(lambda x: jnp.stack([x, 2 * x]), params)
  grads = jax.tree.map(lambda x: 0.5 * x + 1.0, params)
  tx, to = jaxfuse.adamw(LR), optax.adamw(LR)
  uf, _ = jax.jit(jax.vmap(tx.update))(grads, jax.vmap(tx.init)(params), params)
  uo, _ = jax.vmap(to.update)(grads, jax.vmap(to.init)(params), params)
  assert_trees_close(uf, uo, rtol=4 * ulp(jnp.float32), atol=0)


def test_batch_sharded_decoder(kind):
  """The decoder with batch rows and the cache split over devices, weights replicated: the
  unsharded result, the cache keeps its sharding, nothing is gathered; heads split over
  devices is refused with an error that says what is supported. Also with int8 matrices (their
  scales replicated like every weight), and the whole-model step (jaxfuse.decode_step: tokens,
  embedding and head in the kernel; with int8, the head's own int8 rows and scales too)."""
  for quantization in (None, "int8"):
    _check_batch_sharded_decoder(kind, quantization)
    _check_batch_sharded_model_step(kind, quantization)


# The decoder of both batch-sharded cases.
DECODER = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
               intermediate_size=96, max_seq_len=24)


def _check_batch_sharded_model_step(kind, quantization):
  """A tied head; quantized (jaxfuse.quantize), its own int8 rows and their scales."""
  cfg = jaxfuse.DecoderConfig(**DECODER)
  _, w, cache = random_decoder_problem(cfg, 16, jnp.float32, 15)
  rng = np.random.default_rng(16)
  model = jaxfuse.DecoderModel(cfg, w, jnp.asarray(rng.standard_normal((40, 64)), jnp.float32),
                               jnp.ones((64,), jnp.float32))
  if quantization is not None:
    model = jaxfuse.quantize(model, quantization)
  tokens = jnp.asarray(rng.integers(0, 40, 16), jnp.int32)
  positions = jnp.arange(16, dtype=jnp.int32) % cfg.max_seq_len
  want, want_cache = jax.jit(jaxfuse.decode_step)(
      *jax.device_put((model, tokens, positions, cache), jax.devices()[0]))
  step = jax.jit(jaxfuse.decode_step, donate_argnums=(3,))
  mesh = make_mesh("fsdp", kind)
  with jax.set_mesh(mesh):
    rows = lambda spec: NamedSharding(mesh, spec)
    args = (jax.device_put(model, rows(P())), jax.device_put(tokens, rows(P("fsdp"))),
            jax.device_put(positions, rows(P("fsdp"))),
            jax.device_put(cache, rows(P(None, "fsdp"))))
    assert collectives(step.lower(*args).compile().as_text()) == (0, 0)
    logits, new_cache = step(*args)
    assert full_spec(logits.sharding.spec, 2) == P("fsdp", None)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(new_cache.v), np.asarray(want_cache.v))


def _check_batch_sharded_decoder(kind, quantization):
  cfg = jaxfuse.DecoderConfig(**DECODER, quantization=quantization)
  x, w, cache = random_decoder_problem(cfg, 16, jnp.float32, 14)
  positions = jnp.arange(16, dtype=jnp.int32) % cfg.max_seq_len
  want_h, want_cache = jax.jit(jaxfuse.persistent_decoder, static_argnums=4)(
      *jax.device_put((x, positions, w, cache), jax.devices()[0]), cfg)
  mesh = make_mesh("fsdp", kind)
  with jax.set_mesh(mesh):
    rows = lambda spec: NamedSharding(mesh, spec)
    xs = jax.device_put(x, rows(P("fsdp")))
    ps = jax.device_put(positions, rows(P("fsdp")))
    ws = jax.device_put(w, rows(P()))
    cs = jax.device_put(cache, rows(P(None, "fsdp")))
    step = jax.jit(lambda x, p, w, c: jaxfuse.persistent_decoder(x, p, w, c, cfg),
                   donate_argnums=(3,))
    # The kernel takes empty stand-ins of the unused weights; what runs it on shards takes none.
    assert all(o.startswith("jaxfuse_decoder:")
               for o in zero_size_float_operands(step.lower(xs, ps, ws, cs)))
    assert collectives(step.lower(xs, ps, ws, cs).compile().as_text()) == (0, 0)
    h, new_cache = step(xs, ps, ws, cs)
    assert full_spec(new_cache.k.sharding.spec, 5) == P(None, "fsdp", None, None, None)
    np.testing.assert_array_equal(np.asarray(h), np.asarray(want_h))
    np.testing.assert_array_equal(np.asarray(new_cache.k), np.asarray(want_cache.k))
    # Explicit axes: a ValueError at trace time; Auto axes: the same message from the
    # partitioner at compile time.
    head_dims = jax.device_put(cache, rows(P(None, None, None, None, "fsdp")))
    with pytest.raises((ValueError, jax.errors.JaxRuntimeError),
                       match="cache.k is sharded over mesh axes .* along dimension 4.*splits "
                       "only x along dimension"):
      jax.jit(lambda c: jaxfuse.persistent_decoder(xs, ps, ws, c, cfg))(head_dims)


def test_grads_split_otherwise_than_params(kind):
  """Gradients split along another dimension than the params: the params and moments keep their
  sharding (the gradients are resharded to it), values are optax's."""
  mesh = make_mesh("fsdp", kind)
  params = random_tree(17, [(64, 32), (16, 40)])
  grads = random_tree(18, [(64, 32), (16, 40)])
  expected, _ = optax_reference(params, [grads])
  tx = optax.chain(jaxfuse.clip_by_global_norm(MAX_NORM), jaxfuse.adamw(LR, weight_decay=WD))
  p_specs = {"leaf0000": P("fsdp"), "leaf0001": P(None, "fsdp")}
  g_specs = {"leaf0000": P(None, "fsdp"), "leaf0001": P("fsdp")}
  with jax.set_mesh(mesh):
    p, g = put(params, mesh, p_specs), put(grads, mesh, g_specs)
    step = jax.jit(lambda p, s, g: jaxfuse.fused_step(tx, g, s, p), donate_argnums=(0, 1))
    new_p, new_s = step(p, tx.init(p), g)
  assert specs_of(new_p) == padded_specs(p_specs, params)
  assert specs_of(new_s[1][0].mu) == padded_specs(p_specs, params)
  assert_trees_close(new_p, expected, rtol=4 * ulp(jnp.float32), atol=0)


@pytest.mark.parametrize("family", ["lamb", "lars"])
def test_trust_ratio_families(mesh_name, kind, family):
  """LAMB and LARS in place on sharded params: each leaf's norms are its whole array's (the
  devices that split a leaf add their sums; a replicated leaf counts once), so the values are
  optax's; params and state keep their shardings; no all-gather, and one all-reduce per call
  besides the clip's."""
  mesh = make_mesh(mesh_name, kind)
  params, specs = tree_and_specs(mesh_name, 19)
  grads = [grads_for(s, params) for s in (20, 21)]
  make = lambda m: (m.lamb(LR, weight_decay=WD) if family == "lamb"
                    else m.lars(0.5, weight_decay=WD, momentum=0.8))
  expected, _ = optax_reference(params, grads, steps=2, opt=make(optax))
  tx = optax.chain(jaxfuse.clip_by_global_norm(MAX_NORM), make(jaxfuse))
  with jax.set_mesh(mesh):
    p = put(params, mesh, specs)
    s = tx.init(p)
    step = jax.jit(lambda p, s, g: jaxfuse.fused_step(tx, g, s, p), donate_argnums=(0, 1))
    compiled = step.lower(p, s, put(grads[0], mesh, specs)).compile()
    assert collectives(compiled.as_text()) == (0, 2), compiled.as_text()
    for g in grads:
      p, s = step(p, s, put(g, mesh, specs))
  assert specs_of(p) == padded_specs(specs, params)
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
  tx = optax.chain(jaxfuse.clip_by_global_norm(MAX_NORM), make(jaxfuse))
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


def _bf16_step_on(mesh, mesh_name, tx, steps=3):
  """`steps` fused steps of `tx` on bf16 params sharded as LEAVES says (or whole, mesh None):
  (params, state) on the host."""
  params, specs = tree_and_specs(mesh_name, 24)
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  grads = [grads_for(s, params) for s in range(25, 25 + steps)]
  step = jax.jit(lambda p, s, g: jaxfuse.fused_step(tx, g, s, p))
  if mesh is None:
    p, s = params, tx.init(params)
    for g in grads:
      p, s = step(p, s, g)
    return jax.device_get((p, s))
  with jax.set_mesh(mesh):
    p = put(params, mesh, specs)
    s = tx.init(p)
    for g in grads:
      p, s = step(p, s, put(g, mesh, specs))
    assert specs_of(p) == padded_specs(specs, params)
    return jax.device_get((p, s))


def test_remainders_on_sharded_params(mesh_name, kind):
  """Element-wise, so the sharded masters are the unsharded ones bit for bit."""
  mesh = make_mesh(mesh_name, kind)
  tx = jaxfuse.adamw(LR, weight_decay=WD, master_weights="remainder")
  p, s = _bf16_step_on(mesh, mesh_name, tx)
  p1, s1 = _bf16_step_on(None, mesh_name, tx)
  for a, b in zip(jax.tree.leaves(jaxfuse.master_params(p, s)),
                  jax.tree.leaves(jaxfuse.master_params(p1, s1))):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))


def test_stochastic_rounding_on_sharded_params(mesh_name, kind):
  """Each shard draws from its own stream (its place among the leaf's shards), replicas of a
  shard alike: a replicated leaf, and the first shard of a leaf split along its first dimension,
  store the unsharded step's bits; the other shards other bits, the same in every run."""
  mesh = make_mesh(mesh_name, kind)
  tx = jaxfuse.adamw(LR, weight_decay=WD, stochastic_rounding=True, seed=3)
  p, _ = _bf16_step_on(mesh, mesh_name, tx)
  again, _ = _bf16_step_on(mesh, mesh_name, tx)
  whole, _ = _bf16_step_on(None, mesh_name, tx)
  bits = lambda x: np.asarray(x).view(np.uint16)
  for (shape, spec), k in zip(LEAVES[mesh_name], p):
    np.testing.assert_array_equal(bits(p[k]), bits(again[k]))
    if spec == P():
      np.testing.assert_array_equal(bits(p[k]), bits(whole[k]))
    elif len(spec) == 1 or spec[1] is None:
      rows = shape[0] // mesh.shape[spec[0]] if isinstance(spec[0], str) else None
      if rows:
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
  step = jax.jit(lambda p, s, g: jaxfuse.fused_step(tx, g, s, p))
  whole = jax.device_get(step(params, tx.init(params), grads))

  def sharded(specs):
    specs = dict(zip(params, specs))
    with jax.set_mesh(mesh):
      p = put(params, mesh, specs)
      return jax.device_get(step(p, tx.init(p), put(grads, mesh, specs)))

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
  params = random_tree(40, [(64, 32), (40,), ()])
  grads = random_tree(41, [(64, 32), (40,), ()])
  tx = jaxfuse.adamw(LR, weight_decay=WD, packed=True)
  step = jax.jit(lambda g, s, p: jaxfuse.fused_step(tx, g, s, p))
  expected = step(grads, tx.init(params), params)
  with jax.set_mesh(mesh):
    p, g = jax.device_put((params, grads), NamedSharding(mesh, P()))
    state = tx.init(p)
    assert collectives(step.lower(g, state, p).compile().as_text()) == (0, 0)
    assert_bitwise_equal(step(g, state, p), expected, "replicated packed step")
    split = put(params, mesh, {"leaf0000": P("fsdp"), "leaf0001": P(), "leaf0002": P()})
    with pytest.raises(ValueError, match=r"leaf \['leaf0000'\] is split over mesh axes "
                                         r"\('fsdp',\)"):
      tx.init(split)


# ---- a packed state split over the data-parallel devices (packed="fsdp": ZeRO's first stage) ---

# A leaf large enough to be gathered alone (257 x 257: padded in its last chunk), small ones
# gathered packed, odd sizes, a scalar, an empty leaf.
SPLIT_SHAPES = [(257, 257), (5, 7), (), (33,), (16, 24), (40,), (0, 3)]
SPLIT_VARIANTS = [v for family in jaxfuse._optim.families.registered() for v in family.variants]


def _split_problem(seed, dtypes=None):
  dtypes = dtypes or [jnp.float32] * 4 + [jnp.bfloat16] * 3
  params = random_tree(seed, SPLIT_SHAPES, dtypes)
  grads = [random_tree(seed + 1 + t, SPLIT_SHAPES, dtypes) for t in range(2)]
  return params, grads


def _fused(tx):
  return jax.jit(lambda g, s, p: jaxfuse.fused_step(tx, g, s, p))


def _run(step, tx, params, grads, mesh=None):
  """Two steps from tx.init, on replicated arrays of `mesh` (or one device): (params, state)."""
  put_all = (lambda t: jax.device_put(t, NamedSharding(mesh, P()))) if mesh else (lambda t: t)
  params = put_all(params)
  state = tx.init(params)
  for g in grads:
    params, state = step(put_all(g), state, params)
  return params, state


def _split_buffers(state):
  return [x for x in jax.tree.leaves(state) if x.ndim == 1 and x.size > 64]


@pytest.mark.parametrize("variant", SPLIT_VARIANTS, ids=[v.label for v in SPLIT_VARIANTS])
def test_split_packed_state_every_family(variant):
  """Every variant of every family, its packed state split over 8 devices: the fused step gives
  the unsplit per-leaf step's params and state bit for bit; each device holds an eighth of the
  state; the step's collectives are one all-gather per params dtype of the new params' segments
  (these leaves are all small: gathered packed; never the state) and, for the trust-ratio
  families, one all-reduce of the per-leaf sums."""
  mesh = make_mesh("fsdp", "auto")
  params, grads = _split_problem(50)
  ref_params, ref_state = _run(_fused(variant()), variant(), params, grads)
  tx = variant(packed="fsdp")
  with jax.set_mesh(mesh):
    new_params, state = _run(_fused(tx), tx, params, grads, mesh)
    text = _fused(tx).lower(*jax.device_put((grads[0], state, new_params),
                                            NamedSharding(mesh, P()))).compile().as_text()
    converted = jaxfuse.convert_state(state, new_params, variant())[1]
  assert_bitwise_equal(new_params, ref_params, variant.label)
  assert_bitwise_equal(converted, ref_state, variant.label)
  for b in _split_buffers(state):
    assert b.sharding.spec == P("fsdp") and b.addressable_shards[0].data.size * 8 == b.size
  trust = "trust_sums_op" in variant.spec().contract.names
  assert collectives(text) == (3, 1 if trust else 0)  # the large leaf; f32 and bf16 small ones
  # The gathers' sizes are the params' (XLA:CPU gathers bf16 as f32), not the state's.
  small = {k: x for k, x in params.items() if x.size < 65536}
  spec = variant.spec(packed="fsdp")
  layout = jaxfuse._core.packing.layout_of(small, 8, ("fsdp",), spec.split_chunks(small, 8))
  gathered = re.findall(r"= \w+\[(\d+)\]\S* all-gather\(", text)
  assert sorted(map(int, gathered)) == sorted([*layout.buffer_sizes, 8 * 8257]), gathered


@pytest.mark.slow
def test_split_packed_state_optax_protocol():
  """tx.update on a split state: every device's updates of its chunks, gathered (the large leaf
  alone, the small ones one all-gather per updates dtype), as the unsplit protocol's within ulps
  (XLA may contract a multiply and an add in one program and not the other); the new state
  stays split and converts to the per-leaf one."""
  mesh = make_mesh("fsdp", "explicit")
  params, grads = _split_problem(60)

  def protocol(tx):
    return jax.jit(lambda g, s, p: tx.update(g, s, p))

  for make in (lambda **o: jaxfuse.adamw(LR, weight_decay=WD, **o),
               lambda **o: jaxfuse.lamb(LR, weight_decay=WD, **o)):
    ref, tx = make(), make(packed="fsdp")
    ref_updates, ref_state = protocol(ref)(grads[0], ref.init(params), params)
    with jax.set_mesh(mesh):
      p, g = jax.device_put((params, grads[0]), NamedSharding(mesh, P()))
      state = tx.init(p)
      updates, new_state = protocol(tx)(g, state, p)
      assert collectives(protocol(tx).lower(g, state, p).compile().as_text())[0] == 3
      converted = jaxfuse.convert_state(new_state, params, ref)[1]
    assert specs_of(updates) == jax.tree.map(lambda x: full_spec(P(), x.ndim), params)
    wide = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32), t)
    for tree, want in ((updates, ref_updates), (converted, ref_state)):
      assert_trees_close(wide(tree), wide(want), rtol=8 * ulp(jnp.float32), atol=0)


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
  second step): bit for bit with the unsplit per-leaf step; the master copy, remainders and
  8-bit codes and scales split alike (8-bit blocks whole in each segment); the state's
  donated buffers updated in place."""
  mesh = make_mesh("fsdp", kind)
  params, grads = _split_problem(70, [jnp.bfloat16] * 7)
  grads[1]["leaf0001"] = grads[1]["leaf0001"].at[2, 3].set(jnp.inf)
  make = lambda **o: optax.chain(jaxfuse.clip_by_global_norm(MAX_NORM),
                                 jaxfuse.adamw(LR, weight_decay=WD, **SPLIT_OPTIONS[option], **o))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # 8-bit: the small leaves' float states
    ref_params, ref_state = _run(_fused(make()), make(), params, grads)
    tx = make(packed="fsdp")
    with jax.set_mesh(mesh):
      step = jax.jit(lambda g, s, p: jaxfuse.fused_step(tx, g, s, p), donate_argnums=(1, 2))
      new_params, state = _run(step, tx, params, grads, mesh)
      converted = jaxfuse.convert_state(state, new_params, make())[1]
  assert_bitwise_equal(new_params, ref_params, option)
  assert_bitwise_equal(converted, ref_state, option)
  assert all(b.sharding.spec == P("fsdp") for b in _split_buffers(state))


@pytest.mark.slow
def test_split_packed_state_where_steps_run():
  """The split step over two mesh axes, inside the caller's shard_map, under
  optax.inject_hyperparams and jaxfuse.multi_steps, with packed params, and with stochastic
  rounding (one stream per chunk: deterministic, not the unsplit step's bits)."""
  params, grads = _split_problem(80, [jnp.float32] * 7)
  ref = jaxfuse.lamb(LR, weight_decay=WD)
  ref_params, _ = _run(_fused(ref), ref, params, grads)
  mesh = make_mesh("data_model", "auto")
  with jax.set_mesh(mesh):
    for axes in (("data", "model"), "model"):
      tx = jaxfuse.lamb(LR, weight_decay=WD, packed=axes)
      assert_bitwise_equal(_run(_fused(tx), tx, params, grads, mesh)[0], ref_params, str(axes))
  mesh = make_mesh("fsdp", "auto")
  adamw = lambda **o: jaxfuse.adamw(LR, weight_decay=WD, **o)
  ref_params, _ = _run(_fused(adamw()), adamw(), params, grads)
  tx = adamw(packed="fsdp")
  with jax.set_mesh(mesh):
    whole = jax.device_put(params, NamedSharding(mesh, P()))
    specs = jax.tree.map(lambda x: x.sharding.spec, tx.init(whole))
    manual = jax.jit(jax.shard_map(lambda g, s, p: jaxfuse.fused_step(tx, g, s, p),
                                   in_specs=(P(), specs, P()), out_specs=(P(), specs),
                                   check_vma=False))
    assert_bitwise_equal(_run(manual, tx, params, grads, mesh)[0], ref_params, "shard_map")
    inject = lambda **o: optax.inject_hyperparams(jaxfuse.adamw, static_args=("packed",))(
        learning_rate=LR, weight_decay=WD, **o)
    assert_bitwise_equal(_run(_fused(inject(packed="fsdp")), inject(packed="fsdp"), params, grads,
                              mesh)[0],
                         _run(_fused(inject()), inject(), params, grads)[0], "inject_hyperparams")
    ref_multi, multi = jaxfuse.multi_steps(adamw(), 2), jaxfuse.multi_steps(tx, 2)
    assert_bitwise_equal(_run(_fused(multi), multi, params, grads, mesh)[0],
                         _run(_fused(ref_multi), ref_multi, params, grads)[0], "multi_steps")
    packed = jax.jit(lambda g, s, p: jaxfuse.fused_step(
        tx, jaxfuse.pack(g), s, p))
    new_packed, _ = _run(packed, tx, jaxfuse.pack(params), grads, mesh)
    assert_bitwise_equal(new_packed.unpack(), ref_params, "packed params")
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    rounded = adamw(stochastic_rounding=True, packed="fsdp")
    first, second = (_run(_fused(rounded), rounded, bf16, grads, mesh)[0] for _ in range(2))
  assert_bitwise_equal(first, second, "stochastic rounding")
  unsplit = _run(_fused(adamw(stochastic_rounding=True)), adamw(stochastic_rounding=True), bf16,
                 grads)[0]
  assert_trees_close(jax.tree.map(lambda x: x.astype(jnp.float32), first),
                     jax.tree.map(lambda x: x.astype(jnp.float32), unsplit),
                     rtol=2 * ulp(jnp.bfloat16), atol=0)


def test_split_packed_state_errors():
  """Clear errors: no mesh with the axis, params split over devices, a state split otherwise than
  the transform says, a `packed` that is no axis name."""
  params = random_tree(90, [(16, 8), (8,)])
  tx = jaxfuse.adamw(LR, packed="fsdp")
  with pytest.raises(ValueError, match=r"packed='fsdp' splits the state over mesh axes "
                                       r"\('fsdp',\), and no mesh has them"):
    tx.init(params)
  with pytest.raises(TypeError, match=r"packed=3; expected a bool, or the name of a mesh axis"):
    jaxfuse.adamw(LR, packed=3)
  mesh = make_mesh("data_model", "auto")
  with jax.set_mesh(mesh):
    p = jax.device_put(params, NamedSharding(mesh, P()))
    split = dict(p, leaf0000=jax.device_put(params["leaf0000"], NamedSharding(mesh, P("model"))))
    with pytest.raises(ValueError, match=r"leaf \['leaf0000'\] is split over mesh axes "
                                         r"\('model',\)"):
      jaxfuse.adamw(LR, packed="data").init(split)
    state = jaxfuse.adamw(LR, packed="data").init(p)
    with pytest.raises(ValueError, match=r"opt_state was packed for other params: it is split "
                                         r"over \('data',\) in 4 segments"):
      _fused(jaxfuse.adamw(LR, packed="model"))(p, state, p)


# Muon's matrices FSDP-sharded every way a mesh splits them (rows, columns, both axes), a tall
# one that stacks with two wide ones as its transpose, and AdamW leaves.
MUON_LEAVES = {
    "fsdp": [((64, 128), P("fsdp")), ((64, 128), P(None, "fsdp")), ((128, 64), P("fsdp")),
             ((32, 32), P("fsdp")), ((32, 32), P()), ((128,), P("fsdp")), ((), P())],
    "data_model": [((64, 128), P("data", "model")), ((64, 128), P("model", "data")),
                   ((128, 64), P("data")), ((32, 32), P(None, "model")), ((32, 32), P()),
                   ((128,), P(("data", "model"))), ((), P())],
}


def _muon_collectives(tx, grads, state, params, fused=True):
  """(all-gathers, all-reduces, all-to-alls) in the compiled step."""
  step = (lambda g, s, p: jaxfuse.fused_step(tx, g, s, p)) if fused else tx.update
  text = jax.jit(step, donate_argnums=(1, 2)).lower(grads, state, params).compile().as_text()
  return (*collectives(text), len(re.findall(r"\ball-to-all(-start)?\(", text)))


@pytest.mark.parametrize("mesh_name,kind", [
    pytest.param("fsdp", "auto", marks=pytest.mark.slow),
    pytest.param("fsdp", "explicit", marks=pytest.mark.slow), ("data_model", "explicit")])
def test_muon_owner_compute(mesh_name, kind):
  """jaxfuse.muon with a folded clip on sharded matrices: each stack's matrices split over the
  mesh's devices, each device orthogonalizing whole matrices of its own, equal to the unsharded
  step to the matmuls' rounding, shardings kept. Its collectives are a fixed number per step
  (the same for 5 and 7 Newton-Schulz iterations: none inside them); with one mesh axis
  (FSDP) no all-gather, one all-reduce for the clip's norm and one for the replicated matrix's
  result, all-to-alls for the rest (a matrix split over two axes XLA gathers whole, once per
  step). optax's Muon (Auto; on Explicit meshes XLA refuses its x @ x.T of split matrices)
  all-gathers inside every iteration (benchmarks/bench_muon.py --fsdp counts both for 5 and 7
  iterations)."""
  mesh = make_mesh(mesh_name, kind)
  shapes = [s for s, _ in MUON_LEAVES[mesh_name]]
  params, grads = random_tree(1, shapes), random_tree(2, shapes, scale=0.5)
  specs = dict(zip(params, [spec for _, spec in MUON_LEAVES[mesh_name]]))
  make = lambda steps: optax.chain(jaxfuse.clip_by_global_norm(MAX_NORM),
                                   jaxfuse.muon(LR, ns_steps=steps, weight_decay=WD))
  tx = make(5)
  step = jax.jit(lambda g, s, p: jaxfuse.fused_step(tx, g, s, p), donate_argnums=(1, 2))
  expected, _ = step(grads, tx.init(params), jax.tree.map(jnp.copy, params))  # one device
  with jax.set_mesh(mesh):
    p, g = put(params, mesh, specs), put(grads, mesh, specs)
    counts = [_muon_collectives(make(n), g, make(n).init(p), p)
              for n in ((5, 7) if mesh_name == "fsdp" else (5,))]
    new, _ = step(g, tx.init(p), p)
  assert_trees_close(new, expected, rtol=64 * ulp(jnp.float32), atol=0, what="owner compute")
  assert specs_of(new) == padded_specs(specs, params)
  if mesh_name == "fsdp":
    assert counts[0] == counts[1] and counts[0][:2] == (0, 2), counts
  if mesh_name == "fsdp" and kind == "auto":
    with jax.set_mesh(mesh):
      ref = optax.contrib.muon(LR)
      optax_counts = _muon_collectives(ref, g, ref.init(p), p, fused=False)
    assert optax_counts[0] >= 5 * 3, optax_counts  # all-gathers: some per iteration and stack
