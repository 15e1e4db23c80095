"""Runs each jaxfuse CUDA kernel a few times at benchmark sizes, for a profiler to look at:

  ncu --clock-control none --kernel-name regex:'decoder_kernel|multi_tensor|norm_finish' \
      --launch-skip 2 --launch-count 13 python3 tools/profile_kernels.py

One decode step of Llama-3.2-1B layer shapes (bf16, batch 1, context 1024), then fused
clip+AdamW steps on a 64M-parameter fp32 tensor and on the GPT-2-small tree (148 leaves: one
Adam launch), each run 3 times (the first compiles). A clipped step is 3 launches (norm
partials, norm finish, Adam); ncu counts only the kernels its filter matches, so the skip and
count above take the third decoder launch, the three 64M steps and the first GPT-2 step.
"""

import os
import sys

import jax
import jax.numpy as jnp
import optax

import jaxfuse

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from _common import gpt2_small_shapes  # noqa: E402
from bench_decoder import make_weights  # noqa: E402


def main():
  cfg = jaxfuse.DecoderConfig(num_layers=16, hidden_size=2048, num_heads=32, num_kv_heads=8,
                              head_dim=64, intermediate_size=8192, max_seq_len=1024)
  w = make_weights(cfg, jnp.bfloat16, jax.devices()[0])  # initialized on the device: 2.5 GB
  keys = jax.random.split(jax.random.key(0), 3)
  cache = jaxfuse.KVCache(*[jax.random.normal(k, cfg.cache_shape(1)).astype(jnp.bfloat16)
                            for k in keys[-2:]])
  x = jax.random.normal(keys[-3], (1, cfg.hidden_size)).astype(jnp.bfloat16)
  pos = jnp.array([1023], jnp.int32)
  step = jax.jit(lambda x, p, w, c: jaxfuse.persistent_decoder(x, p, w, c, cfg), donate_argnums=3)
  for _ in range(3):
    x, cache = step(x, pos, w, cache)
  jax.block_until_ready(x)

  tx = optax.chain(jaxfuse.clip_by_global_norm(1.0), jaxfuse.adamw(1e-3, weight_decay=0.1))
  for shapes in ([(64 << 20,)], gpt2_small_shapes()):
    params = {f"p{i:03d}": jax.random.normal(jax.random.key(i), s) * 0.02
              for i, s in enumerate(shapes)}
    grads = jax.tree.map(lambda p: p * 0.5, params)
    state = tx.init(params)
    opt = jax.jit(lambda p, s, g: jaxfuse.fused_step(tx, g, s, p), donate_argnums=(0, 1))
    for _ in range(3):
      params, state = opt(params, state, grads)
    jax.block_until_ready(params)
  print("done")


if __name__ == "__main__":
  main()
