"""Packed trees (jaxfuse/_core/packing.py): optimizer states kept as one flat buffer per dtype
(``packed=True``) and packed params (``jaxfuse.pack``), against the per-leaf layout on fresh
random trees: the same bits through the fused step in every family, the optax protocol, state
conversion both ways, everything a step is wrapped in, and clear errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxfuse
from jaxfuse._optim import families
from helpers import assert_bitwise_equal, assert_trees_close, random_tree
from lockstep import lockstep, training_params

# Mixed shapes and dtypes: a quantizable matrix (8-bit states), odd sizes that leave gaps
# between packed leaves, a scalar, a bf16 matrix and vector (their states in another buffer).
SHAPES = [(64, 128), (5, 7), (), (33,), (16, 24), (40,)]
DTYPES = [jnp.float32] * 4 + [jnp.bfloat16] * 2


def _params(seed, dtypes=DTYPES):
  return random_tree(seed, SHAPES, list(dtypes))


def _fused(tx):
  return jax.jit(lambda g, s, p: jaxfuse.fused_step(tx, g, s, p))


def _steps(tx, params, steps=2, seed=10, dtypes=DTYPES):
  """`steps` fused steps of `tx` from `params` on fresh random grads: (params, state)."""
  state, fused = tx.init(params), _fused(tx)
  for t in range(steps):
    params, state = fused(random_tree(seed + t, SHAPES, list(dtypes)), state, params)
  return params, state


VARIANTS = [v for family in families.registered() for v in family.variants]


@pytest.mark.parametrize("variant", VARIANTS, ids=[v.label for v in VARIANTS])
def test_every_family_packed_equals_per_leaf(variant):
  """Each variant of every family: the packed state's fused steps give the per-leaf steps'
  params and states bit for bit, with a handful of state arrays."""
  params = _params(1)
  ref_params, ref_state = _steps(variant(), params)
  tx = variant(packed=True)
  new_params, state = _steps(tx, params)
  assert_bitwise_equal(new_params, ref_params, variant.label)
  assert_bitwise_equal(jaxfuse.unpack(state), ref_state, variant.label)
  lists = len(variant.spec().lists()["operands"]) - 2
  assert len(jax.tree.leaves(state)) <= 1 + 2 * lists  # the count, a buffer per dtype per list


OPTIONS = {
    "master": dict(master_weights=True),
    "remainder": dict(master_weights="remainder"),
    "8-bit": dict(moment_bits=8, master_weights=True),
    "stochastic rounding": dict(stochastic_rounding=True, seed=7),
    "skip non-finite": dict(skip_nonfinite=True),
}


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_options_packed_equal_per_leaf(option):
  """AdamW with each option that changes the state or the params' rounding: packed fused steps
  equal per-leaf ones bit for bit, and the optax protocol on the packed state agrees with the
  per-leaf one."""
  dtypes = [jnp.bfloat16] * len(SHAPES) if option in ("remainder", "stochastic rounding") \
      else DTYPES
  params = _params(2, dtypes)
  make = lambda **kw: jaxfuse.adamw(1e-2, weight_decay=0.1, **OPTIONS[option], **kw)
  ref_params, ref_state = _steps(make(), params, dtypes=dtypes)
  new_params, state = _steps(make(packed=True), params, dtypes=dtypes)
  assert_bitwise_equal(new_params, ref_params, option)
  assert_bitwise_equal(jaxfuse.unpack(state), ref_state, option)
  grads = random_tree(20, SHAPES, dtypes)
  u_ref, s_ref = jax.jit(make().update)(grads, ref_state, ref_params)
  u, s = jax.jit(make(packed=True).update)(grads, state, new_params)
  assert_bitwise_equal(u, u_ref, f"{option}: updates")
  assert_bitwise_equal(jaxfuse.unpack(s), s_ref, f"{option}: state")


def test_optax_protocol_matches_optax():
  """tx.update on a packed state is optax's AdamW, in lockstep."""
  params = training_params(3, SHAPES, jnp.float32)
  lockstep(jaxfuse.adamw(1e-2, weight_decay=0.1, packed=True), optax.adamw(1e-2, weight_decay=0.1),
           params, 3, path="optax")
  # update() without params (Adam has no weight decay to read them for), packed params too
  packed = jaxfuse.pack(params)
  for tx, x in ((jaxfuse.adam(1e-2, packed=True), params), (jaxfuse.adam(1e-2), packed)):
    u, _ = tx.update(x, tx.init(x))
    v, _ = optax.adam(1e-2).update(params, optax.adam(1e-2).init(params))
    assert_trees_close(jaxfuse.unpack(u), v, rtol=1e-6, atol=0)


@jax.jit
def _grads_of_packed(packed, x):
  """The gradient of a loss of the unpacked params with respect to the packed ones."""
  def loss(p):
    leaves = jax.tree.leaves(jaxfuse.unpack(p))
    return sum(jnp.sum(jnp.sin(leaf.astype(jnp.float32) * x)) for leaf in leaves)
  return jax.grad(loss)(packed)


@pytest.mark.parametrize("make", [
    lambda **kw: jaxfuse.adamw(1e-2, weight_decay=0.1, mask=families.some_leaves, **kw),
    lambda **kw: jaxfuse.lamb(1e-2, weight_decay=0.1, mask=families.some_leaves, **kw),
], ids=["adamw", "lamb"])
def test_packed_params(make):
  """Params packed by jaxfuse.pack, their gradient taken through jaxfuse.unpack: the fused step
  updates the flat buffers per leaf (the weight-decay mask and LAMB's trust ratios per leaf),
  equal bit for bit to the per-leaf step on the same gradients."""
  params = _params(4)
  packed = jaxfuse.pack(params)
  assert len(jax.tree.leaves(packed)) == 2  # float32 and bfloat16
  tx = make()
  state = tx.init(packed)
  ref_state = tx.init(params)
  ref = params
  step = jax.jit(lambda g, s, p: jaxfuse.fused_step(tx, g, s, p), donate_argnums=(1, 2))
  ref_step = _fused(tx)
  for t in range(2):
    grads = _grads_of_packed(packed, 0.5 + t)
    ref, ref_state = ref_step(grads.unpack(), ref_state, ref)
    packed, state = step(grads, state, packed)
  assert isinstance(packed, jaxfuse.Packed)
  assert_bitwise_equal(packed.unpack(), ref, "params")
  assert_bitwise_equal(jaxfuse.unpack(state), ref_state, "state")


def test_state_arrays_do_not_grow_with_leaves():
  """The packed state of 10 and of 300 leaves has the same arrays; over 300 leaves (two calls
  chained through the same buffers, a zero-size leaf left out) the steps are the per-leaf ones;
  jaxfuse.report counts the step's arrays and its state's."""
  counts = []
  for n in (10, 300):
    params = random_tree(5, [(3, 4)] * n)
    state = jaxfuse.adamw(1e-3, packed=True).init(params)
    counts.append(len(jax.tree.leaves(state)))
  assert counts[0] == counts[1] == 3
  shapes = [(3, 4)] * 150 + [(0, 3)] + [(5,)] * 149
  many = random_tree(6, shapes)
  make = lambda **kw: jaxfuse.adamw(1e-3, weight_decay=0.1, mask=families.some_leaves, **kw)
  results = []
  for tx in (make(), make(packed=True)):
    p, s = many, tx.init(many)
    for t in range(2):
      p, s = _fused(tx)(random_tree(7 + t, shapes), s, p)
    results.append((p, jaxfuse.unpack(s)))
  assert_bitwise_equal(results[1], results[0], "300 leaves")
  tx = jaxfuse.adamw(1e-3, packed=True)
  packed = jaxfuse.pack(params)
  r = jaxfuse.report(lambda g, s, p: jaxfuse.fused_step(tx, g, s, p), packed,
                     tx.init(packed), packed,
                     baseline=(lambda g, s, p: jaxfuse.fused_step(jaxfuse.adamw(1e-3), g, s, p),
                               (params, jaxfuse.adamw(1e-3).init(params), params)))
  assert (r.argument_arrays, r.state_arrays) == (5, 3)
  assert (r.baseline.argument_arrays, r.baseline.state_arrays) == (4 * 300 + 1, 2 * 300 + 1)
  assert r.params == 300 * 12 and "arrays passed to the step" in str(r)


@pytest.mark.parametrize("option", ["float", "8-bit", "remainder"])
def test_convert_state_both_ways_bit_for_bit(option):
  """A packed state converts to the per-leaf layout and back bit for bit (checkpoints stay
  portable), and the float one to optax's own AdamW."""
  kw = {"float": {}, "8-bit": dict(moment_bits=8), "remainder": dict(master_weights="remainder")}
  dtypes = [jnp.bfloat16] * len(SHAPES) if option == "remainder" else DTYPES
  params, state = _steps(jaxfuse.adamw(1e-2, packed=True, **kw[option]), _params(6, dtypes),
                         dtypes=dtypes)
  per_leaf_tx = jaxfuse.adamw(1e-2, **kw[option])
  p1, per_leaf = jaxfuse.convert_state(state, params, per_leaf_tx)
  assert_bitwise_equal(per_leaf, jaxfuse.unpack(state), "to per-leaf")
  p2, back = jaxfuse.convert_state(per_leaf, p1, jaxfuse.adamw(1e-2, packed=True, **kw[option]))
  assert_bitwise_equal(back, state, "back")
  assert_bitwise_equal(p2, params, "params")
  if option == "float":
    _, ref = jaxfuse.convert_state(state, params, optax.adamw(1e-2))
    assert_bitwise_equal(ref[0].mu, jaxfuse.unpack(state)[0].mu, "optax's mu")
    packed = jaxfuse.pack(params)
    p3, s3 = jaxfuse.convert_state(ref, packed, per_leaf_tx)  # packed params: packed state
    assert isinstance(p3, jaxfuse.Packed) and isinstance(s3[0].mu, jaxfuse.Packed)


def test_wrappers_of_a_packed_state():
  """inject_hyperparams, multi_steps and a folded clip keep the packed state bit for bit equal to
  the per-leaf one."""
  params = _params(7)
  for make in (
      lambda **kw: optax.inject_hyperparams(jaxfuse.adamw)(learning_rate=1e-2, **kw),
      lambda **kw: jaxfuse.multi_steps(jaxfuse.adamw(1e-2, **kw), 2),
      lambda **kw: optax.chain(jaxfuse.clip_by_global_norm(0.5), jaxfuse.adamw(1e-2, **kw))):
    ref_params, ref_state = _steps(make(), params, steps=4)
    new_params, state = _steps(make(packed=True), params, steps=4)
    assert_bitwise_equal(new_params, ref_params, "params")
    assert_bitwise_equal(jaxfuse.unpack(state), ref_state, "state")


def test_flax_train_state_and_nnx():
  flax = pytest.importorskip("flax")
  del flax
  from flax import nnx
  from jaxfuse.flax import Optimizer, TrainState
  params = _params(8)
  ts = TrainState.create(apply_fn=None, params=jaxfuse.pack(params),
                         tx=jaxfuse.adamw(1e-2, weight_decay=0.1))
  ref = TrainState.create(apply_fn=None, params=params, tx=jaxfuse.adamw(1e-2, weight_decay=0.1))
  grads = _grads_of_packed(ts.params, 0.7)
  ts = jax.jit(lambda ts, g: ts.apply_gradients(grads=g))(ts, grads)
  ref = jax.jit(lambda ts, g: ts.apply_gradients(grads=g))(ref, grads.unpack())
  assert_bitwise_equal(ts.params.unpack(), ref.params, "TrainState")

  model = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
  twin = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
  opt = Optimizer(model, jaxfuse.adamw(1e-2, packed=True), wrt=nnx.Param)
  ref_opt = Optimizer(twin, jaxfuse.adamw(1e-2), wrt=nnx.Param)
  x = jnp.asarray(np.random.default_rng(9).standard_normal((3, 8)), jnp.float32)
  for m, o in ((model, opt), (twin, ref_opt)):
    grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(m)
    o.update(m, grads)
  np.testing.assert_array_equal(model.kernel[...], twin.kernel[...])


def test_bad_inputs_name_the_leaf():
  params = {"a": jnp.ones((3, 5)), "b": jnp.ones((7,))}
  tx = jaxfuse.adamw(1e-2, packed=True)
  state = tx.init(params)
  other = {"a": jnp.ones((5, 3)), "b": jnp.ones((7,))}
  with pytest.raises(ValueError, match=r"packed for other params: its leaf \['a'\] is "
                                       r"float32\[3, 5\], these params make it float32\[5, 3\]"):
    jaxfuse.fused_step(tx, other, state, other)
  bigger = dict(params, c=jnp.ones(2))
  with pytest.raises(ValueError, match=r"a tree of 2 leaves, with no leaf \['c'\]"):
    jaxfuse.fused_step(tx, bigger, state, bigger)
  with pytest.raises(ValueError, match="opt_state is packed"):
    jaxfuse.adamw(1e-2).update(params, state, params)
  packed = jaxfuse.pack(params)
  with pytest.raises(TypeError, match="the params are packed .* and the grads are not"):
    jaxfuse.fused_step(tx, params, tx.init(packed), packed)
  with pytest.raises(TypeError, match="packed=1.5; expected a bool, or the name of a mesh axis"):
    jaxfuse.adamw(1e-2, packed=1.5)
  with pytest.raises(ValueError, match=r"splits the state over mesh axes \('yes',\), and no mesh"):
    jaxfuse.adamw(1e-2, packed="yes").init(params)
  with pytest.raises(ValueError, match="cannot be packed as"):
    jaxfuse.pack(other, packed.layout)
  bf16 = jaxfuse.pack(jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))
  rounded = jaxfuse.adamw(1e-2, stochastic_rounding=True)
  with pytest.raises(ValueError, match="run in jaxfuse.fused_step only"):
    rounded.update(bf16, rounded.init(bf16), bf16)
