"""Faults: non-finite gradients under skip_nonfinite, checkpoint and restore mid-training, and
concurrent calls from several Python threads. Results are compared bit for bit."""

import concurrent.futures
import os
import pickle

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import optax
import pytest

import jaxfuse
from helpers import Snapshot, assert_bitwise_equal, random_decoder_problem, random_tree
from lockstep import jit_step

# A leaf above the CPU handlers' 65536-element chunk, so that a bad value can sit in a chunk
# other than the first (and the CPU work spreads over the thread pool).
SHAPES = [(70_001,), (33,), (4, 5), ()]


def _grads(rng, params, scale=1.0):
  """Fresh random non-zero gradients with the params' dtypes, on the params' device."""
  return jax.tree.map(
      lambda p: jax.device_put(jnp.asarray(scale * (rng.standard_normal(p.shape) + 0.1), p.dtype),
                               p.devices().pop()), params)


def _with_bad_value(rng, grads, bad, leaf):
  """`grads` with one random element of leaf number `leaf` set to `bad` (in the large leaf, past
  its first chunk)."""
  leaves, treedef = jax.tree.flatten(grads)
  x = leaves[leaf]
  flat_index = int(rng.integers(65_536, x.size)) if x.size > 65_536 else int(rng.integers(x.size))
  leaves[leaf] = x.reshape(-1).at[flat_index].set(bad).reshape(x.shape)
  return treedef.unflatten(leaves)


# ---- 1. skip_nonfinite ------------------------------------------------------------------------

PARAM_KINDS = {
    "fp32": (jnp.float32, False),
    "fp32_master": (jnp.float32, True),
    "bf16_master": (jnp.bfloat16, True),
}


# jaxlib 0.11.2 (not 0.10.2, not 0.12) on the CPU leaves a donated bfloat16 array undeleted once
# np.asarray has read it (Snapshot does), as plain jax shows:
#   x = jnp.ones(8, jnp.bfloat16); np.asarray(x)
#   jax.jit(lambda x: x + 1, donate_argnums=0)(x); assert x.is_deleted()  # fails
_BF16_DONATION_BUG = pytest.mark.xfail(
    condition=jaxlib.__version__ == "0.11.2", strict=True,
    reason="jaxlib 0.11.2 bug: a CPU bfloat16 array read by np.asarray is not deleted when donated")


def _split_skipped(state, chained):
  """(state without the skipped-steps counter, the counter, Adam's step count), as ints."""
  adam_state = state[-1] if chained else state
  extra = adam_state[-1]
  assert isinstance(extra, jaxfuse.AdamExtraState)
  rest = (*adam_state[:-1], extra._replace(skipped_steps=None))
  rest = (*state[:-1], rest) if chained else rest
  return rest, int(extra.skipped_steps), int(adam_state[0].count)


@pytest.mark.parametrize("kind", list(PARAM_KINDS))
@pytest.mark.parametrize("clip", [False, True], ids=["noclip", "clip"])
@pytest.mark.parametrize("path", ["optax", "fused"])
def test_nonfinite_step_leaves_everything_bitwise_unchanged(request, device, path, clip, kind):
  if path == "fused" and kind == "bf16_master" and device.platform == "cpu":
    request.applymarker(_BF16_DONATION_BUG)  # the donation check below meets it
  dtype, master = PARAM_KINDS[kind]
  seed = [100, ["optax", "fused"].index(path), int(clip), list(PARAM_KINDS).index(kind)]
  rng = np.random.default_rng(seed)
  params = random_tree(seed, SHAPES, dtype=dtype, device=device)
  # AdamW on a schedule (its count, too, must stay put on a skipped step), clipped or not.
  tx = jaxfuse.adamw(optax.linear_schedule(3e-2, 1e-3, 50), weight_decay=0.1,
                     master_weights=master, skip_nonfinite=True)
  tx = optax.chain(jaxfuse.clip_by_global_norm(0.5), tx) if clip else tx
  state = tx.init(params)
  step = jit_step(path, tx, donate=True)  # the fused step in place

  for _ in range(2):  # moments, count (and master params) away from their initial values
    params, state = step(params, state, _grads(rng, params))
  assert _split_skipped(state, clip)[1:] == (0, 2)  # (skipped steps, count)

  # One bad value in the large leaf (past its first chunk), in a small leaf, in the scalar leaf;
  # then bad values of every kind in every leaf.
  for bad, leaves in [(jnp.nan, [0]), (jnp.inf, [1]), (-jnp.inf, [3]),
                      ((jnp.nan, jnp.inf, -jnp.inf, jnp.nan), [0, 1, 2, 3])]:
    grads = _grads(rng, params)
    for i, b in zip(leaves, bad if isinstance(bad, tuple) else [bad]):
      grads = _with_bad_value(rng, grads, b, i)
    rest, skipped, _ = _split_skipped(state, clip)
    before_params, before_rest = Snapshot(params), Snapshot(rest)
    old_leaf = jax.tree.leaves(params)[0]
    params, state = step(params, state, grads)
    if path == "fused":
      assert old_leaf.is_deleted(), "the fused step did not take the donated params"
    new_rest, new_skipped, count = _split_skipped(state, clip)
    assert_bitwise_equal(before_params, params, f"params after a {bad} step")
    assert_bitwise_equal(before_rest, new_rest, f"opt state after a {bad} step")
    assert new_skipped == skipped + 1 and count == 2

  # A finite step afterwards moves on from where the state was.
  before = Snapshot(params)
  params, state = step(params, state, _grads(rng, params))
  assert _split_skipped(state, clip)[1:] == (4, 3)
  assert any("leaf0000" in d for d in before.differences(Snapshot(params)))


# ---- 2. checkpoint and restore ----------------------------------------------------------------


def _save_restore(writer, tree, tmp_path, device):
  """Writes `tree` to a checkpoint and reads it back into fresh device arrays."""
  if writer == "pickle":
    return jax.device_put(pickle.loads(pickle.dumps(jax.device_get(tree))), device)
  ocp = pytest.importorskip("orbax.checkpoint")
  path = os.path.join(tmp_path, "ckpt")
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, tree)
    ckptr.wait_until_finished()
  with ocp.StandardCheckpointer() as ckptr:  # a fresh reader, as after a restart
    return ckptr.restore(path, abstract)


CKPT_KINDS = {
    "fp32": dict(dtype=jnp.float32, master=False, skip=False),
    "bf16_master_skip": dict(dtype=jnp.bfloat16, master=True, skip=True),
}


@pytest.mark.parametrize("writer", ["pickle", "orbax"])
@pytest.mark.parametrize("kind", list(CKPT_KINDS))
@pytest.mark.parametrize("path", ["fused", "optax"])
def test_restored_run_is_bitwise_the_uninterrupted_run(device, tmp_path, path, kind, writer):
  """Train 3 steps, checkpoint, then continue both the original run and a run restored from the
  checkpoint for 4 steps on the same gradients: params and state agree bit for bit."""
  cfg = CKPT_KINDS[kind]
  seed = 300 + 4 * ["fused", "optax"].index(path) + 2 * list(CKPT_KINDS).index(kind)
  params = random_tree(seed, SHAPES, dtype=cfg["dtype"], device=device)
  tx = optax.chain(
      jaxfuse.clip_by_global_norm(1.0),
      jaxfuse.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 20), weight_decay=0.1,
                    master_weights=cfg["master"], skip_nonfinite=cfg["skip"]))
  step = jit_step(path, tx, donate=True)
  rng = np.random.default_rng(seed)
  grads = [_grads(rng, params, scale=float(s)) for s in (1.0, 3.0, 0.2, 1.0, 5.0, 0.5, 1.0)]
  state = tx.init(params)
  for g in grads[:3]:
    params, state = step(params, state, g)

  r_params, r_state = restored = _save_restore(writer, (params, state), tmp_path, device)
  assert_bitwise_equal(restored, (params, state), "restored checkpoint")

  for t, g in enumerate(grads[3:], start=3):
    params, state = step(params, state, g)
    r_params, r_state = step(r_params, r_state, g)
    assert_bitwise_equal(r_params, params, f"params after step {t + 1}")
    assert_bitwise_equal(r_state, state, f"opt state after step {t + 1}")
  assert int(state[-1][0].count) == 7


# ---- 3. concurrent calls from several threads -------------------------------------------------

THREADS = 8
_DEC_CFG = jaxfuse.DecoderConfig(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2,
                                 head_dim=32, intermediate_size=512, max_seq_len=8)


def _make_workload(device):
  """One function per thread index: runs jitted Adam steps (fused, donated, and the optax
  protocol), global norms and decoder steps on inputs drawn from that index's seed, and returns
  every result as raw bits."""
  tx = optax.chain(jaxfuse.clip_by_global_norm(1.0), jaxfuse.adamw(1e-2, weight_decay=0.1))
  fused = jax.jit(lambda p, s, g: jaxfuse.fused_step(tx, g, s, p, return_grad_norm=True),
                  donate_argnums=(0, 1))
  adam_update = jax.jit(jaxfuse.adam(1e-2).update)
  norm = jax.jit(jaxfuse.global_norm)
  decode = jax.jit(lambda x, pos, w, cache: jaxfuse.persistent_decoder(x, pos, w, cache, _DEC_CFG),
                   donate_argnums=(3,))

  def work(i):
    rng = np.random.default_rng(500 + i)
    params = random_tree(600 + i, SHAPES, device=device)
    state = tx.init(params)
    adam_params = random_tree(700 + i, SHAPES[1:], device=device)
    adam_state = jaxfuse.adam(1e-2).init(adam_params)
    x, w, cache = random_decoder_problem(_DEC_CFG, 2, jnp.float32, 800 + i, device)
    pos = np.random.default_rng(800 + i).integers(0, _DEC_CFG.max_seq_len, 2)
    pos = jax.device_put(jnp.asarray(pos, jnp.int32), device)
    out = []
    for _ in range(3):
      params, state, gnorm = fused(params, state, _grads(rng, params))
      h, cache = decode(x, pos, w, cache)
      u, adam_state = adam_update(_grads(rng, adam_params), adam_state, adam_params)
      adam_params = optax.apply_updates(adam_params, u)
      out.append(Snapshot((gnorm, norm(_grads(rng, params, scale=10.0)), h)))
      x, pos = h, (pos + 1) % _DEC_CFG.max_seq_len
    return out + [Snapshot((params, state, adam_params, adam_state, x, cache))]

  return work


def test_concurrent_threads_match_sequential(device):
  """8 threads run their own jitted Adam / global-norm / decoder steps at the same time (the
  first calls compile concurrently); each thread's results equal those of the same work run
  sequentially, bit for bit."""
  work = _make_workload(device)
  runs = {}
  for run in ("compiling", "compiled"):  # the second run's executables are compiled
    with concurrent.futures.ThreadPoolExecutor(max_workers=THREADS) as pool:
      runs[run] = [f.result(timeout=300) for f in [pool.submit(work, i) for i in range(THREADS)]]
  sequential = [work(i) for i in range(THREADS)]
  for run, results in runs.items():
    for i in range(THREADS):
      assert len(results[i]) == len(sequential[i])
      for k, (c, s) in enumerate(zip(results[i], sequential[i])):
        assert_bitwise_equal(c, s, f"thread {i}, result group {k}, concurrent ({run})")
  # Different seeds gave different results (the threads did not all compute the same thing).
  assert sequential[0][-1].differences(sequential[1][-1])
