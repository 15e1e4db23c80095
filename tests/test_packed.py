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
from lockstep import jit_step, lockstep, training_params

# Mixed shapes and dtypes: a quantizable matrix (8-bit states), odd sizes that leave gaps
# between packed leaves, a scalar, a bf16 matrix and vector (their states in another buffer).
SHAPES = [(64, 128), (5, 7), (), (33,), (16, 24), (40,)]
DTYPES = [jnp.float32] * 4 + [jnp.bfloat16] * 2


def _steps(tx, params, steps=2, seed=10):
  """`steps` fused steps of `tx` from `params` on fresh random grads: (params, state)."""
  state, fused, leaves = tx.init(params), jit_step("fused", tx), jax.tree.leaves(params)
  for t in range(steps):
    g = random_tree(seed + t, [x.shape for x in leaves], [x.dtype for x in leaves])
    params, state = fused(params, state, g)
  return params, state


def _packed_equals_per_leaf(make, params, what, **kw):
  """`make(packed=True)`'s fused steps give `make()`'s params and state bit for bit (returned)."""
  ref, (new_params, state) = _steps(make(), params, **kw), _steps(make(packed=True), params, **kw)
  assert_bitwise_equal((new_params, jaxfuse.unpack(state)), ref, what)
  return ref, (new_params, state)


VARIANTS = [v for family in families.registered() for v in family.variants]


@pytest.mark.parametrize("variant", VARIANTS, ids=[v.label for v in VARIANTS])
def test_every_family_packed_equals_per_leaf(variant):
  """Each variant of every family: the packed state's fused steps give the per-leaf steps'
  params and states bit for bit, with a handful of state arrays."""
  _, (_, state) = _packed_equals_per_leaf(variant, random_tree(1, SHAPES, DTYPES), variant.label)
  lists = len(variant.spec().lists()["operands"]) - 2
  scalars = len(jax.tree.leaves(variant().init({})))  # the state of no leaves: counts and such
  assert len(jax.tree.leaves(state)) <= scalars + 2 * lists  # a buffer per dtype per list


OPTIONS = {
    "master": dict(master_weights=True),
    "remainder": dict(master_weights="remainder"),
    "8-bit": dict(moment_bits=8, master_weights=True),
    "stochastic rounding": dict(stochastic_rounding=True, seed=7),
    "skip non-finite": dict(skip_nonfinite=True),
}


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_options_packed_equal_per_leaf(option):
  """AdamW with each option that changes the state or the params' rounding: packed equals
  per-leaf bit for bit, through the fused step and the optax protocol."""
  dtypes = [jnp.bfloat16] * len(SHAPES) if option in ("remainder", "stochastic rounding") \
      else DTYPES
  params = random_tree(2, SHAPES, dtypes)
  make = lambda **kw: jaxfuse.adamw(1e-2, weight_decay=0.1, **OPTIONS[option], **kw)
  (ref_params, ref_state), (new_params, state) = _packed_equals_per_leaf(make, params, option)
  grads = random_tree(20, SHAPES, dtypes)
  u_ref, s_ref = jax.jit(make().update)(grads, ref_state, ref_params)
  u, s = jax.jit(make(packed=True).update)(grads, state, new_params)
  assert_bitwise_equal((u, jaxfuse.unpack(s)), (u_ref, s_ref), f"{option}: updates, state")


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
  params = random_tree(4, SHAPES, DTYPES)
  packed = jaxfuse.pack(params)
  assert len(jax.tree.leaves(packed)) == 2  # float32 and bfloat16
  tx = make()
  state, ref, ref_state = tx.init(packed), params, tx.init(params)
  step, ref_step = jit_step("fused", tx, donate=True), jit_step("fused", tx)
  for t in range(2):
    grads = _grads_of_packed(packed, 0.5 + t)
    ref, ref_state = ref_step(ref, ref_state, grads.unpack())
    packed, state = step(packed, state, grads)
  assert isinstance(packed, jaxfuse.Packed)
  assert_bitwise_equal((packed.unpack(), jaxfuse.unpack(state)), (ref, ref_state), "params, state")


def test_state_arrays_do_not_grow_with_leaves():
  """The packed state of 10 and of 300 leaves has the same arrays; over 300 leaves (two calls
  chained through the same buffers, a zero-size leaf left out) the steps are the per-leaf ones;
  jaxfuse.report counts the step's arrays and its state's."""
  for n in (10, 300):
    params = random_tree(5, [(3, 4)] * n)
    assert len(jax.tree.leaves(jaxfuse.adamw(1e-3, packed=True).init(params))) == 3, n
  many = random_tree(6, [(3, 4)] * 150 + [(0, 3)] + [(5,)] * 149)
  make = lambda **kw: jaxfuse.adamw(1e-3, weight_decay=0.1, mask=families.some_leaves, **kw)
  _packed_equals_per_leaf(make, many, "300 leaves", seed=7)
  tx, plain, packed = jaxfuse.adamw(1e-3, packed=True), jaxfuse.adamw(1e-3), jaxfuse.pack(params)
  r = jaxfuse.report(jit_step("fused", tx), packed, tx.init(packed), packed,
                     baseline=(jit_step("fused", plain), (params, plain.init(params), params)))
  assert (r.argument_arrays, r.state_arrays) == (5, 3)
  assert (r.baseline.argument_arrays, r.baseline.state_arrays) == (4 * 300 + 1, 2 * 300 + 1)
  assert r.params == 300 * 12 and "arrays passed to the step" in str(r)


@pytest.mark.parametrize("option", ["float", "8-bit", "remainder"])
def test_convert_state_both_ways_bit_for_bit(option):
  """A packed state converts to the per-leaf layout and back bit for bit (checkpoints stay
  portable), and the float one to optax's own AdamW."""
  kw = {"float": {}, "8-bit": dict(moment_bits=8), "remainder": dict(master_weights="remainder")}
  dtypes = [jnp.bfloat16] * len(SHAPES) if option == "remainder" else DTYPES
  params, state = _steps(jaxfuse.adamw(1e-2, packed=True, **kw[option]),
                         random_tree(6, SHAPES, dtypes))
  per_leaf_tx = jaxfuse.adamw(1e-2, **kw[option])
  p1, per_leaf = jaxfuse.convert_state(state, params, per_leaf_tx)
  assert_bitwise_equal(per_leaf, jaxfuse.unpack(state), "to per-leaf")
  p2, back = jaxfuse.convert_state(per_leaf, p1, jaxfuse.adamw(1e-2, packed=True, **kw[option]))
  assert_bitwise_equal((p2, back), (params, state), "params, state back")
  if option == "float":
    _, ref = jaxfuse.convert_state(state, params, optax.adamw(1e-2))
    assert_bitwise_equal(ref[0].mu, jaxfuse.unpack(state)[0].mu, "optax's mu")
    packed = jaxfuse.pack(params)
    p3, s3 = jaxfuse.convert_state(ref, packed, per_leaf_tx)  # packed params: packed state
    assert isinstance(p3, jaxfuse.Packed) and isinstance(s3[0].mu, jaxfuse.Packed)


def test_wrappers_of_a_packed_state():
  """inject_hyperparams, multi_steps and a folded clip: packed equals per-leaf bit for bit."""
  params = random_tree(7, SHAPES, DTYPES)
  for make in (
      lambda **kw: optax.inject_hyperparams(jaxfuse.adamw)(learning_rate=1e-2, **kw),
      lambda **kw: jaxfuse.multi_steps(jaxfuse.adamw(1e-2, **kw), 2),
      lambda **kw: optax.chain(jaxfuse.clip_by_global_norm(0.5), jaxfuse.adamw(1e-2, **kw))):
    _packed_equals_per_leaf(make, params, "wrapped", steps=4)


def test_flax_train_state_and_nnx():
  pytest.importorskip("flax")
  from flax import nnx
  from jaxfuse.flax import Optimizer, TrainState
  params = random_tree(8, SHAPES, DTYPES)
  create = lambda p: TrainState.create(apply_fn=None, params=p,
                                       tx=jaxfuse.adamw(1e-2, weight_decay=0.1))
  apply = jax.jit(lambda ts, g: ts.apply_gradients(grads=g))
  grads = _grads_of_packed(jaxfuse.pack(params), 0.7)
  ts, ref = apply(create(jaxfuse.pack(params)), grads), apply(create(params), grads.unpack())
  assert_bitwise_equal(ts.params.unpack(), ref.params, "TrainState")

  x = jnp.asarray(np.random.default_rng(9).standard_normal((3, 8)), jnp.float32)
  models = [nnx.Linear(8, 4, rngs=nnx.Rngs(0)) for _ in range(2)]
  for model, packed in zip(models, (True, False)):
    opt = Optimizer(model, jaxfuse.adamw(1e-2, packed=packed), wrt=nnx.Param)
    opt.update(model, nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model))
  np.testing.assert_array_equal(models[0].kernel[...], models[1].kernel[...])


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
