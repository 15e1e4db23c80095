"""jaxfuse under SPMD partitioning, on 4 fake CPU devices (a subprocess: the device count must be
set before jax starts its backend)."""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np, optax, jaxfuse
    from jax.sharding import NamedSharding, PartitionSpec as P

    assert len(jax.devices()) == 4
    mesh = jax.make_mesh((4,), ("data",))
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.standard_normal((8, 16)), jnp.float32),
              "b": jnp.asarray(rng.standard_normal((16,)), jnp.float32)}
    grads = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), params)
    to = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    u, _ = to.update(grads, to.init(params), params)
    expected = optax.apply_updates(params, u)

    tx = optax.chain(jaxfuse.clip_by_global_norm(1.0), jaxfuse.adamw(1e-2))
    # Replicated params (data parallel), then params sharded over the mesh (the custom calls have
    # no partitioning rule: XLA gathers their operands; the values must still be right).
    for spec in (P(), P("data")):
        sharding = {"w": NamedSharding(mesh, spec), "b": NamedSharding(mesh, P())}
        p = jax.device_put(params, sharding)
        g = jax.device_put(grads, sharding)
        step = jax.jit(lambda p, s, g: jaxfuse.fused_step(tx, g, s, p, return_grad_norm=True))
        new_p, _, norm = step(p, tx.init(p), g)
        for k in params:
            np.testing.assert_allclose(np.asarray(new_p[k]), np.asarray(expected[k]), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(float(norm), float(optax.global_norm(grads)), rtol=1e-6)
    print("ok")
""")


def test_spmd_replicated_and_sharded_params():
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=300, env=env)
  assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
