"""Shared by the tests of the element-wise optimizer families (test_sgd.py, test_adagrad.py): a
jaxfuse transform against its optax twin on fresh random trees, through the optax protocol or
the fused in-place step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxfuse
from helpers import assert_trees_close, ulp

SHAPES = [(), (0,), (1,), (3,), (257,), (3, 7, 5)]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64]
STEPS = 20
PATHS = ["optax", "fused"]


def grads(seed, params, scale=1.0):
  """Random normal gradients shaped, typed and placed like `params`."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda p: jax.device_put(jnp.asarray(scale * rng.standard_normal(p.shape), p.dtype),
                               p.devices().pop()), params)


def reference_dtype(dtype):
  """optax runs on float32 copies of 16-bit leaves: jaxfuse computes those in float32 and rounds
  once, optax rounds every operation to 16 bits, so optax in 16 bits is the less exact side."""
  return jnp.float32 if jnp.finfo(dtype).bits == 16 else dtype


def step_rtol(dtype):
  """The error allowed per step, relative to a leaf's largest element: a few roundings of the
  compute type (XLA and the kernels may differ by an ulp, e.g. rsqrt), or for 16-bit leaves the
  rounding of the stored params and state once per step."""
  return ulp(dtype) if jnp.finfo(dtype).bits == 16 else 8 * ulp(dtype)


def jit_step(tx, **kwargs):
  """A jitted fused step donating params and state (in the order of the outputs)."""
  return jax.jit(lambda p, s, g: jaxfuse.fused_step(tx, g, s, p, **kwargs),
                 donate_argnums=(0, 1))


def jit_optax_step(tx):
  """A jitted optax-protocol step: tx.update then optax.apply_updates."""
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s
  return jax.jit(step)


def on_cpu_copy(tree, dtype=None):
  """A fresh copy of `tree` on the CPU (optax's reference runs there: XLA's GPU code may keep
  16-bit intermediates in float32), optionally cast."""
  cpu = jax.devices("cpu")[0]
  return jax.tree.map(lambda x: jax.device_put(jnp.array(x, dtype=dtype, copy=True), cpu), tree)


def run_both(tf, to, params, path, steps=STEPS, seed=1):
  """`steps` steps of the jaxfuse transform (through `path`) and of optax (on reference-dtype
  copies) on the same gradients: (jaxfuse params, state, optax params, state)."""
  dtype = jax.tree.leaves(params)[0].dtype
  ref = on_cpu_copy(params, reference_dtype(dtype))
  sf, so = tf.init(params), to.init(ref)
  step_f = jit_step(tf) if path == "fused" else jit_optax_step(tf)
  step_o = jit_optax_step(to)
  # The fused step donates its params: a copy, so that the caller's stay valid.
  pf, po = jax.tree.map(lambda x: jnp.array(x, copy=True), params), ref
  for t in range(steps):
    g = grads(seed * 1000 + t, params)
    pf, sf = step_f(pf, sf, g)
    po, so = step_o(po, so, on_cpu_copy(g, reference_dtype(dtype)))
  return pf, sf, po, so


def assert_matches_optax(tf, to, params, path, extra_rtol=0.0, steps=STEPS):
  """After `steps` steps params and state are optax's within the dtype's precision (plus
  `extra_rtol` per step), and the state has optax's structure."""
  dtype = jax.tree.leaves(params)[0].dtype
  pf, sf, po, so = run_both(tf, to, params, path, steps)
  assert jax.tree.structure(sf) == jax.tree.structure(so)
  rtol = steps * (step_rtol(dtype) + extra_rtol)
  assert_trees_close(pf, po, rtol=rtol, atol=0, what="params")
  assert_trees_close(sf, so, rtol=rtol, atol=0, what="state")
  for a, b in zip(jax.tree.leaves((pf, sf)), jax.tree.leaves((params, tf.init(params)))):
    assert a.dtype == b.dtype
