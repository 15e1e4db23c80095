"""Helpers for the tests of the optimizer families built on the generic driver (Lion, RMSprop):
a lockstep comparison with the optax twin, and a run under optax.inject_hyperparams.

Lockstep: at every step optax gets jaxfuse's current params and state (16-bit leaves upcast to
float32, the type jaxfuse computes in) and its result, rounded once to the storage dtypes, is
compared with jaxfuse's. Errors then do not compound over the steps, every step is checked, and
jaxfuse's state is shown to be a valid optax state (checkpoints move)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxfuse
from helpers import assert_trees_close, ulp
# One copy of these for every family's tests (optimizer_cases.py); the names the Lion and
# RMSprop tests use.
from optimizer_cases import grads as grads_like, jit_step as fused_step_fn  # noqa: F401


def upcast(tree):
  """16-bit float leaves as float32 (what the kernels compute in); other leaves unchanged."""
  return jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating)
                      and jnp.finfo(x.dtype).bits < 32 else x, tree)


def like(tree, reference):
  """`tree` cast leaf by leaf to the dtypes of `reference`."""
  return jax.tree.map(lambda x, r: jnp.asarray(x).astype(r.dtype), tree, reference)


def rtol_for(*dtypes):
  """A step's tolerance: one rounding to the coarsest 16-bit storage dtype, else a few ulps of
  the compute type (the kernels and XLA may contract multiply-adds differently)."""
  coarse = [ulp(d) for d in dtypes if jnp.finfo(d).bits < 32]
  if coarse:
    return max(coarse)
  return 8 * max(ulp(d) for d in dtypes)


def _masked(actual, expected, masks):
  """`actual` (as NumPy float64) with the elements where `masks` is True taken from `expected`."""
  if masks is None:
    return actual
  exact = lambda x: np.asarray(x).astype(np.float64)
  return jax.tree.map(lambda a, e, m: np.where(m, exact(e), exact(a)), actual, expected, masks)


def lockstep(ours, ref, params, steps, *, path, seed=0, rtol, near_zero=None, grad_scale=None,
             state=None):
  """Runs `ours` (a jaxfuse transform) for `steps` steps through `path` ("optax": tx.update then
  optax.apply_updates; "fused": jaxfuse.fused_step, donated) and checks each step against
  `ref` (the optax twin) in lockstep. `near_zero(g, state)` -> per-leaf bool masks (NumPy) of
  elements whose result may legitimately differ (excluded). `state`: the state to start from
  (default ours.init). Returns the final (params, state).

  Params, gradients and states are O(1) here, so an element that is the small difference of
  such terms (mu = (1 - b) g + b mu) may carry their rounding error: absolute error rtol, and
  rtol times the largest update for updates."""

  @jax.jit
  def reference(g, s, p):
    g = g if grad_scale is None else jax.tree.map(lambda x: x / grad_scale, g)
    u, s_new = ref.update(upcast(g), upcast(s), upcast(p))
    return g, u, like(optax.apply_updates(upcast(p), u), p), like(s_new, s)

  @jax.jit
  def protocol(g, s, p):
    u, s_new = ours.update(g, s, p, grad_scale=grad_scale)
    return u, optax.apply_updates(p, u), s_new

  step = fused_step_fn(ours, grad_scale=grad_scale)
  p = jax.jit(lambda t: jax.tree.map(jnp.copy, t))(params)  # the fused step donates it
  s = jax.jit(ours.init)(params) if state is None else state
  for t in range(steps):
    g = grads_like(seed * 1000 + t, params)
    g_seen, u_r, p_r, s_r = reference(g, s, p)
    masks = None if near_zero is None else near_zero(g_seen, s)
    if path == "optax":
      u, p, s = protocol(g, s, p)
      u_max = max((float(np.max(np.abs(np.asarray(x, np.float64)))) for x in
                   jax.tree.leaves(u_r) if x.size), default=0.0)
      assert_trees_close(_masked(u, u_r, masks), u_r, rtol=rtol, atol=rtol * u_max,
                         what=f"step {t} updates")
    else:
      p, s = step(p, s, g)
    assert_trees_close(_masked(p, p_r, masks), p_r, rtol=rtol, atol=rtol, what=f"step {t} params")
    assert_trees_close(s, s_r, rtol=rtol, atol=rtol, what=f"step {t} state")
  return p, s


def inject_hyperparams_run(ours, ref, kwargs, changed, params):
  """Six in-place steps of ``optax.inject_hyperparams(ours)(**kwargs)`` beside six optax steps
  of ``inject_hyperparams(ref)``, the hyperparameters in `changed` set in both states after the
  third (without recompiling). Returns (our params, optax's params, times the step was traced)."""
  tf = optax.inject_hyperparams(ours)(**kwargs)
  to = optax.inject_hyperparams(ref)(**kwargs)
  traces = []
  step = jax.jit(lambda p, s, g: (traces.append(1), jaxfuse.fused_step(tf, g, s, p))[1])
  upd_o = jax.jit(to.update)
  pf, sf, po, so = params, tf.init(params), params, to.init(params)
  for t in range(6):
    if t == 3:  # new hyperparameters mid-run, without recompiling
      for s in (sf, so):
        for name, value in changed.items():
          s.hyperparams[name] = jnp.asarray(value, jnp.float32)
    g = grads_like(15 + t, params)
    pf, sf = step(pf, sf, g)
    u, so = upd_o(g, so, po)
    po = optax.apply_updates(po, u)
  return pf, po, len(traces)
