"""The one comparator of the optimizer tests: lockstep against optax, with element-wise bounds of
one step's rounding.

At every step the reference (optax's twin) starts from jaxfuse's own params and state, widened
exactly to float64 (complex128), so an error never compounds and every step is checked; the
state jaxfuse keeps is shown to be a valid optax state at every step (checkpoints move).

The reference runs through a running-error interpreter (:func:`reference_step`): beside each
value it carries its magnitude ``m``, first-order forward error analysis (Wilkinson's running
error bound) of the step's jaxpr: an operation that rounds adds its result's magnitude, and
errors propagate through each operation's derivative (``x * y``: ``m_x |y| + |x| m_y + |z|``).
Evaluated in precision ``eps`` (float32 for 16- and 32-bit leaves, which the kernels compute in),
the step's result is within ``eps / 2 * m`` of the exact one, element by element; cancellation
shows in ``m`` (an element that is the small difference of large terms has a large ``m``),
magnitude spread does not (a tiny element of a leaf is held to its own precision, not its
leaf's largest).

The bounds (:func:`allowed`), for a result the reference puts at ``e`` with magnitude ``m``:

* computed in float32 and stored in 32 bits: ``|a - e| <= eps32 * m``. The kernels evaluate the
  same operations, perhaps associated or contracted otherwise (a multiply-add fused, a quotient
  folded into a step size), each rounding at most half an ulp of an intermediate bounded by the
  same magnitudes: within the reference's bound, with a factor 2 for the other order.
* float64 leaves: ``2 * eps64 * m``, the reference being in the same precision (its own error
  ``eps64 / 2 * m`` added).
* stored in 16 bits: the float32 result rounded once, so the stored value is the 16-bit
  rounding of some value within ``eps32 * m`` of ``e``: one of the 16-bit values between the
  roundings of ``e - eps32 m`` and ``e + eps32 m``. Away from a rounding boundary that is one
  value (bitwise); within ``eps32 m`` of one, its two neighbours, so the elements that differ
  by one ulp are bounded by those near a boundary, and none differs by two.
* stochastically rounded 16-bit params: either neighbour of that interval (down or up).
* 8-bit moments: the value the stored code decodes to is the reference's within half the code
  spacing at that element (plus ``eps32 * m``), i.e. the code the reference encodes to or, at a
  code boundary, its neighbour.

Elements where the step is discontinuous (Lion's sign of a value within rounding of zero) may
legitimately differ by the jump; a case names them (``near_zero``) and they are left out.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend import core as jcore

import jaxfuse
from jaxfuse._core import packing as _packing
from jaxfuse._optim import moments as _moments
from jaxfuse._optim.spec import ExtraState as _ExtraState

EPS32 = float(np.finfo(np.float32).eps)
EPS64 = float(np.finfo(np.float64).eps)


# ---- the running-error interpreter ---------------------------------------------------------

def _wide(dtype):
  """The float64 / complex128 twin of a float dtype."""
  return np.complex128 if jnp.issubdtype(dtype, jnp.complexfloating) else np.float64


def _is_float(x):
  dtype = getattr(x, "dtype", None)
  return jnp.issubdtype(np.result_type(x) if dtype is None else dtype, jnp.inexact)


def _literal_magnitude(value):
  """A constant of the step rounds once where the kernels hold it in float32 (lr = 1e-2 does,
  1.0 does not)."""
  v = np.asarray(value)
  if not jnp.issubdtype(v.dtype, jnp.inexact):
    return np.zeros(v.shape)
  exact = np.array_equal(v.astype(np.complex64 if np.iscomplexobj(v) else np.float32)
                         .astype(v.dtype), v)
  return np.zeros(v.shape) if exact else np.abs(v).astype(np.float64)


_STRUCTURAL = {"reshape", "broadcast_in_dim", "squeeze", "expand_dims", "transpose", "slice",
               "dynamic_slice", "concatenate", "copy", "copy_p", "rev", "gather"}
_PARTS = {"real", "imag", "conj"}  # of a complex value: its magnitude bounds each part's error
# Exact on their input; where the input is within its error of a jump (sign at 0, floor at an
# integer) the step is discontinuous there, and a case names those elements (near_zero).
_EXACT = {"sign", "floor", "ceil", "round", "iota", "is_finite", "stop_gradient"}


# Real element-wise operations evaluated in NumPy: the same IEEE float64 arithmetic (the
# transcendental ones within an ulp of XLA's), without a compile per shape.
_NUMPY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
          "max": np.maximum, "min": np.minimum, "neg": np.negative, "abs": np.abs,
          "sign": np.sign, "sqrt": np.sqrt, "rsqrt": lambda x: 1 / np.sqrt(x), "exp": np.exp,
          "log": np.log, "log1p": np.log1p, "expm1": np.expm1, "tanh": np.tanh,
          "pow": np.power, "square": np.square, "lt": np.less, "le": np.less_equal,
          "gt": np.greater, "ge": np.greater_equal, "eq": np.equal, "ne": np.not_equal}


def _broadcast_in_dim(x, shape, broadcast_dimensions, **_):
  kept = [1] * len(shape)
  for i, d in enumerate(broadcast_dimensions):
    kept[d] = x.shape[i]
  return np.broadcast_to(x.reshape(kept), shape)


# Operations that move or pick elements, in NumPy (of any dtype): (operands, params) -> result.
_MOVES = {
    "broadcast_in_dim": lambda xs, p: _broadcast_in_dim(xs[0], **p),
    "reshape": lambda xs, p: np.reshape(xs[0] if p.get("dimensions") is None
                                        else np.transpose(xs[0], p["dimensions"]), p["new_sizes"]),
    "squeeze": lambda xs, p: np.squeeze(xs[0], axis=tuple(p["dimensions"])),
    "expand_dims": lambda xs, p: np.expand_dims(xs[0], tuple(p["dimensions"])),
    "transpose": lambda xs, p: np.transpose(xs[0], p["permutation"]),
    "concatenate": lambda xs, p: np.concatenate(xs, axis=p["dimension"]),
    "select_n": lambda xs, p: np.choose(np.asarray(xs[0]).astype(np.int32),
                                        np.broadcast_arrays(*xs[1:])),
}


@np.errstate(all="ignore")
def _mag_rule(name, args, mags, z, params):
  """The magnitude of result z of one operation (see the module docstring). In NumPy: on the
  CPU every jax operation on a new shape is a compile of its own."""
  args, z = [np.asarray(x) for x in args], np.asarray(z)
  mags = [np.asarray(m, np.float64) for m in mags]
  a = [np.abs(x) if _is_float(x) else x for x in args]
  az = np.abs(z)
  safe = lambda x: np.where(x == 0, 1.0, x)
  if name in ("add", "sub", "add_any"):
    return mags[0] + mags[1] + az
  if name == "mul":
    return mags[0] * a[1] + a[0] * mags[1] + az
  if name == "div":
    return (mags[0] + az * mags[1]) / safe(a[1]) + az
  if name == "square":
    return 2 * a[0] * mags[0] + az
  if name == "sqrt":
    return np.where(az == 0, mags[0], mags[0] / (2 * safe(az))) + az
  if name == "rsqrt":
    return az * mags[0] / (2 * safe(a[0])) + az
  if name == "integer_pow":
    k = params["y"]
    return abs(k) * a[0] ** (abs(k) - 1) * mags[0] * (1 if k > 0 else az ** 2) + az
  if name == "pow":
    return az * (np.abs(args[1]) * mags[0] / safe(a[0]) + np.abs(np.log(safe(a[0]))) * mags[1]) + az
  if name in ("exp", "exp2"):
    return az * mags[0] + az
  if name in ("log", "log1p"):
    return mags[0] / safe(a[0] + (1 if name == "log1p" else 0)) + az
  if name == "expm1":
    return (az + 1) * mags[0] + az
  if name in ("sin", "cos", "tanh", "logistic", "atan", "erf"):
    return mags[0] + az
  if name == "neg":  # exact: the error is the operand's, its sign aside
    return mags[0]
  if name == "abs":
    return mags[0] + (az if np.iscomplexobj(args[0]) else 0)
  if name in ("max", "min"):
    pick = (args[0] >= args[1]) if name == "max" else (args[0] <= args[1])
    return np.where(pick, mags[0], mags[1])
  if name == "clamp":
    return np.where((args[1] > args[0]) & (args[1] < args[2]), mags[1], 0.0)
  if name == "select_n":
    return _MOVES["select_n"]([args[0], *mags[1:]], params)
  if name == "complex":
    return mags[0] + mags[1]
  if name == "reduce_sum":
    axes = tuple(params["axes"])
    n = math.prod(args[0].shape[d] for d in axes)
    return np.sum(mags[0], axis=axes) + max(n - 1, 0) * np.sum(a[0], axis=axes) + az
  if name in ("reduce_max", "reduce_min"):
    return np.max(mags[0], axis=tuple(params["axes"]))
  if name == "dot_general":
    (contract, _), _ = params["dimension_numbers"]
    k = math.prod(args[0].shape[d] for d in contract)
    bind = lambda x, y: np.asarray(jax.lax.dot_general_p.bind(
        x, y, **dict(params, preferred_element_type=None)))
    return bind(mags[0], a[1]) + bind(a[0], mags[1]) + k * bind(a[0], a[1]) + az
  raise NotImplementedError(f"lockstep's interpreter has no rule for {name}")


def _run(jaxpr, consts, args, mags):
  """Evaluates `jaxpr` on (value, magnitude) pairs."""
  env = {}

  def read(v):
    if isinstance(v, jcore.Literal):
      return np.asarray(v.val), _literal_magnitude(v.val)
    return env[v]

  for v, x, m in zip(jaxpr.constvars, consts, [_literal_magnitude(c) for c in consts]):
    env[v] = (x, m)
  for v, x, m in zip(jaxpr.invars, args, mags):
    env[v] = (x, m)
  for eqn in jaxpr.eqns:
    vals, ms = zip(*[read(v) for v in eqn.invars]) if eqn.invars else ((), ())
    outs = _eqn(eqn, list(vals), list(ms))
    for v, out in zip(eqn.outvars, outs):
      env[v] = out
  return [read(v) for v in jaxpr.outvars]


def _eqn(eqn, vals, ms):
  """[(value, magnitude)] of one equation's results."""
  name, params = eqn.primitive.name, eqn.params
  inner = params.get("jaxpr", params.get("call_jaxpr"))
  if name in ("jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
              "remat", "checkpoint"):
    closed = inner if hasattr(inner, "jaxpr") else jcore.ClosedJaxpr(inner, ())
    n = len(closed.jaxpr.invars)
    return _run(closed.jaxpr, closed.consts, vals[-n:] if name.startswith("custom") else vals,
                ms[-n:] if name.startswith("custom") else ms)
  if name == "cond":
    b = params["branches"][int(vals[0])]
    return _run(b.jaxpr, b.consts, vals[1:], ms[1:])
  if name == "convert_element_type":
    x, m = vals[0], ms[0]
    if _is_float(x) and jnp.issubdtype(params["new_dtype"], jnp.inexact):
      # The reference keeps every float in its wide type: a storage cast (mu_dtype) is jaxfuse's
      # one rounding, checked against the stored dtype, not a rounding of the reference.
      wide = _wide(params["new_dtype"])
      if np.iscomplexobj(x) and wide is np.float64:
        return [(np.real(np.asarray(x)), m)]
      return [(np.asarray(x).astype(wide), m)]
    z = eqn.primitive.bind(*vals, **params)
    return [(z, np.zeros(np.shape(z)))]
  floats = [v for v in vals if _is_float(v)]
  if len({jnp.result_type(v) for v in floats}) > 1:  # a float kept wide meets a narrow one
    wide = jnp.result_type(*floats)
    vals = [np.asarray(v).astype(wide) if _is_float(v) else v for v in vals]
    if "preferred_element_type" in params:
      params = dict(params, preferred_element_type=None)
  if name == "reduce_precision":
    return [(vals[0], ms[0])]
  if name in _NUMPY and all(_is_float(v) and not np.iscomplexobj(v) for v in vals):
    with np.errstate(all="ignore"):
      z = _NUMPY[name](*[np.asarray(v) for v in vals])
  elif name in _MOVES:
    z = _MOVES[name]([np.asarray(v) for v in vals], params)
  else:
    z = eqn.primitive.bind(*vals, **params)
  outs = z if eqn.primitive.multiple_results else [z]
  if not all(_is_float(o) for o in outs):
    return [(o, np.zeros(np.shape(o))) for o in outs]
  if name in _STRUCTURAL:  # elements moved without arithmetic: magnitudes move with them
    move = (lambda *xs: _MOVES[name](xs, params)) if name in _MOVES else \
        (lambda *xs: eqn.primitive.bind(*xs, **params))
    return [(z, move(*ms) if name == "concatenate" else move(ms[0], *vals[1:]))]
  if name in _EXACT:
    return [(z, np.zeros(np.shape(z)))]
  if name in _PARTS:
    return [(z, ms[0])]
  return [(z, _mag_rule(name, vals, ms, z, params))]


def reference_step(ref, grads, state, params):
  """One step of optax transform `ref` from (grads, state, params), in float64: ((new params,
  new state, updates) as values, the same as magnitudes)."""
  with jax.enable_x64(True):
    wide = lambda t: jax.tree.map(
        lambda x: np.asarray(x).astype(_wide(x.dtype)) if _is_float(x) else jnp.asarray(x), t)
    g, s, p = wide(grads), wide(state), wide(params)

    def step(g, s, p):
      u, s_new = ref.update(g, s, p)
      return optax.apply_updates(p, u), s_new, u

    closed = jax.make_jaxpr(step)(g, s, p)
    flat, _ = jax.tree.flatten((g, s, p))
    zeros = [np.zeros(np.shape(x)) for x in flat]
    outs = _run(closed.jaxpr, closed.consts, flat, zeros)
    treedef = jax.tree.structure(jax.eval_shape(step, g, s, p))
    values = jax.tree.unflatten(treedef, [np.asarray(v) for v, _ in outs])
    mags = jax.tree.unflatten(treedef, [np.asarray(m, np.float64) for _, m in outs])
  return values, mags


# ---- the bounds ------------------------------------------------------------------------------

def _ulp_interval(stored, lo, hi, mode):
  """Whether each stored 16-bit value lies between the roundings of lo and hi (mode "nearest")
  or between lo rounded down and hi rounded up ("stochastic")."""
  dt = stored.dtype
  if mode == "nearest":
    down, up = lo.astype(dt), hi.astype(dt)
  else:
    down, up = _round_down(lo, dt), _round_up(hi, dt)
  s = stored.astype(np.float64)
  return (s >= down.astype(np.float64)) & (s <= up.astype(np.float64))


def _round_down(x, dt):
  r = x.astype(dt)
  return np.where(r.astype(np.float64) > x, np.nextafter(r, np.asarray(-np.inf, dt)), r)


def _round_up(x, dt):
  r = x.astype(dt)
  return np.where(r.astype(np.float64) < x, np.nextafter(r, np.asarray(np.inf, dt)), r)


def allowed(actual, expected, magnitude, *, stochastic=False, leaf_rtol=0.0):
  """Per element, whether `actual` (a stored leaf) is within one step's rounding of the float64
  reference `expected` with running-error magnitude `magnitude` (module docstring), plus
  `leaf_rtol` of the leaf's largest element. NaN and infinities must match exactly."""
  a = np.asarray(actual)
  e, m = np.asarray(expected), np.asarray(magnitude, np.float64)
  wide = a.dtype in (np.float64, np.complex128)
  bound = (2 * EPS64 if wide else EPS32) * m
  if leaf_rtol and e.size:
    bound = bound + leaf_rtol * float(np.max(np.abs(e[np.isfinite(e)]), initial=0.0))
  if np.iscomplexobj(a) or np.iscomplexobj(e):
    ok = np.abs(a.astype(np.complex128) - e) <= bound
  elif a.dtype.itemsize == 2:
    with np.errstate(over="ignore"):
      ok = _ulp_interval(a, e - bound, e + bound, "stochastic" if stochastic else "nearest")
  else:
    ok = np.abs(a.astype(np.float64) - e) <= bound
  special = ~np.isfinite(e)
  return np.where(special, np.isclose(a.astype(e.dtype), e, equal_nan=True), ok)


def allowed_quantized(q, expected, magnitude):
  """An 8-bit moment leaf (QuantizedMoment): its block scales are the reference's largest
  magnitudes over the format's top within the float32 bound, and each element decodes to a
  value between the codes of ``e - eps32 m`` and ``e + eps32 m`` under its block's scale: the
  code the reference encodes to, or at a code boundary its neighbour."""
  e = np.asarray(expected, np.float64)
  bound = EPS32 * np.asarray(magnitude, np.float64)
  signed = q.codes.dtype == jnp.int8
  scale = np.asarray(_per_element(q, q.scales), np.float64)
  decoded = np.asarray(_moments.dequantize(q), np.float64)

  def code_value(v):  # the value v's code decodes to under the stored scales (monotone in v)
    a = np.minimum(np.abs(v) / np.where(scale == 0, 1.0, scale), float(_moments._top(signed)))
    m = _moments._mantissa_bits(signed)
    code = _moments._encode_magnitude(jnp.asarray(a, jnp.float32), m)
    if not signed:
      code = jnp.where((code == 0) & (a > 0), 1, code)
    value = _moments._decode_magnitude(code, m) * jnp.asarray(scale, jnp.float32)  # as decoded
    return np.sign(v) * np.asarray(value, np.float64)

  ok = (decoded >= code_value(e - bound)) & (decoded <= code_value(e + bound))
  top = float(_moments._top(signed))
  largest = np.max(np.abs(np.asarray(_per_element(q, None, e))), axis=-1)
  slack = np.max(np.asarray(_per_element(q, None, bound)), axis=-1)
  scales = np.asarray(q.scales, np.float64)
  scale_ok = np.abs(scales - largest / top) <= (slack / top + EPS32 * scales)
  return ok & np.asarray(_per_element(q, scale_ok))


def _per_element(q, per_block, values=None):
  """`per_block` (shaped as q's scales) broadcast to q's elements; or, with `values` (shaped as
  the codes), those values as [scales' shape..., block]."""
  block = _moments.block_size(q)
  blocks_shape = (*q.scales.shape, block)
  if values is not None:
    v = np.asarray(values)
    return v.reshape(*q.scales.shape[:-1], -1).reshape(blocks_shape)
  full = np.broadcast_to(np.asarray(per_block)[..., None], blocks_shape)
  return full.reshape(*q.scales.shape[:-1], -1).reshape(q.codes.shape)


# ---- inputs at training's magnitudes -------------------------------------------------------

def training_tree(seed, like):
  """A tree shaped and typed like `like` (placed on its devices), each element of random sign
  and magnitude 10^U(-8, 2): many binades within every leaf, float16's subnormals and
  below included; every fourth leaf scaled by 1e-6 more (a leaf of tiny second moments)."""
  rng = np.random.default_rng(seed)

  def leaf(i, x):
    shape, dtype = jnp.shape(x), jnp.result_type(x)
    v = np.sign(rng.standard_normal(shape)) * 10.0 ** rng.uniform(-8, 2, shape)
    if i % 4 == 3:
      v = v * 1e-6
    if jnp.issubdtype(dtype, jnp.complexfloating):
      v = v + 1j * np.sign(rng.standard_normal(shape)) * 10.0 ** rng.uniform(-8, 2, shape)
    out = jnp.asarray(v, dtype)
    devices = getattr(x, "devices", None)
    return jax.device_put(out, next(iter(devices()))) if devices else out

  leaves, treedef = jax.tree.flatten(like)
  return jax.tree.unflatten(treedef, [leaf(i, x) for i, x in enumerate(leaves)])


def training_params(seed, shapes, dtype, device=None):
  """A dict tree of params with the given shapes and dtype (or one dtype per leaf), magnitudes
  spread over 10^-4 .. 10^1 within each leaf."""
  dtypes = dtype if isinstance(dtype, (list, tuple)) else [dtype] * len(shapes)
  like = {f"leaf{i:04d}": jax.ShapeDtypeStruct(s, d) for i, (s, d) in enumerate(zip(shapes, dtypes))}
  rng = np.random.default_rng(seed)
  tree = {k: jnp.asarray(np.sign(rng.standard_normal(x.shape)) *
                         10.0 ** rng.uniform(-4, 1, x.shape), x.dtype) for k, x in like.items()}
  return jax.device_put(tree, device) if device is not None else tree


# ---- the lockstep driver ---------------------------------------------------------------------

def _keeps_master(state):
  """Whether the state keeps full-precision params (a master copy or remainders)."""
  extras = [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, _ExtraState))
            if isinstance(x, _ExtraState)]
  return any(x.master_params is not None or x.param_remainders is not None for x in extras)


def state_leaves(state):
  """The optax part of a jaxfuse state (ExtraStates left out, packed lists unpacked), as
  leaves with 8-bit moments whole."""
  state = _packing.unpack(state)
  core = jax.tree.map(lambda x: None if isinstance(x, _ExtraState) else x, state,
                      is_leaf=lambda x: isinstance(x, _ExtraState) or _moments.is_quantized(x))
  return jax.tree.leaves(core, is_leaf=_moments.is_quantized)


def reference_inputs(ref, state, params):
  """jaxfuse's (state, params) in the twin's layout: the optax part of the state (8-bit moments
  decoded), the full-precision params (its master where it keeps one). Exact."""
  wide = jax.tree.map(lambda p: jnp.promote_types(p.dtype, jnp.float32),
                      _packing.unpack(params))
  p, s = jaxfuse.convert_state(state, params, ref, wide)
  return s, _packing.unpack(p)


@dataclasses.dataclass
class StepCheck:
  """What one lockstep step compares, and how (module docstring)."""

  stochastic: bool = False  # params stochastically rounded
  leaf_rtol: float = 0.0  # lockstep()'s algorithm_rtol
  failures: list = dataclasses.field(default_factory=list)

  def leaf(self, what, actual, expected, magnitude, mask=None):
    if _moments.is_quantized(actual):
      ok = allowed_quantized(actual, expected, magnitude)
    else:
      a = np.asarray(actual)
      if a.shape != np.shape(expected):
        self.failures.append(f"{what}: shape {a.shape} != {np.shape(expected)}")
        return
      ok = allowed(a, expected, magnitude, stochastic=self.stochastic and what.startswith("p"),
                   leaf_rtol=self.leaf_rtol)
    if mask is not None:
      ok = ok | np.asarray(mask)
    if not np.all(ok):
      bad = np.argwhere(~np.asarray(ok))[:3]
      a = np.asarray(_moments.dequantize(actual) if _moments.is_quantized(actual) else actual)
      e, m = np.asarray(expected), np.asarray(magnitude)
      shown = [f"{tuple(int(i) for i in b)}: {a[tuple(b)]!r} vs {e[tuple(b)]!r} "
               f"(magnitude {m[tuple(b)]:.3g})" for b in bad]
      self.failures.append(f"{what}: {int(np.size(ok) - np.sum(ok))} of {np.size(ok)} "
                           f"elements outside one step's rounding, e.g. " + "; ".join(shown))


def _paths(tree):
  return [jax.tree_util.keystr(k) for k, _ in
          jax.tree_util.tree_flatten_with_path(tree, is_leaf=_moments.is_quantized)[0]]


def _fused(tx, **kwargs):
  return lambda p, s, g: jaxfuse.fused_step(tx, g, s, p, **kwargs)


def _protocol(tx, **kwargs):
  def step(p, s, g):
    u, s = tx.update(g, s, p, **kwargs)
    return optax.apply_updates(p, u), s, u
  return step


def jit_fused(tx, **kwargs):
  """A jitted fused step donating params and state, in the order of its outputs."""
  return jit_step("fused", tx, donate=True, **kwargs)


def jit_step(path, tx, *, donate=False, **kwargs):
  """A jitted step (params, state, grads) -> (new params, new state) through `path`: "fused"
  (jaxfuse.fused_step, params and state donated if `donate`) or "optax" (tx.update then
  optax.apply_updates, donating nothing)."""
  if path == "fused":
    return jax.jit(_fused(tx, **kwargs), donate_argnums=(0, 1) if donate else ())
  step = _protocol(tx, **kwargs)
  return jax.jit(lambda p, s, g: step(p, s, g)[:2])


def copy_tree(tree):
  return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def lockstep(ours, ref, params, steps, *, path, seed=0, grad_scale=None, near_zero=None,
             stochastic=False, state=None, grads=None, on_step=None, algorithm_rtol=0.0):
  """Runs `ours` (a jaxfuse transform) `steps` steps through `path` ("optax": tx.update then
  optax.apply_updates; "fused": jaxfuse.fused_step, donated), each step checked against optax's
  twin `ref` from jaxfuse's own params and state (module docstring). `grads(t, params)` gives
  step t's gradients (default: training_tree); `on_step(t, state)` may return a new state
  (hyperparameters changed mid-run). `algorithm_rtol`: for a step whose algorithm differs from
  the twin's by design (jaxfuse.muon's Newton-Schulz iteration through its Gram matrix), the
  bound of that difference relative to each leaf's largest element, added to every bound.
  The jitted step must trace once. Returns the final (params, state)."""
  grads = grads or (lambda t, p: training_tree(seed * 1000 + t, _packing.unpack(p)))
  kwargs = {} if grad_scale is None else dict(grad_scale=grad_scale)
  fn = _fused(ours, **kwargs) if path == "fused" else _protocol(ours, **kwargs)
  traced = []  # the step (t) at each trace of the jitted step
  step = jax.jit(lambda *args: (traced.append(t), fn(*args))[1],
                 donate_argnums=(0, 1) if path == "fused" else ())
  p = copy_tree(params)
  s = jax.jit(ours.init)(params) if state is None else state
  for t in range(steps):
    if on_step is not None:
      s = on_step(t, s)
    g = grads(t, params)
    g_seen = g if grad_scale is None else jax.tree.map(lambda x: x / grad_scale, g)
    s_in, p_in = reference_inputs(ref, s, p)
    (p_ref, s_ref, u_ref), (p_mag, s_mag, u_mag) = reference_step(ref, _packing.unpack(g_seen),
                                                                  s_in, p_in)
    masks = None if near_zero is None else near_zero(g_seen, s_in)
    out = step(p, s, g)
    # No recompile: the state from init (or the caller) has the types of the step's own, and
    # schedules' and inject_hyperparams' values are data of the step, not constants of a trace.
    assert traced == [0], f"step {t} ({path}) traced the step again"
    p, s = out[0], out[1]
    check = StepCheck(stochastic=stochastic, leaf_rtol=algorithm_rtol)
    master = _keeps_master(s)
    full = jaxfuse.master_params(p, s) if master else _packing.unpack(p)
    mask_leaves = jax.tree.leaves(masks) if masks is not None else [None] * len(
        jax.tree.leaves(p_ref))
    if len(jax.tree.leaves(full)) != len(jax.tree.leaves(p_ref)):
      check.failures.append(f"params have {len(jax.tree.leaves(full))} leaves, optax's "
                            f"{len(jax.tree.leaves(p_ref))}")
    for name, a, e, m, k in zip(_paths(p_ref), jax.tree.leaves(full), jax.tree.leaves(p_ref),
                                jax.tree.leaves(p_mag), mask_leaves):
      # Through the optax protocol a 16-bit param is p + u rounded, u already rounded to its
      # dtype (optax's rule), so its update is what is checked.
      if path == "fused" or master or stochastic or np.asarray(a).dtype.itemsize > 2:
        check.leaf(f"params{name}", a, e, m, k)
    if master and path == "optax":
      # optax's rule: the update has the grads' (bf16) dtype and lands on the master's rounding
      # where the step is at most the param's size (Sterbenz); elsewhere the update's rounding
      # (half an ulp of u) and the sum's (half an ulp of the result) apart, plus the master's
      # own rounding.
      for name, a, m, u in zip(_paths(p_ref), jax.tree.leaves(_packing.unpack(p)),
                               jax.tree.leaves(full), jax.tree.leaves(_packing.unpack(out[2]))):
        a, r = np.asarray(a), np.asarray(jnp.asarray(m).astype(np.asarray(a).dtype))
        if a.dtype.itemsize == 2:
          eps16 = float(jnp.finfo(a.dtype).eps)
          a64, r64, u64 = (np.asarray(x, np.float64) for x in (a, r, u))
          if not np.all(np.abs(a64 - r64) <= eps16 * (np.abs(u64) + np.maximum(np.abs(a64),
                                                                              np.abs(r64)))):
            check.failures.append(f"params{name}: beyond one rounding of the master's")
    ours_s = state_leaves(s)
    ref_s = jax.tree.leaves(s_ref)
    if len(ours_s) != len(ref_s):
      check.failures.append(f"state has {len(ours_s)} leaves, optax's {len(ref_s)}")
    for name, a, e, m in zip(_paths(s_ref), ours_s, ref_s, jax.tree.leaves(s_mag)):
      check.leaf(f"state{name}", a, e, m)
    if path == "optax" and not master and not stochastic:
      for name, a, e, m, k in zip(_paths(u_ref), jax.tree.leaves(_packing.unpack(out[2])),
                                  jax.tree.leaves(u_ref), jax.tree.leaves(u_mag), mask_leaves):
        check.leaf(f"updates{name}", a, e, m, k)
    assert not check.failures, f"step {t} ({path}): " + "\n  ".join(check.failures)
  return p, s
