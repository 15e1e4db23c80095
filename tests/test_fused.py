"""jaxfuse.fused_step over optax's compositions (chains, named and nested; gradient accumulation
with a clip, the mean or the sum, a schedule of k), what it refuses and why, and what an optax
user tries next: jax.export, differentiating through update, the donation order."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxfuse
from helpers import (assert_trees_close, count_custom_calls, init_beside, normal_grads,
                     random_tree, zero_size_float_operands)
from lockstep import jit_fused, jit_step, lockstep

SHAPES = [(), (0,), (7,), (33, 5), (4, 3, 2)]


def _multi_steps_twin(inner, k, **kwargs):
  """optax.MultiSteps of `inner`, its accumulator as wide as lockstep's reference."""
  with jax.enable_x64(True):
    return optax.MultiSteps(inner, k, accumulator_dtype=jnp.float64,
                            **kwargs).gradient_transformation()


def test_named_and_nested_chains_with_transforms_before_the_adam(device):
  def make(mod):
    pre = optax.chain(optax.scale(0.5), mod.clip_by_global_norm(0.2))
    return optax.named_chain(("pre", pre), ("opt", optax.chain(mod.adamw(1e-2))))
  lockstep(make(jaxfuse), make(optax), random_tree(1, SHAPES, device=device), 8, path="fused")


def test_zero_size_leaves_reach_no_kernel(device):
  """A zero-size leaf has nothing to update: no kernel gets one as an operand (nor, sharded, the
  shard_map around it, which jaxlib 0.11.2's compiler segfaults on), and the step is optax's."""
  params = random_tree(1, [(0,), (33, 5), (4, 0, 2)], device=device)
  tx = optax.chain(jaxfuse.clip_by_global_norm(0.5), jaxfuse.adamw(1e-2))
  for target, path in (("jaxfuse_adam", "fused"), ("jaxfuse_global_norm", "optax")):
    lowered = jit_step(path, tx).lower(params, tx.init(params), normal_grads(0, params))
    assert count_custom_calls(lowered.as_text(), target) == 1, target
    assert zero_size_float_operands(lowered) == [], target
  twin = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2))
  lockstep(tx, twin, params, 8, path="fused")


@pytest.mark.parametrize("use_grad_mean", [True, False])
def test_multi_steps_matches_optax_multisteps(use_grad_mean, device):
  make = lambda mod: optax.chain(mod.clip_by_global_norm(0.3), mod.adamw(1e-2))
  jf = jaxfuse.multi_steps(make(jaxfuse), 3, use_grad_mean=use_grad_mean)
  ref = _multi_steps_twin(make(optax), 3, use_grad_mean=use_grad_mean)
  lockstep(jf, ref, random_tree(1, SHAPES, device=device), 8, path="fused")
  # the optax protocol of jaxfuse.multi_steps is optax.MultiSteps's
  lockstep(jf, ref, random_tree(1, SHAPES, device=device), 4, path="optax")


def test_multi_steps_with_a_schedule_of_k(device):
  every_k = lambda step: jnp.where(step < 2, 2, 3)
  jf = jaxfuse.multi_steps(jaxfuse.adam(1e-2), every_k)
  ref = _multi_steps_twin(optax.adam(1e-2), every_k)
  lockstep(jf, ref, random_tree(1, SHAPES, device=device), 10, path="fused")


def test_multi_steps_keeps_state_in_place(device):
  params = random_tree(2, [(256, 64), (64,)], device=device)
  tx = jaxfuse.multi_steps(jaxfuse.adamw(1e-2), 4)
  r = jaxfuse.report(jit_fused(tx), params, tx.init(params), normal_grads(0, params))
  copies = sum(row.bytes_written for row in r.rows if row.name == "copy")
  param_bytes = sum(x.size for x in jax.tree.leaves(params)) * 4
  # XLA's conditional copies the params it passes through (once per call); moments and the
  # accumulator are never copied
  assert copies <= param_bytes + 64, r


@pytest.mark.parametrize("tx, match", [
    (lambda: optax.apply_if_finite(jaxfuse.adamw(1e-2), 3), "skip_nonfinite=True"),
    (lambda: optax.MultiSteps(jaxfuse.adamw(1e-2), 3).gradient_transformation(),
     "jaxfuse.multi_steps"),
    (lambda: optax.chain(jaxfuse.adamw(1e-2), optax.scale(2.0)), "after jaxfuse.adamw"),
    (lambda: optax.chain(jaxfuse.adamw(1e-2), jaxfuse.clip_by_global_norm(1.0)),
     "directly before"),
    (lambda: optax.chain(jaxfuse.clip_by_global_norm(1.0), optax.scale(2.0),
                         jaxfuse.adamw(1e-2)), "directly before"),
    (lambda: optax.masked(jaxfuse.adamw(1e-2), {f"leaf{i:04d}": i != 1 for i in range(5)}),
     "optax.masked"),
    (lambda: optax.adamw(1e-2), "no jaxfuse optimizer ran"),
    (lambda: optax.chain(jaxfuse.adamw(1e-2), jaxfuse.adamw(1e-2)), "one jaxfuse optimizer per step"),
])
def test_refused_compositions_say_what_to_use(tx, match):
  tx = tx()
  params = random_tree(1, SHAPES)
  with pytest.raises((TypeError, ValueError), match=match):
    jit_step("fused", tx)(params, tx.init(params), normal_grads(0, params))


def test_export_with_the_safety_checks_disabled(device):
  params = random_tree(3, [(5, 3), (3,)], device=device)
  tx = optax.chain(jaxfuse.clip_by_global_norm(0.5), jaxfuse.adamw(1e-2))
  state = init_beside(tx, params)
  leaves, treedef = jax.tree.flatten((params, state))

  @jax.jit
  def step(g, *flat):  # flat arrays in and out: exported artifacts keep no optax types
    p, s = jax.tree.unflatten(treedef, flat)
    return jax.tree.leaves(jaxfuse.fused_step(tx, g, s, p))

  g = normal_grads(4, params)
  platforms = ["cuda" if device.platform == "gpu" else device.platform]
  with pytest.raises(ValueError, match="custom calls"):
    jax.export.export(step, platforms=platforms)(g, *leaves)
  exported = jax.export.export(step, platforms=platforms,
                               disabled_checks=jaxfuse.export_safety_checks())(g, *leaves)
  expected = step(g, *leaves)
  assert_trees_close(exported.call(g, *leaves), expected, rtol=0, atol=0)
  pytest.importorskip("flatbuffers")  # jax's serialization needs it
  restored = jax.export.deserialize(exported.serialize())
  assert_trees_close(restored.call(g, *leaves), expected, rtol=0, atol=0)


def test_differentiating_through_the_optax_protocol_matches_optax(device):
  params = random_tree(5, [(6, 4), (4,)], device=device)
  g = normal_grads(6, params)

  def loss_after_step(lr, m):  # meta-learning a learning rate (m: jaxfuse or optax)
    tx = m.adamw(lr, weight_decay=0.1)
    u, _ = tx.update(g, tx.init(params), params)
    return sum(jnp.sum(jnp.sin(x)) for x in jax.tree.leaves(optax.apply_updates(params, u)))

  d = lambda m: jax.grad(loss_after_step)(1e-2, m)
  np.testing.assert_allclose(d(jaxfuse), d(optax), rtol=1e-5)


def test_differentiating_through_the_kernels_is_a_clear_error():
  # jax names the custom call; the README says which paths are differentiable
  params = random_tree(5, [(6, 4)])
  g, tx = normal_grads(6, params), jaxfuse.adamw(1e-2)
  with pytest.raises(ValueError, match="jaxfuse_adam` cannot be differentiated"):
    jax.grad(lambda p: jnp.sum(jaxfuse.fused_step(tx, g, tx.init(p), p)[0]["leaf0000"]))(params)
  with pytest.raises(ValueError, match="jaxfuse_global_norm` cannot be differentiated"):
    jax.grad(lambda x: jaxfuse.global_norm(x))(params)


def test_donation_order_trap_shows_as_copies_in_the_report(device):
  params = random_tree(7, [(128, 64), (64,)], device=device)
  tx = jaxfuse.adamw(1e-2)
  args = (params, tx.init(params), normal_grads(8, params))
  copied = lambda fn: sum(row.bytes_written for row in jaxfuse.report(fn, *args).rows
                          if row.name == "copy")
  right = jit_fused(tx)
  # donates (params, state) but returns (state, params): jax pairs donations by order
  wrong = jax.jit(lambda p, s, g: jaxfuse.fused_step(tx, g, s, p)[::-1], donate_argnums=(0, 1))
  n = sum(x.size for x in jax.tree.leaves(params)) * 4
  assert copied(right) < 64
  assert copied(wrong) >= n
