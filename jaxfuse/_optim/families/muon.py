"""Muon, optax-compatible: ``optax.contrib.muon``'s arguments, math and state, its matrices
orthogonalized in batches by shape and its element passes fused.

``muon`` partitions the params as optax's does: matrices (2-D leaves, or those
``muon_weight_dimension_numbers`` selects) get Muon, every other leaf AdamW. A step is

1. the momentum of every Muon leaf, ``mu = beta * mu + (1 - beta) * g``, and its
   bias-corrected (Nesterov) value, computed in float32 (float64 or complex where the leaf is) as
   XLA operations that write the stacks of step 2 directly;
2. Newton-Schulz on those values, the matrices of one shape and dtype stacked and orthogonalized
   by one chain of batched matmuls (``jaxfuse/_optim/newton_schulz.py``; ``ns_method="gram"``
   for the Gram iteration), each stack's matrices split over the devices of a multi-device mesh
   (owner compute: every device orthogonalizes whole matrices, no collective inside the
   iterations), then optax's adaptive and shape scaling;
3. one multi-tensor pass over every Muon leaf (the ``jaxfuse_muon`` op, optim/families/muon.h):
   decoupled weight decay and the learning rate, params updated;
4. the AdamW leaves through ``jaxfuse.adamw``'s kernels (``nesterov`` as given).

Under :func:`jaxfuse.fused_step` passes 3 and 4 are the families' in-place kernels, one launch
each for the whole tree, and a ``jaxfuse.clip_by_global_norm`` directly before ``muon`` folds
into them (and into step 1's reads of the gradients) from one global-norm call; the optax
protocol runs the same math as XLA operations. The state is optax's (a ``PartitionState`` with
the ``'adam'`` and ``'muon'`` groups), so checkpoints move between ``optax.contrib.muon`` and
``jaxfuse.muon`` both ways; ``master_weights`` and ``skip_nonfinite`` append a
``jaxfuse.ExtraState`` to each group's state.
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import optax

from jaxfuse._core import trees as _trees
from jaxfuse._optim import clip as _clip
from jaxfuse._optim import families as _families
from jaxfuse._optim import inplace as _inplace
from jaxfuse._optim import kernel_path as _kernel_path
from jaxfuse._optim import moments as _moments
from jaxfuse._optim import newton_schulz as _ns
from jaxfuse._optim import spec as _spec
from jaxfuse._optim import step as _step
from jaxfuse._optim import xla_path as _xla_path
from jaxfuse._optim.families import adam as _adam
from jaxfuse._optim.spec import ScalarOrSchedule

# Published coefficient rows (a, b, c) of the quintic iteration, by the names optax takes:
# Jordan's (2024) and Dion's per-iteration rows (Ahn et al., 2025).
NS_PRESETS = {
    "standard": (3.4445, -4.7750, 2.0315),
    "dion": ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
             (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)),
}

# XORed into the seed of the AdamW group's stochastic rounding (a 31-bit constant: an int32 seed
# under inject_hyperparams stays in range).
_ADAM_GROUP_SEED = 0x5DEECE66

WeightDimNumOrFn = Union[Any, Callable[[Any], Any]]  # optax.contrib.MuonDimensionNumbers


def _optax_muon() -> Any:
  """optax.contrib, where its Muon is the one jaxfuse.muon follows (dimension numbers,
  preconditionings: optax 0.2.8); raises otherwise."""
  contrib = optax.contrib
  if not (hasattr(contrib, "MuonDimensionNumbers") and "preconditioning" in
          inspect.signature(contrib.scale_by_muon).parameters):
    raise ImportError(f"jaxfuse.muon follows optax.contrib.muon of optax >= 0.2.8 (its "
                      f"arguments and state); this is optax {optax.__version__}")
  return contrib


def _is_dims(x: Any) -> bool:
  return x is None or isinstance(x, optax.contrib.MuonDimensionNumbers)


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class MuonSpec(_spec.Spec):
  """The element pass of jaxfuse.muon's Muon leaves (optim/families/muon.h): the orthogonalized
  momentum, scaled by shape, read as the gradient; its state is the ``'muon'`` group's chain of
  optax.contrib.muon (the momentum there is updated before the pass, which keeps no state
  list)."""

  op = "jaxfuse_muon"
  name = "jaxfuse.muon"
  weight_decay: ScalarOrSchedule
  weight_decay_mask: Any
  twin: optax.GradientTransformation
  momentum_bits: Optional[int] = None  # 8: the momentum of large leaves kept in 8 bits

  def twin_init(self, params: Any, quantized: Optional[list[bool]] = None) -> Any:
    """optax's state of the Muon group, its momentum in 8 bits where ``momentum_bits=8`` and
    the leaf is quantizable (the other families' format, signed: moments.py)."""
    state = super().twin_init(params, quantized)
    if self.momentum_bits != 8:
      return state
    block = self.moment_block
    _moments.warn_float_leaves(self.name, params, block)
    mu = jax.tree.map(lambda p, m: _moments.quantize(m, True, block)
                      if _moments.quantizable(jnp.shape(p), p.dtype, block) else m,
                      params, state[0].mu)
    return (state[0]._replace(mu=mu), *state[1:])

  @property
  def needs_params(self) -> bool:
    return True  # optax's add_decayed_weights asks for params even with no decay

  def optax_twin(self) -> optax.GradientTransformation:
    return self.twin

  def tensor_flags(self, params: Any) -> list[dict[str, bool]]:
    return _spec.decay_flags(self.weight_decay, self.weight_decay_mask, params)

  def states(self, state: Any) -> list[Any]:
    return []

  def with_states(self, state: Any, trees: list[Any]) -> Any:
    return state

  def hyper(self, count: jax.Array) -> dict[str, Any]:
    wd = self.weight_decay if _spec.decays(self.weight_decay) else 0.0
    return {"learning_rate": _spec.scalar(self.learning_rate, count),
            "weight_decay": _spec.scalar(wd, count)}

  def leaf_math(self, k, g, p, states, flags):
    d = g + k["weight_decay"] * p if flags["decay"] else g
    return -k["learning_rate"] * d, []


@dataclasses.dataclass(frozen=True, eq=False)
class _Muon:
  """One jaxfuse.muon transform's configuration: its two groups' specs and the orthogonalization."""

  muon: MuonSpec
  adam: _adam.AdamSpec
  dims: Any  # muon_weight_dimension_numbers as given (None: every 2-D leaf)
  ns_steps: Any  # the coefficients are the state's (MuonState.ns_coeffs), as optax reads them
  beta: Any
  eps: Any
  nesterov: bool
  adaptive: bool
  preconditioning: str
  consistent_rms: Any
  ns_method: str
  ns_dtype: Any

  def leaf_dims(self, params: Any) -> list[Optional[Any]]:
    """Per params leaf, its dimension numbers if Muon orthogonalizes it, else None (Adam)."""
    leaves = jax.tree.leaves(params)
    if self.dims is None:
      return [optax.contrib.MuonDimensionNumbers() if jnp.ndim(x) == 2 else None for x in leaves]
    dims = self.dims(params) if callable(self.dims) else self.dims
    out: list = []
    try:
      jax.tree.map(lambda d, sub: out.extend([d] * len(jax.tree.leaves(sub))), dims, params,
                   is_leaf=_is_dims)
    except ValueError as e:
      raise ValueError("jaxfuse.muon: muon_weight_dimension_numbers is not a prefix of the "
                       f"params tree: {e}") from None
    return out

  def labels(self, params: Any) -> Any:
    return jax.tree.structure(params).unflatten(
        ["adam" if d is None else "muon" for d in self.leaf_dims(params)])

  def init(self, params: Any) -> Any:
    params = _trees.as_arrays(params)
    self.matrices(params)  # raises, naming the leaf, where a Muon leaf cannot be a matrix
    groups = {"muon": optax.GradientTransformation(self.muon.init, None),
              "adam": optax.GradientTransformation(self.adam.init, None)}
    return optax.partition(groups, self.labels).init(params)

  def matrices(self, params: Any) -> list[Optional[_ns.Matrices]]:
    names = _trees.leaf_names(params)
    return [None if d is None else _ns.matrices(jnp.shape(x), d, name)
            for x, d, name in zip(jax.tree.leaves(params), self.leaf_dims(params), names)]

  # ---- a step --------------------------------------------------------------------------------

  def orthogonalized(self, grads: list, mu: list, shapes: list, count: jax.Array,
                     coeffs: jax.Array, scale: Callable[[jax.Array], jax.Array],
                     skip: Optional[jax.Array]) -> tuple[list, list]:
    """Steps 1 and 2 of the module docstring for the Muon leaves: (their updates scaled by
    shape, in the grads' dtypes; their new momentum). `scale` maps a gradient, in the compute
    type, to what the optimizer sees (loss scale, clip)."""
    beta = self.beta
    count_inc = optax.safe_increment(count)
    new_mu, hats = [], []
    for g, m in zip(grads, mu):
      c = _xla_path.compute_dtype(g.dtype, _step.state_dtype(m))
      m_c = (_moments.dequantize(m) if _moments.is_quantized(m) else m).astype(c)
      g = scale(g.astype(c))
      m_new = (1 - beta) * g + beta * m_c  # optax.tree.update_moment, order 1
      if self.nesterov:
        hat = beta * (m_new / (1 - beta ** optax.safe_increment(count_inc)).astype(c)) + \
            (1 - beta) * (g / (1 - beta ** count_inc).astype(c))
      else:
        hat = m_new / (1 - beta ** count_inc).astype(c)
      stored = _moments.like(m_new, m) if _moments.is_quantized(m) else m_new.astype(m.dtype)
      new_mu.append(stored if skip is None else
                    jax.tree.map(lambda n, o: jnp.where(skip, o, n), stored, m))
      hats.append(hat)
    outs = _ns.orthogonalize_leaves(hats, shapes, coeffs, self.ns_steps, self.preconditioning,
                                    self.eps, self.ns_method, self.ns_dtype)
    updates = []
    for g, hat, o, m in zip(grads, hats, outs, shapes):
      if self.adaptive:
        o = jnp.sum(hat.conj() * o) * o
      fan_in, fan_out = m.flat[1], m.flat[2]
      if self.consistent_rms is not None:
        factor = jnp.sqrt(jnp.maximum(fan_in, fan_out)) * self.consistent_rms
      else:
        factor = jnp.sqrt(jnp.maximum(1, fan_out / fan_in))
      updates.append((factor * o).astype(g.dtype))
    return updates, new_mu

  def update(self, grads: Any, state: Any, params: Any, grad_scale: Any) -> tuple[Any, Any]:
    """The optax protocol's (updates, new state), or under fused_step (placeholders, new
    state) with the new params recorded."""
    if params is None:
      raise ValueError("jaxfuse.muon: update() needs params (for weight decay), as optax's does")
    grads, state, params = _trees.as_arrays((grads, state, params))
    _trees.check_same_structure(params, grads, "params", "grads")
    shapes = self.matrices(params)
    groups = _groups(state)
    step = _inplace.current()
    norm, grad_ctrl, skip, scale = self.grad_control(grads, grad_scale, step)
    leaves, treedef = jax.tree.flatten(grads)
    mine = [i for i, m in enumerate(shapes) if m is not None]
    muon_state = groups["muon"].inner_state
    core = muon_state[:-1] if self.muon.has_extra_state else muon_state
    mu = jax.tree.leaves(core[0].mu, is_leaf=_moments.is_quantized)
    if len(mu) != len(mine):
      raise ValueError(f"jaxfuse.muon: opt_state's momentum has {len(mu)} leaves, these params "
                       f"{len(mine)} matrices for Muon (a state from init() on other params?)")
    updates, new_mu = self.orthogonalized([leaves[i] for i in mine], mu,
                                          [shapes[i] for i in mine], core[0].count,
                                          core[0].ns_coeffs, scale, skip)
    # A group's trees: its leaves where they are, MaskedNodes elsewhere (optax.partition's).
    place = lambda values, group: treedef.unflatten(
        [next(values) if (m is not None) == (group == "muon") else optax.MaskedNode()
         for m in shapes])
    pick = lambda full, group: place(
        iter([x for x, m in zip(full, shapes) if (m is not None) == (group == "muon")]), group)
    p_leaves = treedef.flatten_up_to(params)
    muon_args = (place(iter(updates), "muon"),
                 (core[0]._replace(mu=place(iter(new_mu), "muon")), *core[1:],
                  *muon_state[len(core):]),
                 pick(p_leaves, "muon"))
    adam_args = (pick(leaves, "adam"), groups["adam"].inner_state, pick(p_leaves, "adam"))
    if step is None:
      u_m, new_muon = _xla_path.xla_updates(self.muon, *muon_args, skip=skip)
      u_a, new_adam = _xla_path.xla_updates(self.adam, *adam_args, grad_scale, skip=skip)
      out = _merge(treedef, shapes, u_m, u_a)
    else:
      # The matrices' pass reads the orthogonalized updates: no loss scale or clip, the skip.
      at = _clip.GRAD_CTRL_NAMES.index("skip")
      ctrl = _step.default_grad_ctrl().at[at].set(grad_ctrl[at])
      new_pm, new_muon = _kernel_path.in_place(self.muon, *muon_args, ctrl)
      new_pa, new_adam = _kernel_path.in_place(self.adam, *adam_args, grad_ctrl)
      out = _kernel_path.record(self.muon, step, grads, _merge(treedef, shapes, new_pm, new_pa),
                                norm)
    new_groups = {"muon": groups["muon"]._replace(inner_state=new_muon),
                  "adam": groups["adam"]._replace(inner_state=new_adam)}
    return out, state._replace(inner_states=new_groups)

  def grad_control(self, grads: Any, grad_scale: Any, step: Optional[_inplace.InPlaceStep]):
    """(global norm or None, gradient-control vector or None, skip flag or None, the gradient
    as the optimizer sees it): under fused_step from one global-norm call over the whole tree
    that folds a jaxfuse clip directly before (both groups' kernels read its vector); in the
    optax protocol the loss scale alone, and the skip decided on the whole tree."""
    if step is None:
      skip = None
      if self.adam.skip_nonfinite:
        skip = _step.skip_flag(_step.grad_ctrl_for(self.adam, grads, grad_scale)[1])
      scale = (lambda g: g) if grad_scale is None else \
          (lambda g: g / jnp.asarray(grad_scale, jnp.finfo(g.dtype).dtype))
      return None, None, skip, scale
    norm, grad_ctrl = _kernel_path.step_grad_ctrl(self.adam, step, grads)
    skip = _step.skip_flag(grad_ctrl) if self.adam.skip_nonfinite else None
    return norm, grad_ctrl, skip, lambda g: _clip.apply_grad_ctrl(g, grad_ctrl)


def _groups(state: Any) -> dict:
  """The 'muon' and 'adam' groups of a Muon state (optax.partition's); raises otherwise."""
  groups = getattr(state, "inner_states", None)
  if not isinstance(groups, dict) or set(groups) != {"muon", "adam"}:
    raise ValueError("jaxfuse.muon: opt_state is not a Muon state (optax.contrib.muon's or "
                     f"jaxfuse.muon's, a partition into 'muon' and 'adam'); got "
                     f"{type(state).__name__}")
  return groups


def _merge(treedef: Any, shapes: list, muon_tree: Any, adam_tree: Any) -> Any:
  """The tree like the params whose Muon leaves are `muon_tree`'s, the others `adam_tree`'s."""
  mu, ad = iter(jax.tree.leaves(muon_tree)), iter(jax.tree.leaves(adam_tree))
  return treedef.unflatten([next(ad) if m is None else next(mu) for m in shapes])


def _check(learning_rate, ns_coeffs, ns_steps, beta, eps, weight_decay, preconditioning,
           adam_numbers, consistent_rms, ns_method, ns_dtype, moment_bits) -> Any:
  """Raises on an argument jaxfuse.muon cannot run, naming it; returns the coefficients (a
  preset's name resolved)."""
  owner = "jaxfuse.muon"
  _spec.check_number(owner, "learning_rate", learning_rate, schedule=True)
  _spec.check_number(owner, "weight_decay", weight_decay, schedule=True)
  schedules = ("adam_learning_rate", "adam_weight_decay")
  for name, value in dict(beta=beta, eps=eps, **adam_numbers).items():
    if value is not None or name != "adam_learning_rate":
      _spec.check_number(owner, name, value, schedule=name in schedules)
  if consistent_rms is not None:
    _spec.check_number(owner, "consistent_rms", consistent_rms)
  if moment_bits not in (None, 8, 32):
    raise ValueError(f"{owner}: moment_bits={moment_bits!r}; expected 8 or 32 (None: 32)")
  if isinstance(ns_coeffs, str):
    if ns_coeffs not in NS_PRESETS:
      raise ValueError(f"{owner}: ns_coeffs={ns_coeffs!r}; the presets are "
                       f"{', '.join(map(repr, NS_PRESETS))}")
    ns_coeffs = NS_PRESETS[ns_coeffs]
  shape = jnp.shape(jnp.asarray(ns_coeffs))
  if len(shape) not in (1, 2) or shape[-1] != 3:
    raise ValueError(f"{owner}: ns_coeffs has shape {shape}; expected (3,) or (n, 3)")
  try:
    steps = operator.index(ns_steps)
  except TypeError:
    steps = None  # traced (optax.inject_hyperparams): a loop of the one row
  else:
    if steps < 1:
      raise ValueError(f"{owner}: ns_steps={ns_steps!r}; expected an int >= 1")
  if steps is None and len(shape) == 1 and ns_method == "gram":
    raise ValueError(f"{owner}: ns_steps is traced; with ns_method='gram' it must be static "
                     "(optax.inject_hyperparams(..., static_args=('ns_steps',)))")
  if preconditioning not in _ns.PRECONDITIONINGS:
    raise ValueError(f"{owner}: preconditioning={preconditioning!r}; expected one of "
                     f"{', '.join(map(repr, _ns.PRECONDITIONINGS))}")
  if ns_method not in _ns.METHODS:
    raise ValueError(f"{owner}: ns_method={ns_method!r}; expected one of "
                     f"{', '.join(map(repr, _ns.METHODS))}")
  if ns_dtype is not None and not jnp.issubdtype(ns_dtype, jnp.floating):
    raise ValueError(f"{owner}: ns_dtype {jnp.dtype(ns_dtype).name} is not a real float dtype "
                     "(complex matrices iterate in its complex counterpart)")
  return ns_coeffs


@_families.composite(MuonSpec)
def muon(learning_rate: ScalarOrSchedule,
         ns_coeffs: Any = NS_PRESETS["standard"], ns_steps: int = 5, beta: float = 0.95,
         eps: float = 1e-8, weight_decay: ScalarOrSchedule = 0.0,
         weight_decay_mask: Any = None, mu_dtype: Optional[Any] = None, *,
         nesterov: bool = True, adaptive: bool = False, preconditioning: str = "frobenius",
         adam_b1: float = 0.9, adam_b2: float = 0.999, adam_eps_root: float = 0.0,
         adam_weight_decay: ScalarOrSchedule = 0.0,
         adam_learning_rate: Optional[ScalarOrSchedule] = None,
         muon_weight_dimension_numbers: Optional[WeightDimNumOrFn] = None,
         consistent_rms: Optional[float] = None, ns_method: str = "standard",
         ns_dtype: Optional[Any] = None, moment_bits: Optional[int] = None,
         master_weights: Union[bool, str] = False, skip_nonfinite: bool = False,
         stochastic_rounding: bool = False,
         seed: Optional[int] = None) -> optax.GradientTransformationExtraArgs:
  r"""Muon (Jordan et al., 2024): momentum orthogonalized by Newton-Schulz iterations for the
  matrices, AdamW for the other leaves; same arguments, defaults, math and state as
  ``optax.contrib.muon``, with the matrices orthogonalized in batches by shape and the element
  passes fused (see ``jaxfuse/_optim/families/muon.py``).

  For a matrix leaf, with :math:`\beta` the momentum, :math:`\lambda` the weight decay and
  :math:`s` the shape scale (``sqrt(max(1, fan_out / fan_in))``, or
  ``sqrt(max(fan_in, fan_out)) * consistent_rms``):

  .. math::

    m_t &\leftarrow \beta m_{t-1} + (1 - \beta) g_t \\
    \hat m_t &\leftarrow \frac{\beta m_t}{1 - \beta^{t+1}} + \frac{(1 - \beta) g_t}{1 - \beta^t}
      \quad (\text{without Nesterov: } m_t / (1 - \beta^t)) \\
    O_t &\leftarrow \mathrm{NewtonSchulz}(\hat m_t) \approx U V^\top
      \text{ where } \hat m_t = U \Sigma V^\top \\
    u_t &\leftarrow -\alpha_t (s\, O_t + \lambda \theta_t)

  Args:
    learning_rate: a float, or an optax schedule evaluated on the step count.
    ns_coeffs: the quintic's coefficients (a, b, c), one row for every iteration or one row per
      iteration (shape (n, 3), n <= ns_steps), or a preset's name: "standard" (Jordan's) or
      "dion" (Ahn et al., 2025).
    ns_steps: the number of Newton-Schulz iterations (with one row of coefficients).
    beta: decay rate of the momentum.
    eps: added to the preconditioning's norm, and Adam's epsilon.
    weight_decay: decoupled weight decay of the Muon leaves, multiplied by the learning rate.
    weight_decay_mask: pytree of bools (a prefix of params) or a callable returning one: where
      the Muon leaves' weight decay applies. Must be static.
    mu_dtype: storage dtype of both groups' momentum (None: the params' dtype).
    nesterov: Nesterov momentum, in both groups (Adam's is NAdamW).
    adaptive: scale each orthogonalized update by its dual norm, ``<m_hat, O>``
      (Bernstein and Newhouse, 2024).
    preconditioning: how each matrix is scaled before the iterations: "frobenius" (its norm),
      "spectral" (its largest singular value), "aol" or "schatten" (their first iteration),
      as optax.
    adam_b1, adam_b2, adam_eps_root, adam_weight_decay: the AdamW group's.
    adam_learning_rate: the AdamW group's learning rate (None: ``learning_rate``).
    muon_weight_dimension_numbers: ``optax.contrib.MuonDimensionNumbers`` per leaf (a pytree, a
      prefix of params, or a callable returning one), None where a leaf goes to AdamW; None: every
      2-D leaf gets Muon as a (fan_in, fan_out) matrix.
    consistent_rms: if set, the shape scale is ``sqrt(max(fan_in, fan_out)) * consistent_rms``
      (Liu et al., 2025; 0.2 matches AdamW's update RMS).
    ns_method: "standard": the iteration as optax runs it; "gram": the Gram Newton-Schulz
      iteration (Zhang et al., 2026), the same polynomial with fewer flops for rectangular
      matrices (restarted once, before the third iteration).
    ns_dtype: the dtype the iterations run in (None: the momentum's compute type, float32 for
      16- and 32-bit leaves); jnp.bfloat16 runs them at bfloat16 matmul speed.

  Returns:
    An optax ``GradientTransformationExtraArgs``.

  References:
    Jordan, `Muon: An optimizer for hidden layers in neural networks
    <https://kellerjordan.github.io/posts/muon/>`_, 2024

    Liu et al., `Muon is Scalable for LLM Training <https://arxiv.org/abs/2502.16982>`_, 2025
  """
  contrib = _optax_muon()
  adam_numbers = dict(adam_b1=adam_b1, adam_b2=adam_b2, adam_eps_root=adam_eps_root,
                      adam_weight_decay=adam_weight_decay, adam_learning_rate=adam_learning_rate)
  coeffs = _check(learning_rate, ns_coeffs, ns_steps, beta, eps, weight_decay, preconditioning,
                  adam_numbers, consistent_rms, ns_method, ns_dtype, moment_bits)
  options = dict(master_weights=master_weights, skip_nonfinite=skip_nonfinite,
                 stochastic_rounding=stochastic_rounding)
  twin = optax.chain(
      contrib.scale_by_muon(coeffs, ns_steps, beta, eps, mu_dtype, nesterov=nesterov,
                            adaptive=adaptive, preconditioning=preconditioning),
      optax.identity(),  # scale_by_shape's (empty) state
      optax.add_decayed_weights(weight_decay, weight_decay_mask),
      optax.scale_by_learning_rate(learning_rate))
  muon_spec = MuonSpec(learning_rate=learning_rate, weight_decay=weight_decay,
                       weight_decay_mask=weight_decay_mask, twin=twin, momentum_bits=moment_bits,
                       seed=seed, **options)
  muon_spec.check_options()  # the shared options (and the seed) named as jaxfuse.muon's
  # Each group numbers its leaves from 0: the AdamW group's rounding streams take another seed.
  adam_seed = (0 if seed is None else seed) ^ _ADAM_GROUP_SEED
  adam_spec = _adam.adamw._spec_of(
      learning_rate if adam_learning_rate is None else adam_learning_rate, adam_b1, adam_b2,
      eps, adam_eps_root, mu_dtype, adam_weight_decay, nesterov=nesterov,
      moment_bits=moment_bits, seed=adam_seed, **options)
  config = _Muon(muon_spec, adam_spec, muon_weight_dimension_numbers, ns_steps, beta, eps,
                 nesterov, adaptive, preconditioning, consistent_rms, ns_method, ns_dtype)

  def update_fn(updates, state, params=None, *, grad_scale=None, **extra_args):
    del extra_args
    return config.update(updates, state, params, grad_scale)

  return optax.GradientTransformationExtraArgs(config.init, update_fn)
