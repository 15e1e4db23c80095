"""Fused multi-tensor Adam / AdamW, optax-compatible.

``jaxfuse.adam`` and ``jaxfuse.adamw`` take the arguments of ``optax.adam`` / ``optax.adamw`` and
compute the same update, for every leaf of the pytree in one XLA FFI call (one kernel launch on
the GPU for up to several hundred leaves). Per element, with ``t`` the step count after
incrementing (Kingma & Ba, 2015, https://arxiv.org/abs/1412.6980; Loshchilov & Hutter, 2019,
https://arxiv.org/abs/1711.05101)::

    mu = (1 - b1) * g + b1 * mu
    nu = (1 - b2) * g**2 + b2 * nu
    mu_hat = mu / (1 - b1**t)                       # nesterov: b1 * mu / (1 - b1**(t+1))
                                                    #           + (1 - b1) * g / (1 - b1**t)
    nu_hat = nu / (1 - b2**t)
    u = -lr * (mu_hat / (sqrt(nu_hat + eps_root) + eps) + weight_decay * p)   # wd: AdamW only

The state has the structure, shapes and dtypes of optax's own state for the same arguments, so
checkpoints move between ``optax.adamw`` and ``jaxfuse.adamw``. The learning rate (a float or an
optax schedule evaluated on the count), every other hyperparameter and the count reach the
kernel as device scalars: no recompiles, no host round trips, and the transforms work under
``optax.inject_hyperparams``, ``optax.MultiSteps``, ``optax.apply_if_finite`` and ``lax.cond``.

Opt-in extensions (they append an :class:`AdamExtraState` to the state):

* ``master_weights=True``: low-precision (bf16/fp16) params keep an fp32 master copy in the
  state; moments are fp32 (or ``mu_dtype``). The math runs on the master copy; params are its
  rounding.
* ``skip_nonfinite=True``: a step whose gradients hold a NaN or Inf leaves params, moments and
  the count untouched and adds one to ``skipped_steps`` (like ``optax.apply_if_finite``, decided
  on device inside the same kernels).

Two ways to apply it:

* the optax protocol, ``updates, state = tx.update(grads, state, params)`` then
  ``optax.apply_updates``: one kernel plus XLA's add, 36-40 bytes per fp32 parameter;
* :func:`jaxfuse.fused_step`, which updates params and moments in place (28 bytes per fp32
  parameter, the minimum) under ``jax.jit(..., donate_argnums=...)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxfuse import _ffi
from jaxfuse import _trees

ScalarOrSchedule = Union[float, jax.Array, Callable[[jax.Array], jax.Array]]

# Leaves per jaxfuse_adam call. XLA's fusion pass takes time quadratic in the number of
# input/output aliases of one custom call (measured on CPU, jaxlib 0.10.2: 1500 aliases, 5 s;
# 3000, 56 s), and the fused step aliases three buffers per leaf. Calls of 256 leaves keep
# compilation near-linear; on the GPU a call of 256 leaves is one launch.
MAX_LEAVES_PER_CALL = 256


class AdamExtraState(NamedTuple):
  """jaxfuse's additions to the optax state, appended only when an opt-in feature is on.

  Attributes:
    master_params: fp32 copy of the params (``master_weights=True``), else None.
    skipped_steps: int32 count of steps skipped for non-finite gradients
      (``skip_nonfinite=True``), else None.
  """

  master_params: Any = None
  skipped_steps: Any = None


@dataclasses.dataclass(frozen=True, eq=False)
class AdamSpec:
  """Everything a jaxfuse Adam transform was built with (read by :func:`jaxfuse.fused_step`)."""

  learning_rate: ScalarOrSchedule
  b1: Any
  b2: Any
  eps: Any
  eps_root: Any
  mu_dtype: Any
  weight_decay: Optional[ScalarOrSchedule]  # None: Adam (no decoupled weight decay)
  mask: Any
  nesterov: bool
  master_weights: bool
  skip_nonfinite: bool

  @property
  def has_extra_state(self) -> bool:
    return self.master_weights or self.skip_nonfinite

  def optax_twin(self) -> optax.GradientTransformation:
    """The optax transform this one reproduces (its state layout is ours, less extensions)."""
    if self.weight_decay is None:
      return optax.adam(self.learning_rate, self.b1, self.b2, self.eps, self.eps_root,
                        self.mu_dtype, nesterov=self.nesterov)
    return optax.adamw(self.learning_rate, self.b1, self.b2, self.eps, self.eps_root,
                       self.mu_dtype, self.weight_decay, self.mask, nesterov=self.nesterov)

  def init(self, params: Any) -> Any:
    _trees.check_float_leaves(params, "params")
    state = self.optax_twin().init(params)
    if not self.has_extra_state:
      return state
    master = skipped = None
    adam_state = state[0]
    if self.master_weights:
      # A copy even for fp32 leaves: the master must not be the params' buffer (both are donated).
      master = jax.tree.map(lambda p: jnp.array(p, dtype=jnp.float32, copy=True), params)
      mu_dtype = self.mu_dtype if self.mu_dtype is not None else jnp.float32
      adam_state = adam_state._replace(
          mu=jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), mu_dtype), params),
          nu=jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params))
    if self.skip_nonfinite:
      skipped = jnp.zeros([], jnp.int32)
    return (adam_state, *state[1:], AdamExtraState(master, skipped))


def adam(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
         eps_root: float = 0.0, mu_dtype: Optional[Any] = None, *, nesterov: bool = False,
         master_weights: bool = False,
         skip_nonfinite: bool = False) -> optax.GradientTransformationExtraArgs:
  """Adam (Kingma & Ba, 2015) as one fused kernel; same arguments and math as ``optax.adam``.

  Args:
    learning_rate: a float, or an optax schedule evaluated on the step count.
    b1, b2: decay rates of the first and second moment estimates.
    eps, eps_root: added to the denominator outside / inside the square root.
    mu_dtype: storage dtype of the first moment (None: the params' dtype, as optax).
    nesterov: use Nesterov momentum (NAdam, Dozat 2016), as optax does.
    master_weights: keep an fp32 master copy of low-precision params in the state.
    skip_nonfinite: skip (and count) steps whose gradients are not all finite.

  Returns:
    An optax ``GradientTransformationExtraArgs``.
  """
  return _transform(AdamSpec(learning_rate, b1, b2, eps, eps_root, mu_dtype, None, None,
                             nesterov, master_weights, skip_nonfinite))


def adamw(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          eps_root: float = 0.0, mu_dtype: Optional[Any] = None,
          weight_decay: ScalarOrSchedule = 1e-4, mask: Any = None, *, nesterov: bool = False,
          master_weights: bool = False,
          skip_nonfinite: bool = False) -> optax.GradientTransformationExtraArgs:
  """AdamW (Loshchilov & Hutter, 2019) as one fused kernel; same arguments and math as
  ``optax.adamw``.

  Args:
    learning_rate: a float, or an optax schedule evaluated on the step count.
    b1, b2: decay rates of the first and second moment estimates.
    eps, eps_root: added to the denominator outside / inside the square root.
    mu_dtype: storage dtype of the first moment (None: the params' dtype, as optax).
    weight_decay: decoupled weight decay rate (a float or a schedule).
    mask: pytree of bools (a prefix of params) or a callable returning one: True where weight
      decay applies. Must be static.
    nesterov: use Nesterov momentum (NAdamW), as optax does.
    master_weights: keep an fp32 master copy of low-precision params in the state.
    skip_nonfinite: skip (and count) steps whose gradients are not all finite.

  Returns:
    An optax ``GradientTransformationExtraArgs``.
  """
  return _transform(AdamSpec(learning_rate, b1, b2, eps, eps_root, mu_dtype, weight_decay, mask,
                             nesterov, master_weights, skip_nonfinite))


def _transform(spec: AdamSpec) -> optax.GradientTransformationExtraArgs:
  def init_fn(params):
    return spec.init(params)

  def update_fn(updates, state, params=None, *, grad_scale=None, **extra_args):
    del extra_args
    if params is None:
      raise ValueError("jaxfuse.adam/adamw: update() needs params (as optax.adamw does)")
    return apply_adam(spec, updates, state, params, write_updates=True,
                      grad_ctrl=grad_ctrl_for(spec, updates, grad_scale)[1])

  # fused_step finds the spec here, also inside optax.chain (which keeps ExtraArgs transforms).
  update_fn.jaxfuse_spec = spec
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _check_state(spec: AdamSpec, state: Any, params: Any) -> None:
  expected = jax.eval_shape(spec.init, params)
  exp_def, got_def = jax.tree.structure(expected), jax.tree.structure(state)
  if exp_def != got_def:
    raise ValueError(
        "jaxfuse: opt_state does not match the state of this jaxfuse Adam transform for these "
        "params (a state from another optimizer, or from init() on other params?)\n"
        f"  expected: {exp_def}\n  got:      {got_def}")
  for name, e, g in zip(_trees.leaf_names(expected), jax.tree.leaves(expected),
                        jax.tree.leaves(state)):
    if jnp.shape(g) != e.shape or jnp.dtype(getattr(g, "dtype", type(g))) != e.dtype:
      raise ValueError(
          f"jaxfuse: opt_state leaf {name} has {jnp.dtype(getattr(g, 'dtype', type(g))).name}"
          f"{list(jnp.shape(g))}, expected {e.dtype.name}{list(e.shape)}")


def _scalar(value: Any, count: jax.Array) -> jax.Array:
  return jnp.asarray(value(count) if callable(value) else value, jnp.float32)


def _one_minus(b: Any) -> Any:
  # optax writes (1 - b1) * g: with a Python float the difference is taken in float64 and then
  # rounded, with an array in float32. Do the same so the rounding matches.
  return 1.0 - b if isinstance(b, (int, float)) else 1.0 - jnp.asarray(b, jnp.float32)


def hyper_vector(spec: AdamSpec, count: jax.Array) -> jax.Array:
  """The f32[8] hyperparameter vector the kernels read (layout: enum AdamHyper in math.h)."""
  wd = 0.0 if spec.weight_decay is None else spec.weight_decay
  values = [spec.learning_rate, spec.b1, _one_minus(spec.b1), spec.b2, _one_minus(spec.b2),
            spec.eps, spec.eps_root, wd]
  return jnp.stack([_scalar(v, count) for v in values])


def default_grad_ctrl(grad_scale: Any = None) -> jax.Array:
  """Gradient control (GradCtrl in math.h): a loss scale (default 1), no clipping, no skip."""
  if grad_scale is None:
    return jnp.array([1.0, 1.0, 1.0, 0.0], jnp.float32)
  one = jnp.ones((), jnp.float32)
  return jnp.stack([jnp.asarray(grad_scale, jnp.float32), one, one, 0 * one])


def grad_ctrl_for(spec: AdamSpec, grads: Any, grad_scale: Any = None, *,
                  clip_max_norm: Any = None, need_norm: bool = False):
  """(global norm or None, gradient-control vector) for one Adam step. The global-norm op runs
  only when something needs it (clipping, the non-finite check, or the norm itself); a bare loss
  scale goes into the vector directly."""
  if clip_max_norm is not None or spec.skip_nonfinite or need_norm:
    from jaxfuse.clip import norm_and_ctrl  # the finite check is the global-norm op's

    return norm_and_ctrl(grads, max_norm=clip_max_norm, grad_scale=grad_scale,
                         skip_nonfinite=spec.skip_nonfinite)
  return None, default_grad_ctrl(grad_scale)


def _advance_counts(state: Any, new_count: jax.Array) -> Any:
  """Every optax `count` field in the state (Adam's, the schedules') moves together."""

  def replace(path, leaf):
    last = path[-1] if path else None
    if isinstance(last, jax.tree_util.GetAttrKey) and last.name == "count":
      return new_count
    return leaf

  return jax.tree_util.tree_map_with_path(replace, state)


def _adam_ffi(count, hyper, ctrl, g, p, m, v, master, *, decay, nesterov, write_updates,
              update_dtypes):
  """One jaxfuse_adam FFI call. Returns
  (new_count, updates or new params, new mu, new nu, new master or None)."""
  n = len(g)
  operands = [count, hyper, ctrl, *g, *p, *m, *v, *(master or [])]
  sds = lambda x, dt=None: jax.ShapeDtypeStruct(jnp.shape(x), dt or x.dtype)
  results = [jax.ShapeDtypeStruct((), jnp.int32)]
  if write_updates:
    results += [sds(x, dt) for x, dt in zip(g, update_dtypes)]
  results += [sds(x) for x in m] + [sds(x) for x in v]
  if not write_updates:
    results += [sds(x) for x in p]
  if master:
    results += [sds(x) for x in master]
  # In-place: mu, nu, (fused) params and master params alias their inputs.
  first_out = 1 + (n if write_updates else 0)
  aliases = {3 + 2 * n + i: first_out + i for i in range(n)}            # mu
  aliases.update({3 + 3 * n + i: first_out + n + i for i in range(n)})  # nu
  next_out = first_out + 2 * n
  if not write_updates:
    aliases.update({3 + n + i: next_out + i for i in range(n)})         # params
    next_out += n
  if master:
    aliases.update({3 + 4 * n + i: next_out + i for i in range(n)})     # master params
  call = jax.ffi.ffi_call(_ffi.target("jaxfuse_adam"), results, input_output_aliases=aliases,
                          vmap_method="sequential")
  out = call(*operands, num_tensors=np.int64(n), nesterov=bool(nesterov),
             write_updates=bool(write_updates), master=bool(master),
             decay_mask=np.asarray(decay, np.uint8))
  new_count, rest = out[0], list(out[1:])
  first = rest[:n]
  if write_updates:
    rest = rest[n:]
  new_m, new_v = rest[:n], rest[n:2 * n]
  rest = rest[2 * n:]
  if not write_updates:
    first, rest = rest[:n], rest[n:]
  new_master = rest[:n] if master else None
  return new_count, first, new_m, new_v, new_master


def apply_adam(spec: AdamSpec, grads: Any, state: Any, params: Any, *, write_updates: bool,
               grad_ctrl: Optional[jax.Array] = None) -> tuple[Any, Any]:
  """Runs the fused kernel. Returns (updates, new_state) when `write_updates`, else
  (new_params, new_state) with params, moments and master params updated in place.

  `grad_ctrl` is the f32[4] gradient-control vector (loss scale, clip divisor and multiplier,
  skip flag) that the global-norm kernel produces; None means plain Adam. With
  `skip_nonfinite`, the caller must pass the vector of a norm call made with it."""
  _trees.check_float_leaves(params, "params")
  _trees.check_same_structure(params, grads, "params", "grads")
  _trees.check_float_leaves(grads, "grads")
  _check_state(spec, state, params)

  adam_state = state[0]
  extra = state[-1] if spec.has_extra_state else None
  count = adam_state.count
  if grad_ctrl is None:
    if spec.skip_nonfinite:
      raise ValueError("jaxfuse: skip_nonfinite needs the control vector of a norm call")
    grad_ctrl = default_grad_ctrl()
  hyper = hyper_vector(spec, count)

  treedef = jax.tree.structure(params)
  p_leaves = jax.tree.leaves(params)
  g_leaves = jax.tree.leaves(grads)
  m_leaves = treedef.flatten_up_to(adam_state.mu)
  v_leaves = treedef.flatten_up_to(adam_state.nu)
  master_leaves = treedef.flatten_up_to(extra.master_params) if spec.master_weights else None
  if spec.weight_decay is None:
    decay = [False] * len(p_leaves)
  elif spec.mask is None:
    decay = [True] * len(p_leaves)
  else:
    decay = _trees.static_bool_mask(spec.mask, params)

  def update_dtype(i):
    # optax builds the update from the grads and the moments (before casting them back).
    if spec.master_weights:
      return jnp.dtype(jnp.float32)
    return jnp.result_type(g_leaves[i].dtype, m_leaves[i].dtype, v_leaves[i].dtype)

  n = len(p_leaves)
  first_out: list[Any] = [None] * n
  new_m: list[Any] = list(m_leaves)
  new_v: list[Any] = list(v_leaves)
  new_master = list(master_leaves) if master_leaves is not None else None
  new_count = None
  # One FFI call per MAX_LEAVES_PER_CALL non-empty leaves, whatever their dtypes.
  live = [i for i in range(n) if np.size(p_leaves[i]) > 0]
  for i in range(n):
    if np.size(p_leaves[i]) == 0:
      first_out[i] = (jnp.zeros(jnp.shape(p_leaves[i]), update_dtype(i)) if write_updates
                      else p_leaves[i])
  for start in range(0, len(live), MAX_LEAVES_PER_CALL):
    idx = live[start:start + MAX_LEAVES_PER_CALL]
    c, first, gm, gv, gmaster = _adam_ffi(
        count, hyper, grad_ctrl, [g_leaves[i] for i in idx], [p_leaves[i] for i in idx],
        [m_leaves[i] for i in idx], [v_leaves[i] for i in idx],
        [master_leaves[i] for i in idx] if master_leaves is not None else None,
        decay=[decay[i] for i in idx], nesterov=spec.nesterov, write_updates=write_updates,
        update_dtypes=[update_dtype(i) for i in idx])
    new_count = c if new_count is None else new_count
    for k, i in enumerate(idx):
      first_out[i], new_m[i], new_v[i] = first[k], gm[k], gv[k]
      if new_master is not None:
        new_master[i] = gmaster[k]
  skip = grad_ctrl[3] != 0
  if new_count is None:  # no element anywhere: the count still advances, as in optax
    new_count = jnp.where(skip, count, optax.safe_increment(count))

  new_adam = adam_state._replace(count=new_count, mu=treedef.unflatten(new_m),
                                 nu=treedef.unflatten(new_v))
  new_state = _advance_counts((new_adam, *state[1:-1 if spec.has_extra_state else None]),
                              new_count)
  if spec.has_extra_state:
    new_extra = AdamExtraState(
        treedef.unflatten(new_master) if new_master is not None else None,
        extra.skipped_steps + skip.astype(jnp.int32) if spec.skip_nonfinite else None)
    new_state = (*new_state, new_extra)
  return treedef.unflatten(first_out), new_state
