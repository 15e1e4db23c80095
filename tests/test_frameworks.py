"""The in-place step in each framework's own training loop (flax linen, flax NNX, equinox),
against the same loop with optax's transforms, over many steps."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxfuse
from helpers import assert_trees_close

STEPS = 12


def _txs():
  """(jaxfuse transform, optax transform) computing the same step, a chain (plain adamw in flax
  is test_packed.py's and test_precision.py's). max_norm is below the gradients' norm: the clip
  is active on every step."""
  return (optax.chain(jaxfuse.clip_by_global_norm(0.05), jaxfuse.adamw(3e-3, weight_decay=0.1)),
          optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(3e-3, weight_decay=0.1)))


def _batches(seed, n_in=7, n_out=3, batch=16):
  rng = np.random.default_rng(seed)
  return [(jnp.asarray(rng.standard_normal((batch, n_in), np.float32)),
           jnp.asarray(rng.standard_normal((batch, n_out), np.float32))) for _ in range(STEPS)]


def test_flax_linen_train_state(device):
  nn = pytest.importorskip("flax.linen")
  from flax.training import train_state
  import jaxfuse.flax

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = jnp.tanh(nn.Dense(24)(x))
      return nn.Dense(3)(nn.LayerNorm()(x))

  model = MLP()
  batches = _batches(1)
  params = jax.device_put(model.init(jax.random.key(0), batches[0][0])["params"], device)
  jf_tx, optax_tx = _txs()
  create = lambda cls, params, tx: cls.create(apply_fn=model.apply, params=params, tx=tx)
  # Each state its own buffers: the jaxfuse step donates its state.
  states = {"jaxfuse": create(jaxfuse.flax.TrainState, jax.tree.map(jnp.copy, params), jf_tx),
            "optax": create(train_state.TrainState, params, optax_tx)}

  def step(state, batch):
    x, y = batch
    loss_fn = lambda p: jnp.mean((state.apply_fn({"params": p}, x) - y) ** 2)
    return state.apply_gradients(grads=jax.grad(loss_fn)(state.params))

  step = jax.jit(step, donate_argnums=0)
  for batch in batches:
    states = {k: step(s, batch) for k, s in states.items()}
  jf, ref = states["jaxfuse"], states["optax"]
  assert type(jf) is jaxfuse.flax.TrainState and int(jf.step) == int(ref.step) == STEPS
  assert jax.tree.structure(jf.opt_state) == jax.tree.structure(ref.opt_state)
  assert_trees_close(jf.params, ref.params, rtol=2e-5, atol=2e-6)
  assert_trees_close(jf.opt_state, ref.opt_state, rtol=2e-5, atol=2e-7)


def test_flax_nnx_optimizer(device):
  nnx = pytest.importorskip("flax.nnx")
  import jaxfuse.flax

  class MLP(nnx.Module):
    def __init__(self, rngs):
      self.hidden = nnx.Linear(7, 24, rngs=rngs)
      self.norm = nnx.LayerNorm(24, rngs=rngs)
      self.out = nnx.Linear(24, 3, rngs=rngs)

    def __call__(self, x):
      return self.out(self.norm(jnp.tanh(self.hidden(x))))

  jf_tx, optax_tx = _txs()
  with jax.default_device(device):
    models = {"jaxfuse": MLP(nnx.Rngs(0)), "optax": MLP(nnx.Rngs(0))}
    optimizers = {"jaxfuse": jaxfuse.flax.Optimizer(models["jaxfuse"], jf_tx, wrt=nnx.Param),
                  "optax": nnx.Optimizer(models["optax"], optax_tx, wrt=nnx.Param)}

  @nnx.jit
  def step(model, optimizer, x, y):
    optimizer.update(model, nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model))

  for x, y in _batches(2):
    for k in models:
      step(models[k], optimizers[k], x, y)
  assert int(optimizers["jaxfuse"].step[...]) == STEPS
  assert_trees_close(nnx.state(models["jaxfuse"], nnx.Param),
                     nnx.state(models["optax"], nnx.Param), rtol=2e-5, atol=2e-6)
  assert_trees_close(nnx.as_pure(optimizers["jaxfuse"].opt_state),
                     nnx.as_pure(optimizers["optax"].opt_state), rtol=2e-5, atol=2e-7)


def test_equinox_filtered_fused_step(device):
  eqx = pytest.importorskip("equinox")

  with jax.default_device(device):
    model = eqx.nn.MLP(7, 3, width_size=24, depth=2, activation=jnp.tanh, key=jax.random.key(3))
  params, static = eqx.partition(model, eqx.is_inexact_array)
  jf_tx, optax_tx = _txs()

  def loss_fn(params, x, y):
    return jnp.mean((jax.vmap(eqx.combine(params, static))(x) - y) ** 2)

  def jf_step(params, opt_state, x, y):
    return jaxfuse.fused_step(jf_tx, jax.grad(loss_fn)(params, x, y), opt_state, params)

  @jax.jit
  def optax_step(params, opt_state, x, y):
    grads = jax.grad(loss_fn)(params, x, y)
    updates, opt_state = optax_tx.update(grads, opt_state, params)
    return eqx.apply_updates(params, updates), opt_state

  copy = jax.tree.map(jnp.copy, params)  # the jaxfuse step donates its buffers
  jf, ref = (copy, jf_tx.init(copy)), (params, optax_tx.init(params))
  jf_step = jax.jit(jf_step, donate_argnums=(0, 1))
  for x, y in _batches(3):
    jf, ref = jf_step(*jf, x, y), optax_step(*ref, x, y)
  assert_trees_close(jf[0], ref[0], rtol=2e-5, atol=2e-6)
  assert isinstance(eqx.combine(jf[0], static), eqx.nn.MLP)
