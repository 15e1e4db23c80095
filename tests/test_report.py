"""jaxfuse.report: launches, bytes and memory of compiled steps, checked against the compiled
HLO text, the ops' documented launches, byte bounds per parameter and XLA's cost analysis."""

import inspect
import math
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxfuse
from jaxfuse._core import ffi as _ffi
from jaxfuse._optim.kernel_path import MAX_LEAVES_PER_CALL
from jaxfuse._report import report as report_module
from helpers import init_beside, random_decoder_problem, random_tree
from test_readme import _subprocess_env

SHAPES = [(3, 5), (7,), (), (0,), (33, 17), (4097,)]


def adamw_steps(shapes, clip=True, dtype=jnp.float32, device=None, **adam_kwargs):
  """(jaxfuse fused step, optax step, params, jaxfuse state, optax state, grads), both steps
  jitted with params and state donated and returned in that order; arrays on `device`."""
  params = random_tree(0, shapes, dtype, device=device)
  grads = random_tree(1, shapes, dtype, scale=0.1, device=device)
  jf = jaxfuse.adamw(1e-3, weight_decay=0.1, **adam_kwargs)
  ox = optax.adamw(1e-3, weight_decay=0.1)
  if clip:
    jf = optax.chain(jaxfuse.clip_by_global_norm(1.0), jf)
    ox = optax.chain(optax.clip_by_global_norm(1.0), ox)

  def optax_step(p, s, g):
    u, s = ox.update(g, s, p)
    return optax.apply_updates(p, u), s

  donate = dict(donate_argnums=(0, 1))
  return (jax.jit(lambda p, s, g: jaxfuse.fused_step(jf, g, s, p), **donate),
          jax.jit(optax_step, **donate), params, init_beside(jf, params), init_beside(ox, params),
          grads)


def entry_ops(compiled_text, opcode):
  """Instructions of `opcode` in the ENTRY computation of compiled HLO text."""
  entry = compiled_text[compiled_text.index("\nENTRY"):]
  entry = entry[:entry.index("\n}")]
  return len(re.findall(r"= [^\n]*? " + re.escape(opcode) + r"\(", entry))


def test_counts_equal_the_compiled_hlo(device):
  jf_step, optax_step, p, s, os_, g = adamw_steps(SHAPES, device=device)
  reports = {}
  for name, step, args in (("jaxfuse", jf_step, (p, s, g)), ("optax", optax_step, (p, os_, g))):
    text = step.lower(*args).compile().as_text()
    r = reports[name] = jaxfuse.report(step, *args)
    rows = {row.name: row for row in r.rows}
    assert r.custom_calls == entry_ops(text, "custom-call")
    # A step without fusions has no fusion row; one with them must count them all.
    assert (rows["fusion"].runs if "fusion" in rows else 0) == entry_ops(text, "fusion")
    assert r.custom_calls == r.jaxfuse_calls  # each custom call here is named jaxfuse's
    assert r.exact and r.platform == {"cpu": "cpu", "gpu": "cuda"}[device.platform]
  assert reports["optax"].custom_calls == 0 and reports["optax"].jaxfuse_launches == 0
  if device.platform == "cpu":
    assert reports["optax"].xla_kernels > 3 * len(SHAPES)  # one fusion or more per leaf and update
  else:  # XLA's GPU fusions span leaves
    assert reports["optax"].launches > reports["jaxfuse"].launches


# Hundreds of leaves mostly time XLA's compiler: slow (left out under the sanitizers).
@pytest.mark.parametrize("leaves", [1, 5] + [pytest.param(n, marks=pytest.mark.slow) for n in (
    MAX_LEAVES_PER_CALL, MAX_LEAVES_PER_CALL + 1)])
def test_jaxfuse_launches_are_the_documented_ones(device, leaves):
  shapes = [(7, 3)] * leaves
  adam_calls = math.ceil(leaves / MAX_LEAVES_PER_CALL)
  for clip in (False, True):
    step, _, p, s, _, g = adamw_steps(shapes, clip=clip, device=device)
    r = jaxfuse.report(step, p, s, g)
    # One Adam launch per call of <= 256 leaves; the norm is a partials kernel and a finish.
    assert r.jaxfuse_cuda_launches == adam_calls + (2 if clip else 0)
    assert r.jaxfuse_cuda_memsets == 0
    assert r.jaxfuse_calls == adam_calls + (1 if clip else 0)
    # On the CPU a call is one XLA thunk; on a GPU, its CUDA launches.
    assert r.jaxfuse_launches == (r.jaxfuse_calls if device.platform == "cpu"
                                  else r.jaxfuse_cuda_launches)


def test_norm_of_no_leaves_is_one_finishing_launch():
  # A zero-size leaf is no leaf to the kernel: no partials launch for it, the finish alone.
  for tree in ({}, {"a": jnp.zeros((0,), jnp.float32)}):
    r = jaxfuse.report(jaxfuse.global_norm, tree)
    assert (r.jaxfuse_calls, r.jaxfuse_cuda_launches) == (1, 1)


@pytest.mark.parametrize("dtype,adam_kwargs,state_per_param,step_per_param", [
    (jnp.float32, {}, 8, 28),
    (jnp.float32, {"mu_dtype": jnp.bfloat16}, 6, 24),
    (jnp.float32, {"mu_dtype": jnp.bfloat16, "nu_dtype": jnp.bfloat16}, 4, 20),
    (jnp.bfloat16, {"master_weights": True}, 12, 30),  # g, p 2 B; m, v, master 4 B
    (jnp.bfloat16, {"master_weights": "remainder"}, 10, 26),  # the master's low 2 B
])
def test_bytes_per_param(dtype, adam_kwargs, state_per_param, step_per_param):
  """The fused step moves exactly its buffers' bytes: p, g, m, v read and p, m, v written (28 B
  per fp32 param), plus a few hundred bytes of count and hyperparameters."""
  shapes = [(64, 33), (1000,), (5,)]
  n = sum(map(math.prod, shapes))
  step, _, p, s, _, g = adamw_steps(shapes, clip=False, dtype=dtype, **adam_kwargs)
  r = jaxfuse.report(step, p, s, g)
  adam = next(row for row in r.rows if row.name == "jaxfuse_adam")
  assert step_per_param * n <= adam.bytes_read + adam.bytes_written <= step_per_param * n + 512
  assert r.params == n
  assert state_per_param <= r.state_bytes_per_param <= state_per_param + 8 / n


def test_clipped_step_bytes_and_baseline_ratios(device):
  shapes = [(128, 96), (96,), (96, 10), (10,)]
  n = sum(map(math.prod, shapes))
  jf_step, optax_step, p, s, os_, g = adamw_steps(shapes, device=device)
  r = jaxfuse.report(jf_step, p, s, g, baseline=(optax_step, (p, os_, g)))
  # 32 B/param: the grads are read twice (norm, Adam); plus the norm's partials (one per chunk
  # of 32768 here) and the count and hyperparameters.
  assert 32 * n <= r.bytes_moved <= 32 * n + 512
  b = r.baseline
  assert b.label == "baseline" and b.jaxfuse_calls == 0
  ratios = r.ratios()
  if device.platform == "cpu":
    assert ratios["launches"] > 3 and ratios["bytes_moved"] > 1.2
  else:  # XLA's GPU fusions span leaves and read each buffer once per pass, as jaxfuse does
    assert ratios["launches"] > 1.5 and ratios["bytes_moved"] > 0.99
  # Without custom calls XLA's cost analysis exists and agrees with the report's own count.
  assert r.xla_cost_bytes is None
  assert b.bytes_moved == pytest.approx(b.xla_cost_bytes, rel=0.1)


def test_memory_and_donation():
  shapes = [(256, 256)]
  step, _, p, s, _, g = adamw_steps(shapes, clip=False)
  undonated = jax.jit(lambda p, s, g: step(p, s, g))  # the inner donation cannot apply
  donated = jaxfuse.report(step, p, s, g)
  copied = jaxfuse.report(undonated, p, s, g)
  assert donated.memory["alias"] >= 3 * 4 * 256 * 256  # params, mu, nu updated in place
  assert copied.memory["alias"] == 0
  assert copied.peak_bytes - donated.peak_bytes >= 0.99 * 3 * 4 * 256 * 256  # fresh outputs


def test_loops_count_each_run():
  tree = random_tree(2, [(5, 5), (9,)])

  def norms(t, n):
    # The norm depends on i: XLA hoists loop-invariant calls out of the loop.
    body = lambda i, acc: acc + jaxfuse.global_norm(jax.tree.map(lambda x: x * i, t))
    return jax.lax.fori_loop(0, n, body, 0.0)

  known = jaxfuse.report(lambda t: norms(t, 7), tree)
  assert known.jaxfuse_calls == 7 and known.jaxfuse_cuda_launches == 14 and known.exact
  unknown = jaxfuse.report(norms, tree, jnp.int32(7))
  assert unknown.jaxfuse_calls == 1 and not unknown.exact
  assert "bounds" in str(unknown)


def test_decoder_step():
  cfg = jaxfuse.DecoderConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                              head_dim=16, intermediate_size=128, max_seq_len=32)
  x, w, cache = random_decoder_problem(cfg, 3, jnp.float32, seed=1)
  positions = jnp.asarray([0, 5, 31], jnp.int32)
  r = jaxfuse.report(lambda x, p, w, c: jaxfuse.persistent_decoder(x, p, w, c, cfg),
                     x, positions, w, cache)
  assert (r.jaxfuse_calls, r.jaxfuse_cuda_launches, r.jaxfuse_cuda_memsets) == (1, 1, 1)
  weight_bytes = sum(a.nbytes for a in jax.tree.leaves(w))
  cache_bytes = sum(a.nbytes for a in jax.tree.leaves(cache))
  row = next(row for row in r.rows if row.jaxfuse)
  assert row.bytes_read >= weight_bytes + cache_bytes  # the cache at most: a bound
  new_rows = 2 * cfg.num_layers * 3 * cfg.num_kv_heads * cfg.head_dim * 4
  assert row.bytes_written >= x.nbytes + new_rows
  assert not r.exact
  # A whole-model step with a head of its own (here quantized) reads B rows of the embedding.
  model = jaxfuse.quantize(jaxfuse.DecoderModel(cfg, w, jnp.ones((500, 64)), jnp.ones(64)), "int8")
  r = jaxfuse.report(jaxfuse.decode_step, model, positions, positions, cache)
  row = next(row for row in r.rows if row.jaxfuse)
  head_bytes = model.lm_head.nbytes + model.lm_head_scale.nbytes
  floor = sum(a.nbytes for a in jax.tree.leaves(model.layers)) + cache_bytes + head_bytes
  assert floor < row.bytes_read < floor + model.embed.nbytes / 2


def test_table_and_names():
  step, optax_step, p, s, os_, g = adamw_steps([(8, 8)])
  r = report_module.report(step, p, s, g, baseline=(optax_step, (p, os_, g), {}))
  for line in ("kernels launched per step", "bytes moved per step", "peak memory",
               "optimizer state per param", "jaxfuse_adam", "jaxfuse_global_norm",
               "baseline / step"):
    assert line in str(r)
  # Abstract arguments (no arrays allocated) report the same step.
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (p, s, g))
  a = jaxfuse.report(step, *abstract)
  assert (a.jaxfuse_cuda_launches, a.params) == (r.jaxfuse_cuda_launches, r.params) == (3, 64)
  # Plain names: jaxfuse.report is the function (no callable module), Report its result type.
  assert jaxfuse.report is report_module.report and inspect.isfunction(jaxfuse.report)
  assert jaxfuse.Report is report_module.Report and isinstance(r, jaxfuse.Report)
  with pytest.raises(TypeError, match="baseline"):
    jaxfuse.report(step, p, s, g, baseline=optax_step)
  with pytest.raises(ValueError, match="no baseline"):
    jaxfuse.report(step, p, s, g).ratios()


@pytest.mark.parametrize("flags,ready", [
    ("", True),
    ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS", False),
    ("--xla_gpu_enable_command_buffer=-CUSTOM_CALL", False),
    ("--xla_gpu_enable_command_buffer=+WHILE", True),
    ("--xla_gpu_enable_command_buffer=", False),
])
def test_cuda_graph_readiness_follows_xla_flags(monkeypatch, flags, ready):
  monkeypatch.setenv("XLA_FLAGS", flags)
  tree = random_tree(3, [(4,)])
  assert jaxfuse.report(jaxfuse.global_norm, tree).cuda_graph_ready is ready
  assert not jaxfuse.report(lambda t: t["leaf0000"] * 2, tree).cuda_graph_ready


def test_gpt2_command_line():
  """benchmarks/report_gpt2.py, run as a script (its own directory on sys.path, not the repo's):
  the jaxfuse under test goes on PYTHONPATH."""
  script = Path(__file__).resolve().parent.parent / "benchmarks" / "report_gpt2.py"
  out = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", str(script)],
                       env=_subprocess_env(), capture_output=True, text=True, timeout=300,
                       check=True)
  assert "jaxfuse" in out.stdout and "optax" in out.stdout
  launches = re.search(r"kernels launched per step\s+(\d+)\s+([\d,]+)", out.stdout)
  assert launches and int(launches.group(1)) < 10 < int(launches.group(2).replace(",", ""))


def test_an_added_cpu_handler_set_runs_and_is_reported():
  """A CPU handler set added beside the native one (how the tests load the emulated CUDA
  handlers) gets target names of its own, computes what the native set does, and
  jaxfuse.report names its calls by their op."""
  name = "native_again"
  if name not in _ffi._cpu_sets:
    _ffi.add_cpu_handlers(name, _ffi._jaxfuse_cpu, cuda_kernels=False)
  tree = {"a": jnp.arange(1.0, 6.0), "b": jnp.full((3, 2), -2.0)}
  native = jax.jit(jaxfuse.global_norm)(tree)
  with _ffi.cpu_targets(name):
    text = jax.jit(jaxfuse.global_norm).lower(tree).as_text()
    assert "jaxfuse_global_norm_native_again" in text
    assert jax.jit(jaxfuse.global_norm)(tree) == native
    rows = {row.name: row for row in jaxfuse.report(jaxfuse.global_norm, tree).rows}
  assert rows["jaxfuse_global_norm"].launches == 1, rows
  assert _ffi.op_of_target("jaxfuse_global_norm_native_again") == ("jaxfuse_global_norm", name)
  assert _ffi.op_of_target("jaxfuse_global_norm") == ("jaxfuse_global_norm", "native")
  with pytest.raises(ValueError, match="no CPU handler set 'missing'"):
    _ffi.use_cpu_handlers("missing")
