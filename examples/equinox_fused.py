"""Equinox with jaxfuse's in-place step: eqx.partition the model, fused_step on the arrays.

Trains an equinox MLP on a noisy sine with clip + AdamW twice, side by side: jaxfuse.fused_step
(params and moments updated in place, the step donating them) and optax's update +
eqx.apply_updates, and prints both losses every few steps (they agree to float32 rounding).

  pip install equinox && python3 examples/equinox_fused.py [--steps 300]
"""

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import jaxfuse


def data(key, n=256):
  x = jax.random.uniform(key, (n, 1), minval=-3.0, maxval=3.0)
  return x, jnp.sin(x) + 0.05 * jax.random.normal(jax.random.fold_in(key, 1), x.shape)


def loss_fn(params, static, x, y):
  model = eqx.combine(params, static)
  return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--steps", type=int, default=300)
  args = parser.parse_args(argv)

  model = eqx.nn.MLP(1, 1, width_size=64, depth=3, activation=jax.nn.tanh, key=jax.random.key(0))
  # The arrays the optimizer updates, and everything else (activations, structure), apart.
  params, static = eqx.partition(model, eqx.is_inexact_array)

  def make(mod):
    return optax.chain(mod.clip_by_global_norm(1.0), mod.adamw(3e-3, weight_decay=1e-4))

  jf_tx, optax_tx = make(jaxfuse), make(optax)

  @jax.jit(donate_argnums=(0, 1))  # params and state, in the order the step returns them
  def jf_step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, static, x, y)
    params, opt_state = jaxfuse.fused_step(jf_tx, grads, opt_state, params)
    return params, opt_state, loss

  @jax.jit
  def optax_step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, static, x, y)
    updates, opt_state = optax_tx.update(grads, opt_state, params)
    return eqx.apply_updates(params, updates), opt_state, loss

  jf = (jax.tree.map(jnp.copy, params), jf_tx.init(params))  # own buffers: they are donated
  ref = (params, optax_tx.init(params))
  print(f"{'step':>5} {'loss (jaxfuse fused_step)':>26} {'loss (optax)':>14}")
  for step in range(args.steps):
    x, y = data(jax.random.key(step))
    *jf, jf_loss = jf_step(*jf, x, y)
    *ref, ref_loss = optax_step(*ref, x, y)
    if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
      print(f"{step:5d} {float(jf_loss):26.6f} {float(ref_loss):14.6f}", flush=True)
  trained = eqx.combine(jf[0], static)
  x = jnp.linspace(-3, 3, 7)[:, None]
  print("sin(x) vs model(x):", jnp.round(jnp.sin(x[:, 0]), 3), jnp.round(jax.vmap(trained)(x)[:, 0], 3))


if __name__ == "__main__":
  main()
