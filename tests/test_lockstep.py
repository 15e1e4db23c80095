"""The comparator of the optimizer tests (lockstep.py) fails on deliberately wrong steps: a bias
correction one step off, weight decay applied after the update, an update rounded to the params'
dtype before it is added, an 8-bit code one step off, a stochastically rounded param two ulps
away, a step that traces again; and its running-error magnitudes see cancellation."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lockstep import (_round_down, allowed, allowed_quantized, lockstep, reference_step,
                      training_params, training_tree)
from jaxfuse._optim import moments

SHAPES = [(), (3,), (7, 5), (301,)]
LR, WD = 1e-2, 0.1


def _adamw_with(update):
  return optax.GradientTransformation(optax.adamw(LR, weight_decay=WD).init, update)


def _bias_correction_one_step_off(g, s, p=None):
  tx = optax.adamw(LR, weight_decay=WD)
  ahead = (s[0]._replace(count=s[0].count + 1),) + tuple(s[1:])
  u, _ = tx.update(g, ahead, p)
  return u, tx.update(g, s, p)[1]  # the state's count stays right: only the step is off


def _decay_after_the_update(g, s, p=None):
  inner = optax.adam(LR)
  u, s_adam = inner.update(g, (s[0],) + tuple(s[2:]), p)
  u = jax.tree.map(lambda u, p: u - LR * WD * (p + u), u, p)  # decays the updated params
  return u, (s_adam[0], s[1]) + tuple(s_adam[1:])


@pytest.mark.parametrize("wrong", [_bias_correction_one_step_off, _decay_after_the_update],
                         ids=["bias correction one step off", "decay after the update"])
def test_lockstep_fails_on_a_wrong_step(wrong):
  params = training_params(0, SHAPES, jnp.float32)
  with pytest.raises(AssertionError, match="step 0 .*outside one step's rounding"):
    lockstep(_adamw_with(wrong), optax.adamw(LR, weight_decay=WD), params, 2, path="optax")


def test_lockstep_passes_the_right_step():
  """The control of the wrong steps above: the same inputs, the right step."""
  params = training_params(0, SHAPES, jnp.float32)
  lockstep(optax.adamw(LR, weight_decay=WD), optax.adamw(LR, weight_decay=WD), params, 2,
           path="optax")


def test_lockstep_fails_on_a_retrace():
  """Grads of another dtype at step 2: the jitted step traces again."""
  params = training_params(0, SHAPES, jnp.float32)
  grads = lambda t, p: jax.tree.map(lambda x: x.astype(jnp.bfloat16) if t == 2 else x,
                                    training_tree(t, p))
  with pytest.raises(AssertionError, match=r"step 2 \(optax\) traced the step again"):
    lockstep(optax.sgd(LR), optax.sgd(LR), params, 3, path="optax", grads=grads)


def _step_bits(dtype):
  """bf16 params, one reference AdamW step: (params, exact new params, magnitudes, updates)."""
  params = training_params(1, [(4096,)], dtype)
  tx = optax.adamw(LR, weight_decay=WD)
  (p_new, _, u), (m, _, _) = reference_step(tx, training_tree(2, params), tx.init(params), params)
  return params["leaf0000"], p_new["leaf0000"], m["leaf0000"], u["leaf0000"]


def test_allowed_fails_on_an_update_rounded_before_it_is_added():
  p, exact, m, u = _step_bits(jnp.bfloat16)
  right = jnp.asarray(exact, jnp.bfloat16)
  twice = (p + jnp.asarray(u, jnp.bfloat16)).astype(jnp.bfloat16)  # rounded, then the sum
  assert allowed(right, exact, m).all()
  # Where the float32 bound rounds to one bf16 value, any other value is out.
  e, b = np.asarray(exact), np.finfo(np.float32).eps * np.asarray(m)
  one = (e - b).astype(jnp.bfloat16) == (e + b).astype(jnp.bfloat16)
  wrong = one & (np.asarray(twice) != (e - b).astype(jnp.bfloat16))
  assert wrong.sum() > 10
  assert not allowed(twice, exact, m)[wrong].any()


def test_stochastic_rounding_allows_either_neighbour_and_no_more():
  p, exact, m, _ = _step_bits(jnp.bfloat16)
  x = np.asarray(exact)
  down = _round_down(x, jnp.bfloat16)
  up = np.nextafter(down, np.asarray(np.inf, down.dtype))
  assert allowed(down, x, m, stochastic=True).all() and allowed(up, x, m, stochastic=True).all()
  two_away = np.nextafter(up, np.asarray(np.inf, up.dtype))
  # Two ulps away is out wherever the float32 bound is under an ulp (all but the elements the
  # step moved across binades, whose magnitude is the step's, not their own).
  b = np.finfo(np.float32).eps * m
  tight = (x - b > down.astype(np.float64)) & (x + b < up.astype(np.float64))
  assert tight.mean() > 0.9
  assert not allowed(two_away, x, m, stochastic=True)[tight].any()
  # Nearest: where the bound rounds to one value, the other neighbour is out.
  one = (x - b).astype(down.dtype) == (x + b).astype(down.dtype)
  other = one & (up != x.astype(down.dtype))
  assert other.mean() > 0.3
  assert not allowed(up, x, m)[other].any()


def test_allowed_quantized_fails_on_a_code_one_step_off():
  x = np.asarray(training_tree(3, {"m": jnp.zeros((32, 128))})["m"], np.float64)
  q = moments.quantize(jnp.asarray(x, jnp.float32), True, 128)
  zero = np.zeros(x.shape)
  assert allowed_quantized(q, x, zero).all()
  codes = np.asarray(q.codes)
  off = q._replace(codes=jnp.asarray(np.where(codes % 2 == 0, codes + 1, codes - 1), jnp.int8))
  assert not allowed_quantized(off, x, zero).any()


def test_magnitudes_see_cancellation():
  """p - lr g where p nearly cancels it: the magnitude is that of the terms, not the result."""
  p = {"w": jnp.asarray([1.0, 1.0], jnp.float32)}
  g = {"w": jnp.asarray([1.0 - 2**-20, 1e-6], jnp.float32)}
  (p_new, _, _), (m, _, _) = reference_step(optax.sgd(1.0), g, optax.sgd(1.0).init(p), p)
  ratio = np.asarray(m["w"]) / np.abs(np.asarray(p_new["w"]))
  assert np.asarray(p_new["w"])[0] == pytest.approx(2**-20)
  assert ratio[0] > 2**19  # |lr g| (its product's rounding) over the result
  assert ratio[1] < 3  # no cancellation: the result's own roundings
