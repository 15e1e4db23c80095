"""What is schedule-free's own (the conformance suite runs the rest): the params to evaluate at,
from every layout of its state, and its own arguments' checks."""

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxfuse
from helpers import assert_bitwise_equal
from lockstep import jit_step, training_params, training_tree

SHAPES = [(7, 5), (301,), ()]


def _trained(tx, params, steps=3):
  """`steps` fused steps of `tx` from `params` (packed params: on the same grads, packed)."""
  step = jit_step("fused", tx)
  state = tx.init(params)
  packed = isinstance(params, jaxfuse.Packed)
  for t in range(steps):
    grads = training_tree(40 + t, jaxfuse.unpack(params) if packed else params)
    params, state = step(params, state, jaxfuse.pack(grads) if packed else grads)
  return params, state


def test_eval_params_of_every_layout(device):
  """x = (y - (1 - b1) z) / b1: optax's function on the plain state; the same bits from a
  packed state with packed params, and from a state inside a chain with opt-ins; with a master
  copy, computed from the master, rounded to the params' dtype."""
  make = lambda **o: jaxfuse.schedule_free_adamw(1e-2, b1=0.8, weight_decay=0.01, **o)
  params = training_params(31, SHAPES, jnp.float32, device)
  p, s = _trained(make(), params)
  x = jax.jit(jaxfuse.schedule_free_eval_params)(s, p)
  assert_bitwise_equal(x, jax.jit(optax.contrib.schedule_free_eval_params)(s, p), "plain")

  packed_p, packed_s = _trained(make(packed=True), jaxfuse.pack(params))
  packed_x = jax.jit(jaxfuse.schedule_free_eval_params)(packed_s, packed_p)
  assert_bitwise_equal(jaxfuse.unpack(packed_x), x, "packed")

  chain = optax.chain(jaxfuse.clip_by_global_norm(1e3), make(skip_nonfinite=True))
  chained_p, chained_s = _trained(chain, params)
  assert_bitwise_equal(jax.jit(jaxfuse.schedule_free_eval_params)(chained_s, chained_p), x,
                       "in a chain")

  bf16 = jax.tree.map(lambda v: v.astype(jnp.bfloat16), params)
  master_p, master_s = _trained(make(master_weights=True), bf16)
  master, z = jaxfuse.master_params(master_p, master_s), master_s[0].z
  expected = jax.tree.map(lambda m, zi: ((m - 0.2 * zi) / 0.8).astype(jnp.bfloat16), master, z)
  got = jax.jit(jaxfuse.schedule_free_eval_params)(master_s, master_p)
  assert jax.tree.map(lambda v: v.dtype, got) == jax.tree.map(lambda v: v.dtype, bf16)
  assert_bitwise_equal(got, jax.jit(lambda: expected)(), "with a master copy")


def test_rejects_bad_input():
  params = {"w": jnp.ones((3,))}
  with pytest.raises(ValueError, match=r"schedule_free_adamw: b1=0.0; expected b1 > 0"):
    jaxfuse.schedule_free_adamw(b1=0.0)
  with pytest.raises(TypeError, match=r"schedule_free_sgd: warmup_steps='5'; expected None"):
    jaxfuse.schedule_free_sgd(warmup_steps="5")
  with pytest.raises(ValueError, match="state_dtype complex64 is not supported"):
    jaxfuse.schedule_free_adamw(state_dtype=jnp.complex64)
  with pytest.raises(TypeError, match="a learning_rate schedule with warmup_steps=5; warmup_"):
    jaxfuse.schedule_free_adamw(optax.linear_schedule(0.1, 0.0, 10), warmup_steps=5)
  mixed16 = {"a": jnp.ones((2,), jnp.bfloat16), "b": jnp.ones((2,), jnp.float16)}
  with pytest.raises(TypeError, match=r"leaf \['a'\] is bfloat16 and leaf \['b'\] float16"):
    jaxfuse.schedule_free_adamw().init(mixed16)
  jaxfuse.schedule_free_adamw(master_weights=True).init(mixed16)  # the master's state
  with pytest.raises(ValueError, match=r"state_dtype bfloat16 is narrower than params leaf "
                                       r"\['w'\] \(float32\)"):
    jaxfuse.schedule_free_adamw(state_dtype=jnp.bfloat16).init(params)
  tx = jaxfuse.schedule_free_sgd()
  with pytest.raises(ValueError, match=r"schedule_free_sgd: update\(\) needs params \(for y,"):
    tx.update(params, tx.init(params))
  with pytest.raises(ValueError, match="holds 0 schedule-free states"):
    jaxfuse.schedule_free_eval_params(jaxfuse.adamw(1e-3).init(params), params)


def test_rounding_streams_follow_the_step(device):
  """Stochastic rounding draws each step's bits from its step count: SGD's base keeps no optax
  count, so the count is the state's own step counter (two otherwise equal states a few steps
  apart round differently; at a constant learning rate nothing else differs)."""
  tx = jaxfuse.schedule_free_sgd(0.1, stochastic_rounding=True)
  params = training_params(33, [(4096,)], jnp.bfloat16, device)
  grads, state = training_tree(34, params), tx.init(params)
  step = jit_step("fused", tx)
  later = state._replace(step_count=state.step_count + 5)
  (p, s), (p_later, s_later) = step(params, state, grads), step(params, later, grads)
  assert_bitwise_equal(s.z, s_later.z, "z (rounded to nearest)")
  assert (p["leaf0000"] != p_later["leaf0000"]).any()
