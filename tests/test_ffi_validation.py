"""Bad input at the FFI layer: every jaxfuse target called directly through jax.ffi.ffi_call.

The Python API checks its arguments at trace time; these tests go around it and hand each handler
wrong operand and result counts, dtypes, shapes and attributes. Each must raise a Python exception
whose message names the problem (never crash the process, never succeed). Errors jaxfuse's own
decoding raises read "<target>: ..." (the handler names its op once, in front); a fixed-type
operand, result or attribute of the wrong type is rejected by XLA's FFI binding before the
handler runs, with XLA's own message.

The operand/result/attribute contracts are in csrc/ (optim/optimizer.h with
optim/families/adam.h, optim/clip.h, decoder/decoder.h); the vector layouts and sizes Python
shares with them come from _ffi.contract(). The tests below build those vectors and lists by
position on purpose: they pin the wire contract (test_vector_layouts_are_pinned checks that the
positions are the contract's).
Each target's bad calls are one table: rows of (id, how the row corrupts a well-formed call, the
expected message). The decoder's whole-model step operands are checked in test_decoder.py.
"""

import contextlib
import functools
import itertools
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfuse._core import ffi as _ffi
from jaxfuse._decode.config import DecoderConfig, DecoderWeights
from jaxfuse._decode.contract import _WEIGHT_KINDS, _workspace_bytes
from helpers import UNPACKED

S = jax.ShapeDtypeStruct
F32, BF16, I32, U8 = jnp.float32, jnp.bfloat16, jnp.int32, jnp.uint8


@contextlib.contextmanager
def jaxfuse_error(op, match):
  """Expects a jaxfuse handler error "<op>: ...<match>" (one line), with the op's name exactly
  once (the handler prefixes it; nothing below it may prefix it again)."""
  with pytest.raises(Exception, match=rf"{op}: .*{match}") as info:
    yield info
  assert str(info.value).count(op) == 1, str(info.value)


def xla_error(match):
  """Expects an error from XLA's FFI binding (operand/result/attribute decoding)."""
  return pytest.raises(Exception, match=match)


def _expect(op, match):
  """XLA's own messages ("Wrong ...", "Unsupported array ...") come before the handler runs, so
  they do not name the op."""
  if match.startswith(("Wrong ", "Unsupported array")):
    return xla_error(match)
  return jaxfuse_error(op, match)


def _rows(*rows):
  """pytest params (bad, match) from rows (id, bad, match)."""
  ids = [row[0] for row in rows]
  assert len(set(ids)) == len(ids), sorted(i for i in ids if ids.count(i) > 1)
  return [pytest.param(bad, match, id=i) for i, bad, match in rows]


def _x64(bad):
  """Marks a row with a 64-bit operand: without jax_enable_x64 while its call is built and made,
  jax would make that operand 32-bit."""
  bad.x64 = True
  return bad


def _x64_if(bad):
  return jax.enable_x64(True) if getattr(bad, "x64", False) else contextlib.nullcontext()


def _rng_array(rng, shape, dtype):
  if jnp.issubdtype(dtype, jnp.complexfloating):
    return np.asarray(rng.standard_normal(shape) + 1j * rng.standard_normal(shape) + 0.5, dtype)
  if jnp.issubdtype(dtype, jnp.floating):
    return np.asarray(rng.standard_normal(shape) + 0.5, dtype)
  return np.asarray(rng.integers(1, 5, shape), dtype)


def _run(call, operands, attrs):
  """Runs an ffi_call under a fresh jit. Eager dispatch would reuse an executable compiled for
  attributes that compare equal (np.int32(1) == np.int64(1), True == np.int64(1)), so a call
  with an attribute of the wrong type would run the earlier, well-typed executable. A plain
  Python int becomes an s64 attribute, the type of jaxfuse's integer attributes."""
  attrs = {k: np.int64(v) if type(v) is int else v for k, v in attrs.items()}
  return jax.block_until_ready(jax.jit(lambda *args: call(*args, **attrs))(*operands))


def _put(device, *arrays):
  return jax.device_put(list(arrays), device)


# ---- jaxfuse_adam (OptimizerOp<Adam>, optimizer.h) ---------------------------------------------
# operands: count s32[], hyper f32/f64[8], grad_ctrl f32/f64[4], then n each of grads, params,
#           mu, nu, [master_params]
#           [param_remainders], then [mu_scales, nu_scales f32[size / 128]] when
#           quantized_states (mu int8, nu uint8 codes), then [rounding_keys u32[n, 3]] when
#           stochastic_rounding
# results:  new count s32[], then n each of params, mu, nu, [master_params | param_remainders],
#           aliased in place
# attributes: num_tensors s64, flags s64 (bit 0: nesterov), master pred, remainders pred,
#             stochastic_rounding pred, quantized_states pred, tensor_flags u8[n] (bit 0: decay)


def _adam_attrs(n=1, **over):
  attrs = dict(num_tensors=np.int64(n), flags=np.int64(0), master=False, remainders=False,
               stochastic_rounding=False, quantized_states=False,
               tensor_flags=np.zeros(n, np.uint8), **UNPACKED)
  attrs.update(over)
  return {k: v for k, v in attrs.items() if v is not None}


# The device vectors and lists by position (test_vector_layouts_are_pinned holds them to the
# contract).
_HYPER = ("learning_rate", "b1", "one_minus_b1", "b2", "one_minus_b2", "eps", "eps_root",
          "weight_decay")
_GRAD_CTRL = ("loss_scale", "clip_div", "clip_mul", "skip")
_NORM_PARAMS = ("loss_scale", "max_norm")
_LISTS = ("grads", "params", "mu", "nu")


def test_vector_layouts_are_pinned():
  """The layouts these tests build by position are the C++ contract's, and so is the Adam and
  decoder operand/result order."""
  adam = _ffi.contract("jaxfuse_adam")
  norm = _ffi.contract("jaxfuse_global_norm")
  assert adam.names["hyper"] == _HYPER
  assert adam.names["grad_ctrl"] == _GRAD_CTRL
  assert adam.names["flags"] == ("nesterov",)
  assert adam.names["tensor_flags"] == ("decay",)
  assert adam.names["fixed_operands"] == ("count", "hyper", "grad_ctrl")
  assert adam.names["fixed_results"] == ("count",)
  for flags in (0, 1):  # nesterov keeps the same lists
    call = lambda **kw: adam.call("lists", **{"flags": flags, "master": 0, "remainders": 0,
                                             "stochastic_rounding": 0, "quantized_states": 0,
                                             **kw}).names
    lists = call()
    assert lists["operands"] == _LISTS and lists["results"] == _LISTS[1:]
    assert lists["trailing_operands"] == ()
    lists = call(master=1)
    assert lists["operands"] == _LISTS + ("master_params",)
    assert lists["results"] == _LISTS[1:] + ("master_params",)
    lists = call(remainders=1, stochastic_rounding=1)
    assert lists["operands"] == _LISTS + ("param_remainders",)
    assert lists["trailing_operands"] == ("rounding_keys",)
    lists = call(master=1, quantized_states=1)
    assert lists["operands"] == _LISTS + ("master_params", "mu_scales", "nu_scales")
  assert adam.numbers["moment_block"] == 128
  assert adam.names["rounding_key"] == ("seed", "leaf", "shard")
  assert norm.names["norm_params"] == _NORM_PARAMS
  assert norm.names["grad_ctrl"] == _GRAD_CTRL
  dec = _ffi.contract("jaxfuse_decoder")
  assert dec.names["operands"] == _OPERANDS
  assert dec.names["results"] == ("out", "k_cache", "v_cache", "logits", "next_tokens",
                                  "workspace")
  assert dec.names["weights"] == _OPERANDS[3:-8]
  assert dec.names["model_operands"] == _OPERANDS[-6:]
  assert dec.names["weight_flags"] == (("always",) * 9 + ("qkv_bias",) * 3 + ("qk_norm",) * 2
                                      + ("quantized",) * 7)
  assert dec.names["weight_kinds"] == (("model",) + ("matrix",) * 4 + ("model",)
                                      + ("matrix",) * 3 + ("model",) * 5 + ("scale",) * 7)
  sizes = dict(num_layers=2, hidden_size=6, num_heads=4, num_kv_heads=2, head_dim=8,
               intermediate_size=10, max_seq_len=5)
  L, D, I, q, kv = 2, 6, 10, 32, 16
  shapes = dec.call("weight_shapes", qkv_bias=1, qk_norm=0, quantized=1, **sizes).shapes
  assert shapes == {"attn_norm": (L, D), "wq": (L, D, q), "wk": (L, D, kv), "wv": (L, D, kv),
                    "wo": (L, q, D), "mlp_norm": (L, D), "w_gate": (L, D, I), "w_up": (L, D, I),
                    "w_down": (L, I, D), "q_bias": (L, q), "k_bias": (L, kv), "v_bias": (L, kv),
                    "q_norm": (L, 0), "k_norm": (L, 0), "wq_scale": (L, q), "wk_scale": (L, kv),
                    "wv_scale": (L, kv), "wo_scale": (L, D), "w_gate_scale": (L, I),
                    "w_up_scale": (L, I), "w_down_scale": (L, D)}
  plain = dec.call("weight_shapes", qkv_bias=0, qk_norm=0, quantized=0, **sizes).shapes
  assert plain["w_up_scale"] == (L, 0) and plain["q_bias"] == (L, 0)


def _adam_fixed(device, seed=0, dtype=np.float32):
  rng = np.random.default_rng(seed)
  # Weight decay on, so that a tensor's decay flag shows in its result.
  hyper = np.array([1e-3, 0.9, 0.1, 0.999, 0.001, 1e-8, 0.0, 0.1], dtype)  # _HYPER
  grad_ctrl = np.array([1.0, 1.0, 1.0, 0.0], dtype)  # _GRAD_CTRL
  return _put(device, np.array(3, np.int32), hyper, grad_ctrl) + [rng]


def _adam_in_place(device, *tensors, master=None, sizes=None, seed=0):
  """Operands, results and aliases of a well-formed in-place call over `tensors` (default one),
  each a dict {list: dtype} (float32 where missing); `master`: the master params' dtype (None:
  no master list). Tensor t has 4 - t elements unless sizes[(t, list)] says otherwise."""
  tensors = tensors or ({},)
  lists = _LISTS + (("master_params",) if master is not None else ())
  n = len(tensors)
  count, hyper, grad_ctrl, rng = _adam_fixed(device, seed)
  bufs = {name: [] for name in lists}
  for t, dtypes in enumerate(tensors):
    for name in lists:
      dt = dtypes.get(name, master if name == "master_params" else F32)
      x = _rng_array(rng, ((sizes or {}).get((t, name), 4 - t),), dt)
      # A second moment is not negative (as a complex one, a real part with no imaginary one).
      bufs[name].append(np.abs(x).astype(x.dtype) if name == "nu" else x)
  ops = [count, hyper, grad_ctrl] + _put(device, *[x for name in lists for x in bufs[name]])
  res = [S((), I32)] + [S(x.shape, x.dtype) for name in lists[1:] for x in bufs[name]]
  aliases = _ffi.aliases(lists, lists[1:], n, operand_offset=3, result_offset=1)
  return ops, res, aliases


def _adam_call(operands, results, aliases, n=1, **attrs):
  call = jax.ffi.ffi_call(_ffi.target("jaxfuse_adam"), results, input_output_aliases=aliases)
  return _run(call, operands, _adam_attrs(n, **attrs))


def test_adam_good_call_succeeds(device):
  """The harness itself is right: well-formed calls over two tensors (float32 and bfloat16)
  run, and each tensor's decay flag reaches that tensor only."""
  ops, res, aliases = _adam_in_place(device, {}, {k: BF16 for k in _LISTS})
  params = lambda out: [np.asarray(x, np.float32) for x in out[1:3]]
  decayed = _adam_call(ops, res, aliases, 2, tensor_flags=np.array([1, 0], np.uint8))
  assert int(decayed[0]) == 4
  assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in decayed[1:])
  plain = _adam_call(ops, res, aliases, 2)
  assert not np.array_equal(params(decayed)[0], params(plain)[0])
  np.testing.assert_array_equal(params(decayed)[1], params(plain)[1])
  nesterov = _adam_call(ops, res, aliases, 2, flags=np.int64(1))
  assert int(nesterov[0]) == 4 and not np.array_equal(params(nesterov)[0], params(plain)[0])


def test_adam_master_params(device):
  """Master params are in the compute type: float32, or float64 when a buffer is float64."""
  ops, res, aliases = _adam_in_place(device, {"params": BF16}, master=F32)
  out = _adam_call(ops, res, aliases, master=True)
  # The params are the rounded master copy.
  np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(out[4].astype(BF16)))
  ops, res, aliases = _adam_in_place(device, {"params": BF16}, master=BF16)
  with jaxfuse_error("jaxfuse_adam", r"master params of tensor 0 must be float32 \(the compute"):
    _adam_call(ops, res, aliases, master=True)
  with jax.enable_x64(True):
    ops, res, aliases = _adam_in_place(device, {"grads": jnp.float64}, master=jnp.float64)
    _adam_call(ops, res, aliases, master=True)
    ops, res, aliases = _adam_in_place(device, {}, {"grads": jnp.float64}, master=F32)
    with jaxfuse_error("jaxfuse_adam", "master params of tensor 0 must be float64"):
      _adam_call(ops, res, aliases, 2, master=True)


def test_adam_float64_vectors(device):
  """Under jax_enable_x64 the vectors are float64; the kernel reads either."""
  with jax.enable_x64(True):
    ops, res, aliases = _adam_in_place(device)
    ops[1:3] = _put(device, *[np.asarray(x, np.float64) for x in ops[1:3]])
    with_f64 = _adam_call(ops, res, aliases)
  ops, res, aliases = _adam_in_place(device)
  # Equal but for the bias corrections, which a float64 vector has computed in double.
  for a, b in zip(with_f64, _adam_call(ops, res, aliases)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5)


@pytest.mark.parametrize("lst", _LISTS)
def test_adam_tensor_float64(device, lst):
  """A float64 buffer in any list is taken: the call then computes in double."""
  with jax.enable_x64(True):
    ops, res, aliases = _adam_in_place(device, {lst: jnp.float64})
    assert ops[3 + _LISTS.index(lst)].dtype == jnp.float64
    out = _adam_call(ops, res, aliases)
    assert all(np.isfinite(np.asarray(x)).all() for x in out[1:])


def test_adam_complex_and_real_tensors(device):
  """Adam takes complex tensors, but one call takes real or complex tensors, not both."""
  complex64 = {k: jnp.complex64 for k in _LISTS}
  ops, res, aliases = _adam_in_place(device, complex64, complex64)
  out = _adam_call(ops, res, aliases, 2)
  assert all(np.isfinite(np.asarray(x)).all() for x in out[1:])
  ops, res, aliases = _adam_in_place(device, {}, complex64)
  with jaxfuse_error("jaxfuse_adam", r"tensor 1 is complex, tensor 0 is not \(one call takes"):
    _adam_call(ops, res, aliases, 2)


def test_adam_packed_lists(device):
  """Packed mu and nu (tensor_lists.h's PackedLists): one buffer each, tensor t's elements at its
  offset. A good call equals the per-tensor call on those elements and leaves the gaps alone;
  offsets outside the buffer, overlapping tensors and mismatched attributes are refused."""
  ops, res, aliases = _adam_in_place(device, {}, {})  # tensors of 4 and 3 elements
  reference = [np.asarray(x) for x in _adam_call(ops, res, aliases, 2)]
  offsets = [1, 9]
  packed = []
  for k in (2, 3):  # mu, nu: their two tensors at the offsets, the rest 7s
    buf = np.full((13,), 7.0, np.float32)
    for t, at in enumerate(offsets):
      buf[at:at + 4 - t] = np.asarray(ops[3 + 2 * k + t])
    packed.append(buf)
  operands = ops[:7] + _put(device, *packed)
  results = res[:3] + [S((13,), F32)] * 2
  attrs = dict(packed_lists=np.int64(0b1100), tensor_sizes=np.array([4, 3], np.int64))
  call = lambda offs, **over: _adam_call(operands, results, {5: 1, 6: 2, 7: 3, 8: 4}, 2,
                                         **{**attrs, "packed_offsets": np.array(offs, np.int64),
                                            **over})
  out = [np.asarray(x) for x in call(offsets * 2)]
  for i in range(3):
    np.testing.assert_array_equal(out[i], reference[i])
  for k, buf in enumerate(out[3:]):
    for t, at in enumerate(offsets):
      np.testing.assert_array_equal(buf[at:at + 4 - t], reference[3 + 2 * k + t])
    assert (np.delete(buf, np.r_[1:5, 9:12]) == 7.0).all()
  with jaxfuse_error("jaxfuse_adam", r"packed list 'mu' tensor 1: elements \[11, 14\) outside its "
                                     r"buffer of 13"):
    call([1, 11, 1, 9])
  with jaxfuse_error("jaxfuse_adam", "packed list 'nu': two tensors overlap at element 3"):
    call([1, 9, 0, 3])
  with jaxfuse_error("jaxfuse_adam", "packed_offsets has 2 entries and tensor_sizes 2, expected 4"):
    call([1, 9])
  with jaxfuse_error("jaxfuse_adam", "tensor 0: list 'grads' has 4 elements, tensor_sizes says 5"):
    call(offsets * 2, tensor_sizes=np.array([5, 3], np.int64))
  with jaxfuse_error("jaxfuse_adam", "packed_lists 16 names lists beyond the call's 4"):
    call(offsets * 2, packed_lists=np.int64(16))


def _adam_good(device, *tensors, master_dtype=None, sizes=None, ops=None, res=None,
               unaliased=None, **call):
  """_adam_call's arguments for a well-formed call over `tensors` (_adam_in_place's; master params
  on with `master_dtype`), then corrupted as a row says: `ops` and `res` replace operands and
  results by index (one past the end appends), `unaliased` drops that operand's alias, and `call`
  replaces operands, results or aliases whole, or sets attributes."""
  operands, results, aliases = _adam_in_place(device, *tensors, master=master_dtype, sizes=sizes)
  for good, new in ((operands, ops or {}), (results, res or {})):
    for i, x in new.items():
      good[i:i + 1] = [x]
  aliases.pop(unaliased, None)
  call = {"operands": operands, "results": results, "aliases": aliases, "n": len(tensors) or 1,
          "master": master_dtype is not None, **call}
  call["operands"] = jax.device_put(call["operands"], device)
  return call


_MASTER_LISTS = _LISTS + ("master_params",)
_FITS = (r"4 tensor operands and 3 tensor results do not fit num_tensors={} "
         r"\(expected 4 and 3 per tensor\)")

# Each row's `bad` gets a function that makes a good call's arguments (_adam_good).
_ADAM_BAD = _rows(
    # The fixed operands and result (fixed types: XLA's binding checks those).
    ("count_f32", lambda g: g(ops={0: np.float32(3)}),
     "Wrong buffer dtype: expected S32 but got F32"),
    ("count_rank1", lambda g: g(ops={0: np.array([3], np.int32)}),
     "Wrong buffer rank: expected 0 but got 1"),
    ("count_s64", _x64(lambda g: g(ops={0: np.array(3, np.int64)})),
     "Wrong buffer dtype: expected S32 but got S64"),
    ("hyper_bf16", lambda g: g(ops={1: np.zeros(8, BF16)}), "hyper must be float32 or float64"),
    ("hyper_rank2", lambda g: g(ops={1: np.zeros((2, 4), F32)}), "hyper must have rank 1, got 2"),
    *[(f"hyper_{k}", lambda g, k=k: g(ops={1: np.zeros(k, F32)}),
       f"hyper has {k} elements, expected 8") for k in (3, 9)],
    ("grad_ctrl_i32", lambda g: g(ops={2: np.ones(4, I32)}),
     "grad_ctrl must be float32 or float64"),
    ("grad_ctrl_5", lambda g: g(ops={2: np.ones(5, F32)}), "grad_ctrl has 5 elements, expected 4"),
    ("grad_ctrl_scalar", lambda g: g(ops={2: np.float32(1)}), "grad_ctrl must have rank 1, got 0"),
    ("new_count_f32", lambda g: g(res={0: S((), F32)}),
     "Wrong buffer dtype: expected S32 but got F32"),
    ("new_count_rank1", lambda g: g(res={0: S((1,), I32)}),
     "Wrong buffer rank: expected 0 but got 1"),
    # A non-float buffer in any list is named (list and tensor index).
    *[(f"{lst}_{np.dtype(dt).name}", lambda g, lst=lst, dt=dt: g({lst: dt}, master_dtype=F32),
       rf"list '{lst}' tensor 0: unsupported dtype")
      for lst, dt in itertools.product(_MASTER_LISTS, [I32, U8, jnp.bool_])],
    # A tensor's lists are all complex or all real.
    *[(f"{lst}_complex", lambda g, lst=lst: g({lst: jnp.complex64}, master_dtype=F32),
       rf"tensor 0: list '{lst}' is complex, list 'grads' is not") for lst in _MASTER_LISTS[1:]],
    # Tensor 1 of two has a list whose element count differs from its grads.
    *[(f"{lst}_5_elements", lambda g, lst=lst: g({}, {}, master_dtype=F32, sizes={(1, lst): 5}),
       rf"tensor 1: list '{lst}' has 5 elements, list 'grads' has 3")
      for lst in _MASTER_LISTS[1:]],
    # Every result list is updated in place: a missing alias is named (list and tensor).
    *[(f"{lst}_{t}_unaliased",
       lambda g, k=3 + 2 * _MASTER_LISTS.index(lst) + t: g({}, {}, master_dtype=F32, unaliased=k),
       rf"output '{lst}' of tensor {t} is not aliased")
      for lst, t in [("params", 0), ("mu", 1), ("nu", 0), ("master_params", 1)]],
    ("none_aliased", lambda g: g(aliases={}), "output 'params' of tensor 0 is not aliased"),
    *[(f"flags_{f}", lambda g, f=f: g(flags=f),
       rf"flags {f} has bits beyond the 1 flags of the op") for f in (-1, 2, 4, 2**40)],
    *[(f"tensor_flags_{name}", lambda g, f=f: g({}, {}, tensor_flags=np.array(f, np.uint8)), m)
      for name, f, m in [
          ("none", [], "tensor_flags has 0 entries, expected num_tensors=2"),
          ("3", [0, 0, 0], "tensor_flags has 3 entries, expected num_tensors=2"),
          ("bit1", [0, 2], "tensor_flags entry 1 is 2, expected < 2"),  # no such tensor flag
          ("255", [255, 1], "tensor_flags entry 0 is 255, expected < 2")]],
    # num_tensors is checked against tensor_flags' entries, then the operand count, before
    # anything is sized by it.
    *[(f"num_tensors_{n}", lambda g, n=n: g(num_tensors=n),
       f"tensor_flags has 1 entries, expected num_tensors={n}")
      for n in (-1, -(2**62), 2**62, 2**63 - 1)],
    *[(f"num_tensors_{n}", lambda g, n=n: g(num_tensors=n, tensor_flags=np.zeros(n, np.uint8)),
       _FITS.format(n)) for n in (0, 2, 3)],
    ("operand_extra", lambda g: g(ops={7: np.ones(4, F32)}),
     "5 tensor operands and 3 tensor results do not fit"),
    ("result_missing", lambda g: g(results=[S((), I32)] + [S((4,), F32)] * 2, aliases={4: 1, 5: 2}),
     "4 tensor operands and 2 tensor results do not fit"),
    ("result_extra", lambda g: g(res={4: S((4,), F32)}),
     "4 tensor operands and 4 tensor results do not fit"),
    ("no_tensor_results", lambda g: g(results=[S((), I32)], aliases={}),
     "4 tensor operands and 0 tensor results do not fit"),
    ("two_operands", lambda g: g(operands=[np.array(3, np.int32), np.zeros(8, F32)],
                                 results=[S((), I32)], aliases={}), "Wrong number of arguments"),
    ("master_without_lists", lambda g: g(master=True),
     r"do not fit num_tensors=1 \(expected 5 and 4 per tensor\)"),
    ("master_lists_unflagged", lambda g: g(master_dtype=F32, master=False),
     r"do not fit num_tensors=1 \(expected 4 and 3 per tensor\)"),
    # Attribute types.
    ("num_tensors_s32", lambda g: g(num_tensors=np.int32(1)),
     "Wrong scalar data type: expected S64 but got S32"),
    ("flags_pred", lambda g: g(flags=True), "Wrong scalar data type: expected S64 but got PRED"),
    ("master_s64", lambda g: g(master=np.int64(0)),
     "Wrong scalar data type: expected PRED but got S64"),
    ("tensor_flags_s32", lambda g: g(tensor_flags=np.zeros(1, np.int32)),
     "Wrong array data type: expected U8 but got S32"),
    ("tensor_flags_scalar", lambda g: g(tensor_flags=np.uint8(0)),
     "Wrong attribute type: expected array but got scalar"),
    ("tensor_flags_bool", lambda g: g(tensor_flags=np.zeros(1, bool)),
     "Unsupported array element type for attribute: tensor_flags"),
    ("no_flags", lambda g: g(flags=None), "Wrong number of attributes: expected 10 but got 9"),
    ("packed_offsets_s32", lambda g: g(packed_offsets=np.zeros(0, np.int32)),
     "Wrong array data type: expected S64 but got S32"),
)


@pytest.mark.parametrize("bad, match", _ADAM_BAD)
def test_adam_bad_call(device, bad, match):
  with _x64_if(bad):
    call = bad(functools.partial(_adam_good, device))
    with _expect("jaxfuse_adam", match):
      _adam_call(**call)


# ---- trust-ratio families: jaxfuse_lamb (Adam's operands, then trust_sums u32[rows, n, 4]) and
# its first pass jaxfuse_lamb_trust_sums (the same fixed operands, grads, params, mu, nu; results
# sums u32[n, 4] and a workspace of 16 bytes per multi-tensor chunk) ----------------------------


def _lamb_call(operands, results, aliases, trust_sums):
  call = jax.ffi.ffi_call(_ffi.target("jaxfuse_lamb"), results, input_output_aliases=aliases)
  attrs = _adam_attrs(1, tensor_flags=None)
  attrs["tensor_flags"] = np.zeros(1, np.uint8)
  return _run(call, operands + trust_sums, attrs)


def test_lamb_trust_sums_operand(device):
  """The sums operand must be u32[rows, num_tensors, 4] after the lists; zero sums keep ratio 1."""
  ops, res, aliases = _adam_in_place(device)
  good = _put(device, np.zeros((2, 1, 4), np.uint32))
  out = _lamb_call(ops, res, aliases, good)
  assert int(out[0]) == 4 and np.isfinite(np.asarray(out[1])).all()
  with jaxfuse_error("jaxfuse_lamb", r"trust_sums is u32\[1, 2, 4\], expected u32\[rows, 1, 4\]"):
    _lamb_call(ops, res, aliases, _put(device, np.zeros((1, 2, 4), np.uint32)))
  with jaxfuse_error("jaxfuse_lamb", r"trust_sums: "):
    _lamb_call(ops, res, aliases, _put(device, np.zeros((1, 1, 4), np.int32)))
  with jaxfuse_error("jaxfuse_lamb", r"expected 4 and 3 per tensor, then trust_sums"):
    _lamb_call(ops, res, aliases, [])


def test_lamb_trust_sums_workspace(device):
  """The first pass's workspace must be the size its chunks need."""
  ops, _, _ = _adam_in_place(device)
  contract = _ffi.contract("jaxfuse_lamb_trust_sums")
  words, partial = contract.numbers["sum_words"], contract.numbers["partial_bytes"]

  def call(workspace_bytes):
    c = jax.ffi.ffi_call(_ffi.target("jaxfuse_lamb_trust_sums"),
                         [S((1, words), jnp.uint32), S((workspace_bytes,), U8)])
    return _run(c, ops, dict(num_tensors=np.int64(1), flags=np.int64(0),
                             tensor_flags=np.zeros(1, np.uint8), **UNPACKED))

  sums, _ = call(partial)  # one tensor of 4 elements: one chunk
  assert np.asarray(sums).any()
  with jaxfuse_error("jaxfuse_lamb_trust_sums", f"workspace has {2 * partial} bytes, expected "
                                                f"{partial}"):
    call(2 * partial)


# ---- jaxfuse_global_norm -----------------------------------------------------------------------
# operands: norm_params f32/f64[2], peer_sums u32[R, 4], n grads
# results:  norm f32/f64[], grad_ctrl f32/f64[4], workspace u8[workspace_bytes], own_sum u32[4]

# The partials workspace: its size in bytes from the C++ contract.
_WORKSPACE = _ffi.contract("jaxfuse_global_norm").numbers["workspace_bytes"]
_NORM_RESULTS = [S((), F32), S((4,), F32), S((_WORKSPACE,), U8), S((4,), jnp.uint32)]
_NO_PEERS = np.zeros((0, 4), np.uint32)


def _norm_call(operands, results=_NORM_RESULTS, **attrs):
  a = {"clip": True, "skip_nonfinite": False, "clip_apply_loss_scale": True, **attrs}
  call = jax.ffi.ffi_call(_ffi.target("jaxfuse_global_norm"), results)
  return _run(call, operands, {k: v for k, v in a.items() if v is not None})


def _norm_operands(device, *dtypes, seed=2):
  rng = np.random.default_rng(seed)
  norm_params = np.array([1.0, 1.0], np.float32)  # _NORM_PARAMS: loss scale, max norm
  return _put(device, norm_params, _NO_PEERS,
              *[_rng_array(rng, (4 + i,), dt) for i, dt in enumerate(dtypes)])


def test_norm_good_call_succeeds(device):
  ops = _norm_operands(device, F32, BF16)
  norm, grad_ctrl, _, _ = _norm_call(ops)
  expect = np.sqrt(sum(float(np.sum(np.asarray(x, np.float64) ** 2)) for x in ops[2:]))
  np.testing.assert_allclose(float(norm), expect, rtol=1e-5)
  assert grad_ctrl.shape == (4,)


def _sum_rows(*trees):
  """NormSum rows (the bits of a float64 sum of squares and a zero non-finite marker)."""
  sums = np.array([[sum(float(np.sum(np.asarray(x, np.float64) ** 2)) for x in t), 0.0]
                   for t in trees])
  return sums.view(np.uint32).reshape(len(trees), 4)


def test_norm_own_sum_and_peer_rows(device):
  """own_sum is the bits of the call's float64 sum of squares; peer rows are added to it."""
  ops = _norm_operands(device, F32, BF16)
  _, _, _, own = _norm_call(ops)
  np.testing.assert_array_equal(np.asarray(own).view(np.float64),
                                _sum_rows(ops[2:])[0].view(np.float64))
  peers = _sum_rows(ops[2:3], ops[3:4])  # two devices' rows, no gradients of its own
  norm, _, _, own = _norm_call([ops[0], jax.device_put(peers, device)])
  np.testing.assert_array_equal(np.asarray(own), np.zeros(4, np.uint32))
  np.testing.assert_allclose(float(norm), np.sqrt(_sum_rows(ops[2:]).view(np.float64)[0, 0]),
                             rtol=1e-7)


def test_norm_grads_float64_and_complex(device):
  """float64 and complex grads are taken (a complex element counts as its two parts), with the
  norm and control vector in float64 or float32."""
  with jax.enable_x64(True):
    ops = _norm_operands(device, jnp.float64, jnp.complex128, jnp.complex64)
    assert ops[2].dtype == jnp.float64
    expect = np.sqrt(sum(float(np.sum(np.abs(np.asarray(x, np.complex128)) ** 2))
                         for x in ops[2:]))
    for dt in (jnp.float64, F32):
      norm, *_ = _norm_call(ops, [S((), dt), S((4,), dt), S((_WORKSPACE,), U8), _NORM_RESULTS[3]])
      np.testing.assert_allclose(float(norm), expect, rtol=4 * float(jnp.finfo(dt).eps))


_NORM, _GCTRL, _PART, _OWN = _NORM_RESULTS


def _norm_op(i, x):
  """Row: operand i of the good call replaced by x."""
  return lambda ops: dict(operands=ops[:i] + [x] + ops[i + 1:])


def _norm_res(*results):
  return lambda ops: dict(results=list(results))


# Each row's `bad` gets a good call's operands (norm_params, peer_sums, one float32 grad).
_NORM_BAD = _rows(
    ("norm_params_3", _norm_op(0, np.ones(3, F32)), "norm_params has 3 elements, expected 2"),
    ("norm_params_f16", _norm_op(0, np.ones(2, np.float16)),
     "norm_params must be float32 or float64"),
    ("norm_params_rank2", _norm_op(0, np.ones((1, 2), F32)),
     "norm_params must have rank 1, got 2"),
    ("no_operands", lambda ops: dict(operands=[]), "Wrong number of arguments"),
    ("peer_sums_3_words", _norm_op(1, np.zeros((2, 3), np.uint32)),
     "peer_sums rows have 3 words, expected 4"),
    ("peer_sums_f32", _norm_op(1, np.zeros((2, 4), F32)),
     "Wrong buffer dtype: expected U32 but got F32"),
    *[(f"grads_{np.dtype(dt).name}", lambda ops, dt=dt: dict(operands=ops + [np.ones(5, dt)]),
       "list 'grads' tensor 1: unsupported dtype") for dt in (I32, U8, jnp.bool_)],
    ("norm_rank1", _norm_res(S((1,), F32), _GCTRL, _PART, _OWN), "norm must have rank 0, got 1"),
    ("norm_bf16", _norm_res(S((), BF16), _GCTRL, _PART, _OWN), "norm must be float32 or float64"),
    *[(f"grad_ctrl_{k}", _norm_res(_NORM, S((k,), F32), _PART, _OWN),
       f"grad_ctrl result has {k} elements, expected 4") for k in (3, 5)],
    *[(f"workspace_{name}", _norm_res(_NORM, _GCTRL, S((size,), U8), _OWN),
       f"workspace has {size} bytes, expected {_WORKSPACE}")
      for name, size in [("short", _WORKSPACE - 1), ("double", 2 * _WORKSPACE)]],
    ("workspace_f32", _norm_res(_NORM, _GCTRL, S((_WORKSPACE // 4,), F32), _OWN),
     "Wrong buffer dtype: expected U8 but got F32"),
    ("own_sum_5", _norm_res(_NORM, _GCTRL, _PART, S((5,), jnp.uint32)),
     "own_sum has 5 words, expected 4"),
    ("results_3", _norm_res(_NORM, _GCTRL, _PART), "Wrong number of results: expected 4 but got 3"),
    ("results_5", _norm_res(_NORM, _GCTRL, _PART, _OWN, _GCTRL),
     "Wrong number of results: expected 4 but got 5"),
    ("clip_s64", lambda ops: dict(clip=np.int64(1)),
     "Wrong scalar data type: expected PRED but got S64"),
    ("attributes_2", lambda ops: dict(clip_apply_loss_scale=None),
     "Wrong number of attributes: expected 3 but got 2"),
)


@pytest.mark.parametrize("bad, match", _NORM_BAD)
def test_norm_bad_call(device, bad, match):
  ops = _norm_operands(device, F32)
  call = {"operands": ops, **bad(ops)}
  with _expect("jaxfuse_global_norm", match):
    _norm_call(jax.device_put(call.pop("operands"), device), **call)


# ---- jaxfuse_decoder ---------------------------------------------------------------------------
# operands: x, positions, rope_inv_freq, 21 weights, k_cache, v_cache, then the whole-model
# step's (empty here: test_decoder.py checks them); results: out, k_cache, v_cache, logits,
# next_tokens, workspace; attributes: the DecoderConfig fields but rope_theta and rope_scaling
# (which make rope_inv_freq), and model_step, sample, timeline, stage_kernels, temperature,
# top_k, top_p.
# Tiny config; batch 4.

# Every optional weight in use, so that each operand's checks are exercised: int8 matrices.
_CFG = DecoderConfig(num_layers=1, hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8,
                     intermediate_size=24, max_seq_len=4, qkv_bias=True, qk_norm=True,
                     quantization="int8")
_B = 4
_WEIGHTS = DecoderWeights._fields
_OPERANDS = ("x", "positions", "rope_inv_freq", *_WEIGHTS, "k_cache", "v_cache", "tokens", "embed",
             "final_norm", "lm_head", "lm_head_scale", "sample_key")
_CACHE_ALIASES = {_OPERANDS.index("k_cache"): 1, _OPERANDS.index("v_cache"): 2}


def _dec_attrs(**over):
  c = _CFG
  attrs = dict(num_layers=np.int64(c.num_layers), hidden_size=np.int64(c.hidden_size),
               num_heads=np.int64(c.num_heads), num_kv_heads=np.int64(c.num_kv_heads),
               head_dim=np.int64(c.head_dim), intermediate_size=np.int64(c.intermediate_size),
               max_seq_len=np.int64(c.max_seq_len), rms_norm_eps=np.float32(c.rms_norm_eps),
               qkv_bias=np.bool_(c.qkv_bias), qk_norm=np.bool_(c.qk_norm),
               quantized=np.bool_(c.quantized), model_step=np.bool_(False),
               sample=np.bool_(False), timeline=np.bool_(False),
               stage_kernels=np.bool_(False), temperature=np.float32(0.0),
               top_k=np.int64(0), top_p=np.float32(1.0))
  attrs.update(over)
  return {k: v for k, v in attrs.items() if v is not None}


def _dec_operands(device, seed=3):
  """A well-formed call's operands as a dict (numpy, not yet on the device)."""
  rng = np.random.default_rng(seed)
  ops = {"x": rng.standard_normal((_B, _CFG.hidden_size)).astype(np.float32),
         "positions": np.arange(_B, dtype=np.int32) % _CFG.max_seq_len,
         "rope_inv_freq": _CFG.rope_inv_freq()}
  for name, shape in _CFG.weight_shapes().items():
    if _WEIGHT_KINDS[name] == "matrix":
      ops[name] = rng.integers(-127, 128, shape).astype(np.int8)
    else:
      ops[name] = (0.2 * rng.standard_normal(shape)).astype(np.float32)
  ops["k_cache"] = rng.standard_normal(_CFG.cache_shape(_B)).astype(np.float32)
  ops["v_cache"] = rng.standard_normal(_CFG.cache_shape(_B)).astype(np.float32)
  D = _CFG.hidden_size
  ops.update(tokens=np.zeros((0,), np.int32), embed=np.zeros((0, D), np.float32),
             final_norm=np.zeros((0,), np.float32), lm_head=np.zeros((0, D), np.float32),
             lm_head_scale=np.zeros((0,), np.float32), sample_key=np.zeros((0,), np.uint32))
  return ops


def _dec_call(device, ops, results=None, aliases=None, operand_list=None, **attrs):
  """Calls jaxfuse_decoder; `results` default to the shapes of x and the caches."""
  args = operand_list if operand_list is not None else [ops[k] for k in _OPERANDS]
  args = jax.device_put(args, device)
  if results is None:
    results = _dec_results(ops)
  aliases = _CACHE_ALIASES if aliases is None else aliases
  call = jax.ffi.ffi_call(_ffi.target("jaxfuse_decoder"), results, input_output_aliases=aliases)
  return _run(call, args, _dec_attrs(**attrs))


def _dec_results(ops, ws_bytes=None, ws_dtype=U8):
  x, k, v = ops["x"], ops["k_cache"], ops["v_cache"]
  if ws_bytes is None:
    ws_bytes = _workspace_bytes(_CFG, x.shape[0], x.dtype)
  return [S(x.shape, x.dtype), S(k.shape, k.dtype), S(v.shape, v.dtype), S((x.shape[0], 0), F32),
          S((0,), np.int32), S((ws_bytes,), ws_dtype)]


def test_decoder_good_call_succeeds(device):
  ops = _dec_operands(device)
  out, k, *_ = _dec_call(device, ops)
  assert out.shape == (_B, _CFG.hidden_size) and np.isfinite(np.asarray(out)).all()
  assert not np.array_equal(np.asarray(k), ops["k_cache"])  # the new k/v were written


_SIZE_ATTRS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
               "intermediate_size", "max_seq_len")


_OVERFLOW_SCRIPT = """
import sys
import jax, numpy as np
sys.path.insert(0, {tests!r})
import test_ffi_validation as t
device = jax.devices({platform!r})[0]
try:
  t._dec_call(device, t._dec_operands(device), num_heads=np.int64(2**62 + 2))
  print("NO ERROR")
except Exception as e:
  print("ERROR:", e)
"""


def test_decoder_overflowing_sizes_are_rejected(device):
  """num_heads = 2^62 + 2 makes num_heads * head_dim wrap around to the real 16 columns of wq, and
  with batch 4 the workspace size wraps to the real one too: without the range check the handler
  accepted the call and ran 2^62 heads over 2 heads' buffers (segfault). Run in a subprocess, so
  that a regression fails this test instead of killing the test run."""
  script = _OVERFLOW_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__)),
                                   platform=device.platform)
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, f"exit status {proc.returncode}\n{proc.stderr[-2000:]}"
  assert f"jaxfuse_decoder: num_heads={2**62 + 2} must be a positive integer" in proc.stdout, \
      proc.stdout + proc.stderr[-2000:]
  assert proc.stdout.count("jaxfuse_decoder") == 1, proc.stdout


_K_CACHE = _OPERANDS.index("k_cache")
_NEED = _workspace_bytes(_CFG, _B, F32)  # the good call's workspace size


def _dec_attr(**attrs):
  """Row: attributes over the good call's."""
  return lambda ops: attrs


def _dec_op(name, bad):
  """Row: operand `name` replaced by bad(the good one); the results follow the new operands."""
  return lambda ops: dict(ops=dict(ops, **{name: bad(ops[name])}))


def _dec_x(ops, x):
  """x replaced by `x`, with the out result of its shape and dtype."""
  return dict(ops=dict(ops, x=x), results=[S(x.shape, x.dtype)] + _dec_results(ops)[1:])


def _dec_weight_rows(name):
  """A weight cut short, flattened, and of another dtype (the matrices' dtype is wq's)."""
  want = re.escape("[" + ",".join(str(s) for s in _CFG.weight_shapes()[name]) + "]")
  if name == "wq":
    dtype = "wq must be int8 or float8_e4m3fn when quantized is set"
  else:
    dtype = rf"{name} must have dtype {'int8' if _WEIGHT_KINDS[name] == 'matrix' else 'float32'}"
  return [(f"{name}_short", _dec_op(name, lambda w: w[..., :-1]),
           rf"{name} does not have shape {want}"),
          (f"{name}_flat", _dec_op(name, lambda w: w.reshape(-1)), rf"{name} does not have shape"),
          (f"{name}_bf16", _dec_op(name, lambda w: w.astype(BF16)), dtype)]


# Each row's `bad` gets the good call's operands and returns _dec_call's arguments over them.
_DEC_BAD = _rows(
    *[(f"{name}_{v}", _dec_attr(**{name: v}),
       rf"{name}={v} must be a positive integer below")
      for name, v in [(n, v) for n in _SIZE_ATTRS for v in (0, -3)] +
      [("max_seq_len", 2**31 - 1), ("hidden_size", 2**62), ("num_layers", -(2**63))]],
    ("head_dim_7", _dec_attr(head_dim=7), "head_dim=7 must be even"),
    ("num_heads_3_of_2", _dec_attr(num_heads=3, num_kv_heads=2),
     "num_heads=3 is not a multiple of num_kv_heads=2"),
    ("num_kv_heads_3", _dec_attr(num_kv_heads=3),
     "num_heads=2 is not a multiple of num_kv_heads=3"),
    *[(f"rms_norm_eps_{v}", _dec_attr(rms_norm_eps=np.float32(v)),
       f"rms_norm_eps={v} must be finite and >= 0") for v in ("-1", "nan", "inf")],
    # Attributes that do not fit the operands.
    ("num_layers_2", _dec_attr(num_layers=2), r"attn_norm does not have shape \[2,16\]"),
    ("hidden_size_32", _dec_attr(hidden_size=32), r"x must have shape \[B, 32\]"),
    ("num_heads_4", _dec_attr(num_heads=4), r"wq does not have shape \[1,16,32\]"),
    ("num_kv_heads_2", _dec_attr(num_kv_heads=2), r"wk does not have shape \[1,16,16\]"),
    *[(f"head_dim_{d}", _dec_attr(head_dim=d),
       rf"rope_inv_freq must have shape \[{d // 2}\] \(head_dim / 2\)") for d in (4, 16)],
    ("no_qkv_bias", _dec_attr(qkv_bias=False), r"q_bias does not have shape \[1,0\]"),
    ("no_qk_norm", _dec_attr(qk_norm=False), r"q_norm does not have shape \[1,0\]"),
    ("intermediate_size_32", _dec_attr(intermediate_size=32),
     r"w_gate does not have shape \[1,16,32\]"),
    *[(f"max_seq_len_{s}", _dec_attr(max_seq_len=s),
       rf"k_cache does not have shape \[1,4,{s},1,8\]") for s in (8, 2)],
    ("not_quantized", _dec_attr(quantized=False), r"wq must have dtype float32"),
    # Attribute types and count.
    ("rms_norm_eps_f64", _dec_attr(rms_norm_eps=np.float64(1e-5)),
     "Wrong scalar data type: expected F32 but got F64"),
    ("qk_norm_s64", _dec_attr(qk_norm=np.int64(1)),
     "Wrong scalar data type: expected PRED but got S64"),
    ("num_layers_s32", _dec_attr(num_layers=np.int32(1)),
     "Wrong scalar data type: expected S64 but got S32"),
    ("no_qkv_bias_attribute", _dec_attr(qkv_bias=None),
     "Wrong number of attributes: expected 18 attributes but got 17"),
    # Operands.
    ("rope_short", _dec_op("rope_inv_freq", lambda t: t[:-1]),
     r"rope_inv_freq must have shape \[4\] \(head_dim / 2\)"),
    ("rope_bf16", _dec_op("rope_inv_freq", lambda t: t.astype(BF16)),
     "Wrong buffer dtype: expected F32 but got BF16"),
    ("x_int32", lambda ops: dict(ops=dict(ops, x=ops["x"].astype(np.int32)),
                                 results=_dec_results(ops)),
     "x must be float32, bfloat16 or float16"),
    ("x_float64", _x64(lambda ops: _dec_x(ops, ops["x"].astype(np.float64))),
     "x must be float32, bfloat16 or float16"),
    *[(f"x_{'x'.join(map(str, shape))}", lambda ops, shape=shape: _dec_x(ops, np.ones(shape, F32)),
       r"x must have shape \[B, 16\]") for shape in [(1, _B, 16), (_B * 16,), (_B, 17)]],
    ("positions_f32", _dec_op("positions", lambda p: p.astype(F32)),
     "Wrong buffer dtype: expected S32 but got F32"),
    ("positions_s64", _x64(_dec_op("positions", lambda p: p.astype(np.int64))),
     "Wrong buffer dtype: expected S32 but got S64"),
    ("positions_rank2", _dec_op("positions", lambda p: p[None]),
     "Wrong buffer rank: expected 1 but got 2"),
    ("positions_5", _dec_op("positions", lambda p: np.arange(_B + 1, dtype=np.int32)),
     r"positions must have shape \[4\]"),
    *itertools.chain.from_iterable(_dec_weight_rows(name) for name in _WEIGHTS),
    *[(f"{cache}_{what}", _dec_op(cache, bad), rf"{cache} does not have shape \[1,4,4,1,8\]")
      for cache, what, bad in [("k_cache", "batch_2", lambda c: c[:, :2]),
                               ("v_cache", "head_dim_4", lambda c: c[..., :4]),
                               ("k_cache", "rank4", lambda c: c[0])]],
    *[(f"{cache}_{np.dtype(dt).name}", _dec_op(cache, lambda c, dt=dt: c.astype(dt)),
       rf"{cache} must have dtype float32") for cache, dt in [("k_cache", BF16),
                                                              ("v_cache", np.int32)]],
    ("operand_extra", lambda ops: dict(operand_list=[ops[k] for k in _OPERANDS] + [ops["x"]]),
     f"Wrong number of arguments: expected {len(_OPERANDS)} but got {len(_OPERANDS) + 1}"),
    ("operand_missing",  # the caches move up one place
     lambda ops: dict(operand_list=[ops[k] for k in _OPERANDS[:10] + _OPERANDS[11:]],
                      aliases={_K_CACHE - 1: 1, _K_CACHE: 2}),
     f"Wrong number of arguments: expected {len(_OPERANDS)} but got {len(_OPERANDS) - 1}"),
    # Results.
    ("out_4x17", lambda ops: dict(results=[S((_B, 17), F32)] + _dec_results(ops)[1:]),
     r"out does not have shape \[4,16\]"),
    ("out_bf16", lambda ops: dict(results=[S((_B, 16), BF16)] + _dec_results(ops)[1:]),
     r"out must have dtype float32"),
    ("caches_unaliased", lambda ops: dict(aliases={_K_CACHE + 1: 2}),
     "k/v cache results are not aliased"),
    ("results_5", lambda ops: dict(results=_dec_results(ops)[:5]),
     "Wrong number of results: expected 6 but got 5"),
    ("results_7", lambda ops: dict(results=_dec_results(ops) + [S((1,), U8)]),
     "Wrong number of results: expected 6 but got 7"),
    # The workspace is exactly the layout's size: a different size means jaxfuse/_decode's
    # _workspace_bytes and decoder_layout() disagree.
    *[(f"workspace_{name}", lambda ops, size=size: dict(results=_dec_results(ops, size)),
       rf"workspace has {size} bytes, expected {_NEED}")
      for name, size in [("empty", 0)] + [(f"{d:+d}", _NEED + d) for d in (-256, -1, 1, 4096)]],
    ("workspace_f32", lambda ops: dict(results=_dec_results(ops, _NEED // 4, F32)),
     "Wrong buffer dtype: expected U8 but got F32"),
    ("workspace_rank2", lambda ops: dict(results=_dec_results(ops)[:5] + [S((1, _NEED), U8)]),
     "Wrong buffer rank: expected 1 but got 2"),
)


@pytest.mark.parametrize("bad, match", _DEC_BAD)
def test_decoder_bad_call(device, bad, match):
  with _x64_if(bad):
    ops = _dec_operands(device)
    with _expect("jaxfuse_decoder", match):
      _dec_call(device, **{"ops": ops, **bad(ops)})


def _quantized_call(device, size=256, codes=(np.int8, np.uint8), blocks=None):
  """A call with quantized states over one tensor of `size` elements: mu and nu codes of dtypes
  `codes`, block scales of `blocks` values each (default one per 128 elements)."""
  rng = np.random.default_rng(0)
  count, hyper, grad_ctrl, _ = _adam_fixed(device)
  blocks = -(-size // 128) if blocks is None else blocks
  bufs = [rng.standard_normal(size).astype(np.float32) for _ in range(2)]
  bufs += [np.zeros(size, codes[0]), np.zeros(size, codes[1])]
  bufs += [np.zeros(blocks, np.float32), np.zeros(blocks, np.float32)]
  lists = _LISTS + ("mu_scales", "nu_scales")
  ops = [count, hyper, grad_ctrl] + _put(device, *bufs)
  res = [S((), I32)] + [S(x.shape, x.dtype) for x in bufs[1:]]
  return _adam_call(ops, res, _ffi.aliases(lists, lists[1:], 1, operand_offset=3,
                                           result_offset=1), quantized_states=True)


def test_adam_quantized_states_checked(device):
  """8-bit states: the codes' dtypes, one scale per block, whole blocks, no float64."""
  out = _quantized_call(device)
  assert np.asarray(out[4]).any()  # the scales of the first moment were written
  with jaxfuse_error("jaxfuse_adam", r"list 'mu' tensor 0: unsupported dtype "
                                     r"\(int8 or uint8 only\)"):
    _quantized_call(device, codes=(np.float32, np.uint8))
  with jaxfuse_error("jaxfuse_adam", r"list 'mu_scales' has 3 block values, expected 2"):
    _quantized_call(device, blocks=3)
  with jaxfuse_error("jaxfuse_adam", r"tensor 0 has 200 elements; quantized states take whole "
                                     r"blocks of 128"):
    _quantized_call(device, size=200)
