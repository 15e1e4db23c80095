"""Fused multi-tensor Adam / AdamW, optax-compatible.

``jaxfuse.adam`` and ``jaxfuse.adamw`` take the arguments of ``optax.adam`` / ``optax.adamw`` and
compute the same update. Per element, with ``t`` the step count after incrementing (Kingma & Ba,
2015, https://arxiv.org/abs/1412.6980; Loshchilov & Hutter, 2019,
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

Leaves may be float32, bfloat16, float16, float64 (math in float64) or complex64/complex128
(optax's complex Adam: ``nu`` from ``|g|**2``), as JAX arrays, NumPy arrays or Python scalars,
mixed freely in one tree. 16-bit leaves are computed in float32 and rounded once (optax
computes in the 16-bit type: jaxfuse's step is the more accurate one).

Opt-in extensions (they append an :class:`AdamExtraState` to the state):

* ``master_weights=True``: low-precision (bf16/fp16) params keep an fp32 master copy in the
  state; moments are fp32 (or ``mu_dtype``). The math runs on the master copy; params are its
  rounding. Updates have the grads' dtype (optax's rule) and step the params exactly onto that
  rounding.
* ``skip_nonfinite=True``: a step whose gradients hold a NaN or Inf leaves params, moments and
  the count untouched and adds one to ``skipped_steps`` (like ``optax.apply_if_finite``, decided
  on device by the global-norm kernel).

Two ways to apply it:

* the optax protocol, ``updates, state = tx.update(grads, state, params)`` then
  ``optax.apply_updates``: the element math (the kernels', adam_math.h, in the same operation
  order) as XLA operations, which XLA fuses with ``apply_updates``'s add into one pass that reads
  and writes each buffer once, as optax's own step does (a kernel there would have to write the
  updates out for XLA to read back);
* :func:`jaxfuse.fused_step` (and the framework helpers in ``jaxfuse.flax``): one multi-tensor
  kernel per call of up to 256 leaves (one FFI call per family of leaves: float32 math, float64,
  complex64, complex128) that updates params and moments in place, 28 bytes per fp32 parameter,
  the minimum, under ``jax.jit(..., donate_argnums=...)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxfuse import _ffi
from jaxfuse import _inplace
from jaxfuse import _partition
from jaxfuse import _trees

ScalarOrSchedule = Union[float, jax.Array, Callable[[jax.Array], jax.Array]]

# Leaves per jaxfuse_adam call. XLA's fusion pass takes time quadratic in the number of
# input/output aliases of one custom call (measured on CPU, jaxlib 0.10.2: 1500 aliases, 5 s;
# 3000, 56 s), and the fused step aliases three buffers per leaf. Calls of 256 leaves keep
# compilation near-linear; on the GPU a call of 256 leaves is one launch.
MAX_LEAVES_PER_CALL = 256

_CONTRACT = _ffi.contract("jaxfuse_adam")


class AdamExtraState(NamedTuple):
  """jaxfuse's additions to the optax state, appended only when an opt-in feature is on.

  Attributes:
    master_params: copy of the params (``master_weights=True``) in float32, or in the params'
      own dtype where that is wider (float64, complex), else None.
    skipped_steps: int32 count of steps skipped for non-finite gradients
      (``skip_nonfinite=True``), else None.
  """

  master_params: Any = None
  skipped_steps: Any = None


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
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

  def __post_init__(self):
    if self.mu_dtype is not None and jnp.dtype(self.mu_dtype) not in _trees.KERNEL_DTYPES:
      raise ValueError(f"jaxfuse: mu_dtype {jnp.dtype(self.mu_dtype).name} is not supported; "
                       f"use None or one of {', '.join(t.name for t in _trees.KERNEL_DTYPES)}")

  @property
  def has_extra_state(self) -> bool:
    return self.master_weights or self.skip_nonfinite

  @property
  def decays(self) -> bool:
    """Whether the update has a weight-decay term: optax's adamw drops it for a Python zero
    (not for a zero array or a schedule reaching zero), so that 0 * inf never reaches it."""
    wd = self.weight_decay
    return wd is not None and not (isinstance(wd, (int, float)) and wd == 0)

  def optax_twin(self) -> optax.GradientTransformation:
    """The optax transform this one reproduces (its state layout is ours, less extensions)."""
    if self.weight_decay is None:
      return optax.adam(self.learning_rate, self.b1, self.b2, self.eps, self.eps_root,
                        self.mu_dtype, nesterov=self.nesterov)
    return optax.adamw(self.learning_rate, self.b1, self.b2, self.eps, self.eps_root,
                       self.mu_dtype, self.weight_decay, self.mask, nesterov=self.nesterov)

  def check_params(self, params: Any) -> list[bool]:
    """Trace-time checks of params against this spec (dtypes, mu_dtype, mask), naming the leaf.
    Returns the per-leaf weight-decay flags (the mask, evaluated once)."""
    _trees.check_float_leaves(params, "params")
    if self.mu_dtype is not None:
      mu_complex = _trees.is_complex(self.mu_dtype)
      for name, p in zip(_trees.leaf_names(params), jax.tree.leaves(params)):
        if _trees.is_complex(p.dtype) != mu_complex:
          raise ValueError(
              f"jaxfuse: mu_dtype {jnp.dtype(self.mu_dtype).name} does not fit params leaf {name} "
              f"({p.dtype.name}): the first moment of real params is real, of complex params "
              "complex")
    n = len(jax.tree.leaves(params))
    if not self.decays:
      return [False] * n
    if self.mask is None:
      return [True] * n
    return _trees.static_bool_mask(self.mask, params)  # raises on a traced or misshapen mask

  def init(self, params: Any) -> Any:
    params = _trees.as_arrays(params)
    self.check_params(params)
    state = self.optax_twin().init(params)
    if not self.has_extra_state:
      return state
    master = skipped = None
    adam_state = state[0]
    if self.master_weights:
      # A copy even where the dtype stays: the master must not be the params' buffer (both are
      # donated). Moments in the master's dtype, as if the params were the master.
      wide = lambda p: jnp.promote_types(p.dtype, jnp.float32)
      master = jax.tree.map(lambda p: jnp.array(p, dtype=wide(p), copy=True), params)
      adam_state = adam_state._replace(
          mu=jax.tree.map(lambda p: jnp.zeros(
              p.shape, wide(p) if self.mu_dtype is None else self.mu_dtype), params),
          nu=jax.tree.map(lambda p: jnp.zeros(p.shape, wide(p)), params))
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
  return _transform(AdamSpec(learning_rate=learning_rate, b1=b1, b2=b2, eps=eps,
                             eps_root=eps_root, mu_dtype=mu_dtype, weight_decay=None, mask=None,
                             nesterov=nesterov, master_weights=master_weights,
                             skip_nonfinite=skip_nonfinite))


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
  return _transform(AdamSpec(learning_rate=learning_rate, b1=b1, b2=b2, eps=eps,
                             eps_root=eps_root, mu_dtype=mu_dtype, weight_decay=weight_decay,
                             mask=mask, nesterov=nesterov, master_weights=master_weights,
                             skip_nonfinite=skip_nonfinite))


def nadam(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
          eps: float = 1e-8, eps_root: float = 0.0, mu_dtype: Optional[Any] = None, *,
          master_weights: bool = False,
          skip_nonfinite: bool = False) -> optax.GradientTransformationExtraArgs:
  """NAdam (Dozat, 2016, https://openreview.net/forum?id=OM0jvwB8jIp57ZJjtNEZ): ``adam`` with
  ``nesterov=True``, as ``optax.nadam``."""
  return adam(learning_rate, b1, b2, eps, eps_root, mu_dtype, nesterov=True,
              master_weights=master_weights, skip_nonfinite=skip_nonfinite)


def nadamw(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
           eps: float = 1e-8, eps_root: float = 0.0, mu_dtype: Optional[Any] = None,
           weight_decay: ScalarOrSchedule = 1e-4, mask: Any = None, *,
           master_weights: bool = False,
           skip_nonfinite: bool = False) -> optax.GradientTransformationExtraArgs:
  """NAdamW: ``adamw`` with ``nesterov=True``, as ``optax.nadamw``."""
  return adamw(learning_rate, b1, b2, eps, eps_root, mu_dtype, weight_decay, mask,
               nesterov=True, master_weights=master_weights, skip_nonfinite=skip_nonfinite)


def _transform(spec: AdamSpec) -> optax.GradientTransformationExtraArgs:
  def init_fn(params):
    return spec.init(params)

  def update_fn(updates, state, params=None, *, grad_scale=None, **extra_args):
    del extra_args
    if params is None and spec.weight_decay is not None:
      raise ValueError("jaxfuse.adamw: update() needs params (as optax.adamw's does)")
    if params is None and spec.master_weights:
      raise ValueError("jaxfuse.adam(master_weights=True): update() needs params")
    in_place = _inplace.current()
    if in_place is not None:
      return _update_in_place(spec, in_place, updates, state, params)
    return xla_updates(spec, updates, state, params, grad_scale)

  update_fn.jaxfuse_spec = spec  # for kernel_updates
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _update_in_place(spec: AdamSpec, in_place: _inplace.InPlaceStep, grads: Any, state: Any,
                     params: Any) -> tuple[Any, Any]:
  """The Adam of a fused_step: params and state updated in place (a jaxfuse clip directly
  before it folded in), the new params recorded; the updates returned are placeholders."""
  if params is None:
    raise ValueError("jaxfuse.fused_step: params are required")
  clip = in_place.take_clip(grads)
  norm, grad_ctrl = grad_ctrl_for(spec, grads, in_place.grad_scale,
                                  clip_max_norm=None if clip is None else clip.max_norm,
                                  need_norm=in_place.need_norm,
                                  axis_name=None if clip is None else clip.axis_name)
  new_params, new_state = adam_in_place(spec, grads, state, params, grad_ctrl)
  placeholders = jax.tree.map(jnp.zeros_like, _trees.as_arrays(grads))
  in_place.record_step("the jaxfuse Adam", new_params, norm, placeholders)
  return placeholders, new_state


def _check_state(spec: AdamSpec, state: Any, params: Any) -> None:
  """Raises unless `state` is what spec.init(params) makes (structure, shapes, dtypes)."""
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


def _scalar(value: Any, count: jax.Array) -> Any:
  return value(count) if callable(value) else value


def _one_minus(b: Any) -> Any:
  # optax writes (1 - b1) * g: with a Python float the difference is taken in float64 and then
  # rounded, with an array in the array's dtype. Do the same so the rounding matches.
  return 1.0 - b if isinstance(b, (int, float)) else 1.0 - jnp.asarray(b)


def hyper_values(spec: AdamSpec, count: jax.Array) -> dict[str, Any]:
  """The step's hyperparameters by AdamHyper field name (adam_math.h), schedules evaluated on
  the count: what the kernels read as a vector and the XLA path as scalars."""
  wd = spec.weight_decay if spec.decays else 0.0
  values = dict(learning_rate=spec.learning_rate, b1=spec.b1, one_minus_b1=_one_minus(spec.b1),
                b2=spec.b2, one_minus_b2=_one_minus(spec.b2), eps=spec.eps,
                eps_root=spec.eps_root, weight_decay=wd)
  return {k: _scalar(v, count) for k, v in values.items()}


def hyper_vector(spec: AdamSpec, count: jax.Array) -> jax.Array:
  """The hyperparameter vector the kernels read (its layout is AdamHyper in adam_math.h)."""
  return _ffi.device_vector(_CONTRACT.names["hyper"], **hyper_values(spec, count))


def default_grad_ctrl(grad_scale: Any = None) -> jax.Array:
  """Gradient control (GradCtrl in norm_math.h): a loss scale (default 1), no clipping, no skip."""
  return _ffi.device_vector(_CONTRACT.names["grad_ctrl"], clip_div=1.0, clip_mul=1.0, skip=0.0,
                            loss_scale=1.0 if grad_scale is None else grad_scale)


def grad_ctrl_for(spec: AdamSpec, grads: Any, grad_scale: Any = None, *,
                  clip_max_norm: Any = None, need_norm: bool = False, axis_name: Any = None):
  """(global norm or None, gradient-control vector) for one Adam step. The global-norm op runs
  only when something needs it (clipping, the non-finite check, or the norm itself); a bare loss
  scale goes into the vector directly."""
  if clip_max_norm is not None or spec.skip_nonfinite or need_norm:
    from jaxfuse._clip import norm_and_grad_ctrl  # the finite check is the global-norm op's

    return norm_and_grad_ctrl(grads, max_norm=clip_max_norm, grad_scale=grad_scale,
                              skip_nonfinite=spec.skip_nonfinite, axis_name=axis_name)
  return None, default_grad_ctrl(grad_scale)


class _Leaves(NamedTuple):
  """The flat per-leaf lists of one Adam step, by kernel list name (adam.h). `params` is None in
  the optax protocol called without params, `master_params` without master weights."""

  grads: list
  params: Optional[list]
  mu: list
  nu: list
  master_params: Optional[list]

  def select(self, idx: list[int]) -> "_Leaves":
    return _Leaves(*[None if x is None else [x[i] for i in idx] for x in self])

  def family(self, i: int) -> tuple[bool, bool]:
    """(computed in double, complex) for leaf i: leaves of one family share FFI calls."""
    dtypes = [x[i].dtype for x in self if x is not None]
    return any(_trees.is_wide(d) for d in dtypes), _trees.is_complex(self.grads[i].dtype)


def _adam_ffi(count, hyper, grad_ctrl, leaves: _Leaves, *, decay, nesterov, write_updates,
              output_dtypes) -> tuple[jax.Array, dict[str, list]]:
  """One jaxfuse_adam FFI call over `leaves` (operands and results laid out as the op's
  contract says), on every device's own shards when they are sharded. Returns (new count,
  result leaves by list name)."""
  n = len(leaves.grads)
  master, params = leaves.master_params is not None, leaves.params is not None
  layout = _CONTRACT.call("layout", write_updates=write_updates, master=master,
                          params=params).names
  fixed = dict(count=count, hyper=hyper, grad_ctrl=grad_ctrl)
  operands = [fixed[name] for name in _CONTRACT.names["fixed_operands"]]
  operands += [x for name in layout["operands"] for x in getattr(leaves, name)]
  like = lambda name: leaves.grads if name == "updates" else getattr(leaves, name)
  result_dtypes = [jnp.int32]  # the fixed result: the new count
  for name in layout["results"]:
    result_dtypes += output_dtypes if name == "updates" else [x.dtype for x in like(name)]
  aliases = _ffi.aliases(layout["operands"], layout["results"], n,
                         operand_offset=len(_CONTRACT.names["fixed_operands"]),
                         result_offset=len(_CONTRACT.names["fixed_results"]))

  def body(shards, *local):
    del shards  # elementwise: each device updates its own shards
    shapes = [()] + [jnp.shape(x) for _ in layout["results"]
                     for x in local[len(fixed):len(fixed) + n]]
    call = jax.ffi.ffi_call(_ffi.target("jaxfuse_adam"),
                            [jax.ShapeDtypeStruct(s, t) for s, t in zip(shapes, result_dtypes)],
                            input_output_aliases=aliases, vmap_method="sequential")
    return call(*local, num_tensors=np.int64(n), nesterov=bool(nesterov),
                write_updates=bool(write_updates), master=master, params=params,
                decay_mask=np.asarray(decay, np.uint8))

  leaf_dims = _partition.leaf_dims(leaves.grads, "leaf")
  partition = _partition.Layout(
      operands=tuple(_partition.whole(x) for x in operands[:len(fixed)])
      + leaf_dims * len(layout["operands"]),
      results=((),) + leaf_dims * len(layout["results"]),
      names=tuple(_CONTRACT.names["fixed_operands"])
      + tuple(f"{name} leaf {i}" for name in layout["operands"] for i in range(n)),
      # The state written back keeps its sharding; the gradients follow it.
      prefer=tuple(len(fixed) + k * n + i for k, name in enumerate(layout["operands"])
                   if name != "grads" for i in range(n)))
  out = _partition.partitioned_call("jaxfuse.adam", body, partition, operands)
  lists = {name: list(out[1 + i * n:1 + (i + 1) * n]) for i, name in enumerate(layout["results"])}
  return out[0], lists


class _Step(NamedTuple):
  """What one step over a whole tree computed: the leaves of the kernel's per-leaf output
  (updates or params), the new moments and master params, the new count and the skip flag."""

  outputs: list
  mu: list
  nu: list
  master_params: Optional[list]
  count: jax.Array
  skip: jax.Array


def _output_dtype(spec: AdamSpec, leaves: _Leaves, i: int):
  # optax's updates have the grads' dtype, or wider where its math promotes them (a wider
  # mu_dtype); with master weights the update is the exact step between two values of the
  # params' dtype (adam_group), so the grads' dtype holds it.
  if spec.master_weights:
    return leaves.grads[i].dtype
  return jnp.result_type(leaves.grads[i].dtype, leaves.mu[i].dtype, leaves.nu[i].dtype)


def _calls(leaves: _Leaves, nonempty: list[int]) -> list[list[int]]:
  """The leaves of each FFI call: the ``nonempty`` ones, one family (compute type, real or
  complex) per call, at most MAX_LEAVES_PER_CALL each."""
  families: dict[tuple[bool, bool], list[int]] = {}
  for i in nonempty:
    families.setdefault(leaves.family(i), []).append(i)
  return [idx[k:k + MAX_LEAVES_PER_CALL] for idx in families.values()
          for k in range(0, len(idx), MAX_LEAVES_PER_CALL)]


def _stand_in_params(grads: Any, state: Any) -> Any:
  """Shapes and dtypes of the params for checks when update() gets none: the grads' shapes with
  the dtype of the second moment, which init() gives the params' dtype."""
  nu = jax.tree.structure(grads).flatten_up_to(state[0].nu)
  return jax.tree.structure(grads).unflatten(
      [jax.ShapeDtypeStruct(jnp.shape(g), v.dtype) for g, v in zip(jax.tree.leaves(grads), nu)])


def _checked_leaves(spec: AdamSpec, grads: Any, state: Any, params: Any
                    ) -> tuple[_Leaves, list[bool]]:
  """Checks one step's arguments (naming the leaf at fault) and flattens them: the per-leaf
  lists and the weight-decay flags. All leaves are JAX arrays (as_arrays)."""
  _trees.check_float_leaves(grads, "grads")
  reference = _stand_in_params(grads, state) if params is None else params
  decay = spec.check_params(reference)
  _trees.check_same_structure(reference, grads, "params", "grads")
  _check_state(spec, state, reference)
  treedef = jax.tree.structure(grads)
  leaves = _Leaves(jax.tree.leaves(grads), None if params is None else jax.tree.leaves(params),
                   treedef.flatten_up_to(state[0].mu), treedef.flatten_up_to(state[0].nu),
                   treedef.flatten_up_to(state[-1].master_params) if spec.master_weights else None)
  return leaves, decay


def _run_step(spec: AdamSpec, grads: Any, state: Any, params: Any, grad_ctrl: Optional[jax.Array],
              *, write_updates: bool) -> _Step:
  """Checks the arguments and runs the kernel over every leaf: one FFI call per family of
  leaves (compute type, real or complex) and per MAX_LEAVES_PER_CALL non-empty leaves."""
  leaves, decay = _checked_leaves(spec, grads, state, params)
  if grad_ctrl is None:
    if spec.skip_nonfinite:
      raise ValueError("jaxfuse: skip_nonfinite needs the control vector of a norm call")
    grad_ctrl = default_grad_ctrl()
  adam_state = state[0]
  n = len(leaves.grads)
  hyper = hyper_vector(spec, adam_state.count)
  step = _Step([None] * n, list(leaves.mu), list(leaves.nu),
               None if leaves.master_params is None else list(leaves.master_params),
               None, grad_ctrl[_CONTRACT.names["grad_ctrl"].index("skip")] != 0)
  nonempty = _trees.nonempty(leaves.grads)
  for i in sorted(set(range(n)) - set(nonempty)):  # zero-size: no call, nothing to compute
    step.outputs[i] = (jnp.zeros(jnp.shape(leaves.grads[i]), _output_dtype(spec, leaves, i))
                       if write_updates else leaves.params[i])
  for idx in _calls(leaves, nonempty):
    count, out = _adam_ffi(adam_state.count, hyper, grad_ctrl, leaves.select(idx),
                           decay=[decay[i] for i in idx], nesterov=spec.nesterov,
                           write_updates=write_updates,
                           output_dtypes=[_output_dtype(spec, leaves, i) for i in idx])
    step = step._replace(count=count if step.count is None else step.count)
    for k, i in enumerate(idx):
      step.outputs[i] = out["updates" if write_updates else "params"][k]
      step.mu[i], step.nu[i] = out["mu"][k], out["nu"][k]
      if step.master_params is not None:
        step.master_params[i] = out["master_params"][k]
  if step.count is None:  # no element anywhere: the count still advances, as in optax
    step = step._replace(count=jnp.where(step.skip, adam_state.count,
                                         optax.safe_increment(adam_state.count)))
  return step


def _new_state(spec: AdamSpec, state: Any, treedef: Any, step: _Step) -> Any:
  """The state after `step` over a tree of structure `treedef`: moments, master params and skip
  count replaced, and every optax `count` in it (Adam's, the schedules') advanced together."""
  adam_state = state[0]._replace(mu=treedef.unflatten(step.mu), nu=treedef.unflatten(step.nu))
  new_state = (adam_state, *state[1:-1 if spec.has_extra_state else None])
  if spec.has_extra_state:
    extra = state[-1]
    new_state = (*new_state, AdamExtraState(
        treedef.unflatten(step.master_params) if spec.master_weights else None,
        extra.skipped_steps + step.skip.astype(jnp.int32) if spec.skip_nonfinite else None))
  return optax.tree_utils.tree_set(new_state, count=step.count)


def _compute_dtype(*dtypes) -> Any:
  """The type Adam computes a leaf in (adam.h): float32, float64 where a buffer is 64-bit, and
  the complex type of that width for complex leaves."""
  wide = any(_trees.is_wide(d) for d in dtypes)
  if any(_trees.is_complex(d) for d in dtypes):
    return jnp.dtype(jnp.complex128 if wide else jnp.complex64)
  return jnp.dtype(jnp.float64 if wide else jnp.float32)


def _leaf_update(spec: AdamSpec, h: dict, g, p, m, v, master, *, decay: bool, out_dtype,
                 skip) -> tuple:
  """adam_group() (adam_math.h) for one leaf as XLA operations, in the same operation order
  (optax's): (update, new mu, new nu, new master or None). `h` holds the step's scalars."""
  c = _compute_dtype(*[x.dtype for x in (g, p, m, v, master) if x is not None])
  real = jnp.finfo(c).dtype
  k = {name: jnp.asarray(x, real) for name, x in h.items()}
  gc = g.astype(c)
  if "loss_scale" in k:
    gc = gc / k["loss_scale"]
  g_squared = (jnp.conj(gc) * gc).real if jnp.iscomplexobj(gc) else gc * gc
  new_v = k["one_minus_b2"] * g_squared + k["b2"] * v.astype(c)
  new_m = k["one_minus_b1"] * gc + k["b1"] * m.astype(c)
  if spec.nesterov:
    m_hat = k["b1"] * (new_m / k["bc1_next"]) + k["one_minus_b1"] * (gc / k["bc1"])
  else:
    m_hat = new_m / k["bc1"]
  u = m_hat / (jnp.sqrt(new_v / k["bc2"] + k["eps_root"]) + k["eps"])
  source = master if master is not None else p
  if decay:
    u = u + k["weight_decay"] * source.astype(c)
  u = u * -k["learning_rate"]
  new_master = None
  if master is not None:
    # The exact step from the params to the new master's rounding (adam_store_params).
    new_master = source.astype(c) + u
    u = new_master.astype(p.dtype).astype(c) - p.astype(c)
  keep = lambda new, old: new.astype(old.dtype) if skip is None else jnp.where(
      skip, old, new.astype(old.dtype))
  update = u.astype(out_dtype) if skip is None else jnp.where(skip, 0, u.astype(out_dtype))
  return (update, keep(new_m, m), keep(new_v, v),
          None if master is None else keep(new_master, master))


def xla_updates(spec: AdamSpec, grads: Any, state: Any, params: Any,
                grad_scale: Any = None) -> tuple[Any, Any]:
  """The optax protocol: (updates, new_state), params untouched, with the element math as XLA
  operations, so that XLA fuses it with what consumes the updates (``optax.apply_updates``):
  the step then reads and writes each buffer once, as optax's does, on every backend. The math
  is the kernels' (adam_math.h: 16-bit leaves computed in float32 and rounded once, master
  weights, loss scale); with ``skip_nonfinite`` one global-norm call decides the skip."""
  grads, state, params = _trees.as_arrays((grads, state, params))
  leaves, decay = _checked_leaves(spec, grads, state, params)
  adam_state = state[0]
  skip = None
  if spec.skip_nonfinite:
    _, grad_ctrl = grad_ctrl_for(spec, grads, grad_scale)
    skip = grad_ctrl[_CONTRACT.names["grad_ctrl"].index("skip")] != 0
  count = adam_state.count
  t = optax.safe_increment(count)
  h = hyper_values(spec, count)
  h.update(bc1=1 - h["b1"] ** t, bc1_next=1 - h["b1"] ** optax.safe_increment(t),
           bc2=1 - h["b2"] ** t)  # optax's bias corrections, in JAX's default float type
  if grad_scale is not None:
    h["loss_scale"] = grad_scale
  n = len(leaves.grads)
  step = _Step([None] * n, [None] * n, [None] * n,
               None if leaves.master_params is None else [None] * n,
               t if skip is None else jnp.where(skip, count, t),
               jnp.bool_(False) if skip is None else skip)
  for i in range(n):
    out = _leaf_update(spec, h, leaves.grads[i],
                       None if leaves.params is None else leaves.params[i], leaves.mu[i],
                       leaves.nu[i], None if leaves.master_params is None
                       else leaves.master_params[i], decay=decay[i],
                       out_dtype=_output_dtype(spec, leaves, i), skip=skip)
    step.outputs[i], step.mu[i], step.nu[i] = out[:3]
    if step.master_params is not None:
      step.master_params[i] = out[3]
  treedef = jax.tree.structure(grads)
  return treedef.unflatten(step.outputs), _new_state(spec, state, treedef, step)


def adam_updates(spec: AdamSpec, grads: Any, state: Any, params: Any,
                 grad_ctrl: Optional[jax.Array] = None) -> tuple[Any, Any]:
  """The optax protocol: (updates, new_state), params untouched.

  `grad_ctrl` is the gradient-control vector (loss scale, clip divisor and multiplier, skip
  flag) that the global-norm kernel produces; None means plain Adam. With `skip_nonfinite`, the
  caller must pass the vector of a norm call made with it. `params` may be None when the
  transform needs none (no weight decay, no master weights)."""
  grads, state, params = _trees.as_arrays((grads, state, params))
  step = _run_step(spec, grads, state, params, grad_ctrl, write_updates=True)
  treedef = jax.tree.structure(grads)
  return treedef.unflatten(step.outputs), _new_state(spec, state, treedef, step)


def kernel_updates(tx: optax.GradientTransformation, grads: Any, state: Any, params: Any = None,
                   grad_scale: Any = None) -> tuple[Any, Any]:
  """``tx.update`` of a jaxfuse Adam computed by the Adam kernel's optax-protocol layout (the
  kernel writes the updates) instead of XLA's fused element math. The transforms no longer use
  that layout (XLA fuses its own math with apply_updates); it stays tested on both drivers
  (tools/cuda_on_cpu) until a GPU shows whether it beats XLA's fusions on trees of many small
  leaves, where one launch replaces one per leaf."""
  spec = tx.update.jaxfuse_spec
  return adam_updates(spec, grads, state, params, grad_ctrl_for(spec, grads, grad_scale)[1])


def adam_in_place(spec: AdamSpec, grads: Any, state: Any, params: Any,
                  grad_ctrl: Optional[jax.Array] = None) -> tuple[Any, Any]:
  """The fused step: (new_params, new_state), params, moments and master params updated in
  place (see adam_updates for `grad_ctrl`)."""
  grads, state, params = _trees.as_arrays((grads, state, params))
  if params is None:
    raise ValueError("jaxfuse.fused_step: params are required")
  step = _run_step(spec, grads, state, params, grad_ctrl, write_updates=False)
  treedef = jax.tree.structure(params)
  return treedef.unflatten(step.outputs), _new_state(spec, state, treedef, step)
