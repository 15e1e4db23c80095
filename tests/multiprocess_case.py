"""One of two processes of tests/test_sharding.py's multi-process test (not collected by pytest):
``python multiprocess_case.py PROCESS_ID PORT``. Two local CPU devices per process, four in all,
CPU collectives over gloo. A sharded fused clip+AdamW step and a global norm over the four
devices, compared with the same computation on one local device."""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
process_id, port = int(sys.argv[1]), int(sys.argv[2])
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import jaxfuse  # noqa: E402

assert jax.process_count() == 2 and jax.device_count() == 4 and jax.local_device_count() == 2
rng = np.random.default_rng(0)  # the same inputs in both processes
shapes = {"w": (64, 32), "b": (32,), "odd": (7, 3)}
specs = {"w": P("fsdp"), "b": P("fsdp"), "odd": P()}
params = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
grads = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
tx = optax.chain(jaxfuse.clip_by_global_norm(1.0), jaxfuse.adamw(1e-2, weight_decay=0.05))
step = jax.jit(lambda p, s, g: jaxfuse.fused_step(tx, g, s, p, return_grad_norm=True),
               donate_argnums=(0, 1))

# The single-process run: the same step on one local device.
local = jax.local_devices()[0]
want_p, _, want_norm = step(jax.device_put(params, local), tx.init(jax.device_put(params, local)),
                            jax.device_put(grads, local))

mesh = jax.make_mesh((4,), ("fsdp",), axis_types=(AxisType.Auto,))


def global_array(x, spec):
  sharding = NamedSharding(mesh, spec)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


p = {k: global_array(v, specs[k]) for k, v in params.items()}
g = {k: global_array(v, specs[k]) for k, v in grads.items()}
zeros = lambda: {k: global_array(np.zeros_like(v), specs[k]) for k, v in params.items()}
state = tx.init(params)
state = (state[0], (state[1][0]._replace(count=global_array(np.zeros((), np.int32), P()),
                                         mu=zeros(), nu=zeros()), *state[1][1:]))
with jax.set_mesh(mesh):
  new_p, _, norm = step(p, state, g)
  norm_only = jax.jit(jaxfuse.global_norm)(g)

assert float(norm) == float(want_norm) == float(norm_only), (float(norm), float(want_norm))
for k in params:
  assert new_p[k].sharding.spec == specs[k], (k, new_p[k].sharding)
  for shard in new_p[k].addressable_shards:
    np.testing.assert_allclose(np.asarray(shard.data), np.asarray(want_p[k])[shard.index],
                               rtol=1e-6, atol=1e-7, err_msg=k)
print(f"process {process_id}: ok", flush=True)
jax.distributed.shutdown()
