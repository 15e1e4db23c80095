"""What a new user meets first, said rather than done silently: hyperparameters that are not
numbers are refused naming the argument, ``moment_bits=8`` says which leaves it left in floats
(and ``jaxfuse.report`` lists them), and ``fused_step`` says when params or state were not
donated (the in-place update then copies them first; the check reads jax's lowering, the
arguments of ``main``, so CI runs this file on the oldest jax too).
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxfuse
from jaxfuse._core import notices
from jaxfuse._optim.families import registered
from lockstep import lockstep


@pytest.mark.parametrize("call, match", [
    (lambda: jaxfuse.adamw("1e-3"), r"jaxfuse\.adamw: learning_rate='1e-3' is a str; expected a "
                                    r"float, an array or a schedule"),
    (lambda: jaxfuse.adam(1e-3, b1="0.9"), r"jaxfuse\.adam: b1='0\.9' is a str; expected a float "
                                           r"or an array"),
    (lambda: jaxfuse.sgd(0.1, momentum=[0.9]), r"jaxfuse\.sgd: momentum=\[0\.9\] is a list"),
    (lambda: jaxfuse.lion(1e-4, weight_decay=True), r"jaxfuse\.lion: weight_decay=True is a bool"),
    (lambda: jaxfuse.rmsprop(jnp.ones(3)), r"learning_rate is an array of shape \(3,\); expected a "
                                           r"scalar"),
    (lambda: jaxfuse.lamb(jnp.array(1 + 1j)), r"learning_rate is a complex64 array"),
    (lambda: jaxfuse.lars(0.1, nesterov="False"), r"jaxfuse\.lars: nesterov='False' is a str; "
                                                  r"expected a bool"),
    (lambda: jaxfuse.clip_by_global_norm("1"), r"jaxfuse\.clip_by_global_norm: max_norm='1' is a "
                                               r"str"),
])
def test_hyperparameters_that_are_not_numbers_are_refused(call, match):
  with pytest.raises(TypeError, match=match):
    call()


def test_numbers_arrays_schedules_and_traced_hyperparameters_are_taken():
  for family in registered():
    for function in family.functions:
      function(np.float32(1e-3))
  jaxfuse.adamw(optax.cosine_decay_schedule(1e-3, 100), b1=jnp.float32(0.8), eps=1)
  jaxfuse.sgd(0.1, momentum=None)
  tx = optax.inject_hyperparams(jaxfuse.adamw)(learning_rate=1e-3, b1=0.9)  # traced in update
  params = {"w": jnp.linspace(-1.0, 1.0, 12)}
  jax.jit(tx.update)(params, tx.init(params), params)


def test_moment_bits_8_names_the_leaves_it_keeps_in_floats():
  params = {"square_100": jnp.ones((100, 100)), "bias_7": jnp.ones((7,)),
            "kernel": jnp.ones((64, 128))}
  tx = jaxfuse.adamw(1e-3, moment_bits=8)
  with pytest.warns(UserWarning) as seen:
    state = tx.init(params)
  (message,) = [str(w.message) for w in seen if "moment_bits=8" in str(w.message)]
  assert "keeps the states of 2 of 3 params leaves in floats" in message
  assert "['square_100'] (100, 100)" in message and "1 under 4096 elements" in message
  assert "['kernel']" not in message
  with warnings.catch_warnings():  # once: the same tree does not warn again
    warnings.simplefilter("error")
    tx.init(params)
  step = jax.jit(lambda g, s, p: jaxfuse.fused_step(tx, g, s, p), donate_argnums=(1, 2))
  report = jaxfuse.report(step, params, state, params)
  assert report.float_state_leaves == ["['bias_7']", "['square_100']"]
  assert "2 leaves: ['bias_7'], ['square_100']" in str(report)
  plain = jaxfuse.adamw(1e-3)
  plain_step = jax.jit(lambda g, s, p: jaxfuse.fused_step(plain, g, s, p), donate_argnums=(1, 2))
  assert jaxfuse.report(plain_step, params, plain.init(params), params).float_state_leaves == []


def _donation_warnings(fn, *args):
  notices.forget()
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    fn(*args)
  return [str(w.message) for w in seen if "jaxfuse.fused_step" in str(w.message)]


def test_fused_step_says_when_params_or_state_are_not_donated():
  params = {"w": jax.random.normal(jax.random.key(0), (256, 128)), "b": jnp.arange(7.0)}
  grads = jax.tree.map(lambda p: 0.1 * p, params)
  tx = jaxfuse.adamw(1e-3)
  step = lambda g, s, p: jaxfuse.fused_step(tx, g, s, p)
  copy = lambda: jax.tree.map(jnp.copy, params)

  (none,) = _donation_warnings(jax.jit(step), grads, tx.init(params), params)
  assert "params (2 of 2 leaves) and opt_state (5 of 5 leaves) are not donated" in none
  assert f"({(3 * (256 * 128 + 7) * 4 + 4) / 1e6:.3g} MB)" in none  # params, mu, nu, count
  assert "jax.tree.map(jnp.copy, params)" in none
  (half,) = _donation_warnings(jax.jit(step, donate_argnums=1), grads, tx.init(params), params)
  assert "params (2 of 2 leaves) are not donated" in half and "opt_state" not in half
  assert _donation_warnings(jax.jit(step, donate_argnums=(1, 2)), grads, tx.init(params),
                            copy()) == []
  # params made inside the step are not the caller's: nothing to say
  inner = lambda g, s, p: step(g, s, jax.tree.map(lambda x: x * 1.0, p))
  assert _donation_warnings(jax.jit(inner, donate_argnums=1), grads, tx.init(params), params) == []
  (eager,) = _donation_warnings(step, grads, tx.init(params), copy())
  assert "runs outside jax.jit" in eager


def test_the_donation_check_changes_nothing_jit_sees():
  """Unread state leaves stay out of the executable (a schedule's count beside Adam's, which the
  in-place step replaces), so passing a state whose leaves share a buffer works as before, and
  the steps are optax's."""
  params = {"w": jax.random.normal(jax.random.key(1), (3, 40)),
            "b": jax.random.uniform(jax.random.key(2), (7,), minval=-1.0)}
  tx, reference = (optax.chain(m.clip_by_global_norm(1.0),
                               m.adamw(optax.linear_schedule(1e-2, 0.0, 10)))
                   for m in (jaxfuse, optax))
  updates, state = tx.update(params, tx.init(params), params)  # the protocol: one count for both
  ours, state = lockstep(tx, reference, optax.apply_updates(params, updates), 2, path="fused",
                         state=state)
  vmapped = jax.vmap(lambda g, s, p: jaxfuse.fused_step(tx, g, s, p), in_axes=(0, None, None))
  batch = jax.tree.map(lambda p: jnp.stack([p, -p]), ours)
  assert vmapped(batch, state, ours)[0]["w"].shape == (2, 3, 40)
