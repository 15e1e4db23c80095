"""Runs each jaxfuse CUDA op on the GPU on fresh random inputs and compares it with the CPU
handler on the same inputs: how many output elements differ and by how much; the decoder's
stage-kernel schedule against its persistent one on the GPU, bit for bit. Small and quick on
purpose: tools/gpu_check.sh runs it under compute-sanitizer, one op per process. Exits non-zero
when a case's results differ by more than rounding can explain, or the two schedules' bits
differ.

  python3 tools/gpu_ops.py [norm] [adam] [families] [decoder]     # default: all four
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxfuse
from jaxfuse._optim import families

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from helpers import random_decoder_problem, random_tree  # noqa: E402  (the tests' inputs)

SHAPES = [(), (1,), (7,), (1023,), (3, 17), (257, 129), (4096 * 9 + 5,), (96, 512)]  # last: 8-bit


def on(device, x):
  return jax.device_put(x, device)


def compare(name, gpu, cpu):
  """One line: leaves, elements that differ, the largest difference in units of the leaf's max."""
  n = differ = 0
  worst = 0.0
  for a, b in zip(jax.tree.leaves(gpu), jax.tree.leaves(cpu)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    n += a.size
    ne = ~((a == b) | (np.isnan(a) & np.isnan(b)))
    differ += int(ne.sum())
    if ne.any():
      worst = max(worst, float(np.max(np.abs(a - b)[ne]) / max(np.max(np.abs(b)), 1e-30)))
  print(f"{name:52s} {differ:7d} of {n:7d} elements differ (GPU vs CPU); max diff / leaf max {worst:.2e}")
  if worst > FAR_APART:
    FAR_APART_CASES.append(name)


# Rounding differences stay far below this; a wrong kernel (garbage, a skipped store) does not.
FAR_APART = 5e-2
FAR_APART_CASES = []
SCHEDULES_DIFFER = []  # decoder cases whose two schedules' bits differ on the GPU


def compare_schedules(name, stages, persistent):
  """One line: the elements of the stage kernels' results that are not the persistent kernel's
  bits (the same work on the same grid: there must be none)."""
  n = differ = 0
  for a, b in zip(jax.tree.leaves(stages), jax.tree.leaves(persistent)):
    a, b = np.asarray(a), np.asarray(b)
    n += a.size
    differ += int(np.sum(a.reshape(a.size, -1).view(np.uint8) != b.reshape(b.size, -1).view(np.uint8)))
  print(f"{name + ' stage kernels':52s} {differ:7d} of {n:7d} bytes differ from the persistent kernel's")
  if differ:
    SCHEDULES_DIFFER.append(name)


def run_norm(gpu, cpu):
  for dts, label in (([jnp.float32] * 7, "f32"), ([jnp.bfloat16] * 7, "bf16"),
                     ([jnp.float32, jnp.bfloat16, jnp.float16] * 2 + [jnp.float32], "mixed")):
    t = random_tree(1, SHAPES, dts)
    f = jax.jit(jaxfuse.global_norm)
    compare(f"global_norm {label}", f(on(gpu, t)), f(on(cpu, t)))


ADAM_CASES = {
    "adamw f32": (dict(), jnp.float32),
    "adamw f32 nesterov": (dict(nesterov=True), jnp.float32),
    "adamw f32 mu bf16": (dict(mu_dtype=jnp.bfloat16), jnp.float32),
    "adamw bf16 + f32 master": (dict(master_weights=True), jnp.bfloat16),
    "adamw bf16 + master, mu bf16": (dict(master_weights=True, mu_dtype=jnp.bfloat16), jnp.bfloat16),
    "adamw f16 + master": (dict(master_weights=True), jnp.float16),
    "adamw bf16 (no master)": (dict(), jnp.bfloat16),
    # Fewer bytes per param (rounding.h): the GPU must store the CPU's bits.
    "adamw f32, mu + nu bf16": (dict(mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16), jnp.float32),
    "adamw bf16 + remainders": (dict(master_weights="remainder"), jnp.bfloat16),
    "adamw bf16 stochastic rounding": (dict(stochastic_rounding=True, seed=3), jnp.bfloat16),
    "adamw f16 stochastic rounding": (dict(stochastic_rounding=True, seed=4), jnp.float16),
    # 8-bit moments (moment_codes.h): a warp's block maxima and codes, the CPU's bits.
    "adamw f32 8-bit moments": (dict(moment_bits=8), jnp.float32),
    "adamw bf16 + remainders, 8-bit moments": (dict(master_weights="remainder", moment_bits=8),
                                               jnp.bfloat16),
    "adamw bf16 + master, 8-bit moments": (dict(master_weights=True, moment_bits=8), jnp.bfloat16),
}


def family_cases():
  """Every family but Adam (ADAM_CASES): each variant (state layout, flags) in float32; the first
  with bf16 params and a master copy, and (element-wise families) stochastic rounding; the one
  with the most state lists in 8 bits (where taken), in float32 and with bf16 params and their
  remainders (a remainder for every leaf, 8-bit states for the large ones); and Muon (its
  matrices' element pass beside AdamW's, the Newton-Schulz chains XLA's on each device)."""
  muon = lambda **kw: jaxfuse.muon(1e-2, weight_decay=0.1, **kw)
  cases = {"muon f32": (muon, {}, jnp.float32),
           "muon bf16 + master": (muon, dict(master_weights=True), jnp.bfloat16),
           "muon bf16 stochastic rounding, gram": (
               muon, dict(stochastic_rounding=True, ns_method="gram"), jnp.bfloat16)}
  for family in families.registered():
    if family.name == "adam":
      continue
    first, fullest = family.variants[0], family.fullest()
    cases.update({f"{v.label} f32": (v, {}, jnp.float32) for v in family.variants})
    cases[f"{first.label} bf16 + master"] = (first, dict(master_weights=True), jnp.bfloat16)
    if not family.trust_ratio:
      cases[f"{first.label} bf16 stochastic rounding"] = (first, dict(stochastic_rounding=True),
                                                          jnp.bfloat16)
    if family.takes("moment_bits"):
      cases[f"{fullest.label} f32 8-bit"] = (fullest, dict(moment_bits=8), jnp.float32)
      cases[f"{fullest.label} bf16 + remainders, 8-bit"] = (
          fullest, dict(master_weights="remainder", moment_bits=8), jnp.bfloat16)
  return cases


def fused(tx):
  return jax.jit(lambda g, s, p: jaxfuse.fused_step(tx, g, s, p), donate_argnums=(1, 2))


def optax_step(tx):
  def step(g, s, p):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s
  return jax.jit(step, donate_argnums=(1, 2))


def run_adam(gpu, cpu):
  adamw = lambda **kw: jaxfuse.adamw(1e-2, weight_decay=0.1, **kw)
  cases = [(f"{label}{' + clip' if clip else ''}", fused, adamw, kw, dt, clip)
           for label, (kw, dt) in ADAM_CASES.items() for clip in (False, True)]
  # XLA's own arithmetic on the two platforms, for scale: optax itself, GPU vs CPU.
  optax_adamw = lambda **kw: optax.adamw(1e-2, weight_decay=0.1, **kw)
  cases += [("optax: adamw f32", optax_step, optax_adamw, {}, jnp.float32, False),
            ("optax: adamw f32 mu bf16", optax_step, optax_adamw, dict(mu_dtype=jnp.bfloat16),
             jnp.float32, False)]
  run_steps(gpu, cpu, cases)


def run_families(gpu, cpu):
  run_steps(gpu, cpu, [(f"{label}{' + clip' if clip else ''}", fused, make, kw, dt, clip)
                       for label, (make, kw, dt) in family_cases().items() for clip in (False, True)])


def run_steps(gpu, cpu, cases):
  """Five steps of each case's optimizer on each device from the same inputs, compared."""
  for label, make_step, make, kw, dt, clip in cases:
    inner = make(**kw)
    tx = optax.chain(jaxfuse.clip_by_global_norm(1.0), inner) if clip else inner
    step = make_step(tx)
    out = {}
    for name, device in (("gpu", gpu), ("cpu", cpu)):
      p = on(device, random_tree(2, SHAPES, dt))
      s = tx.init(p)
      for t in range(5):
        g = on(device, random_tree(10 + t, SHAPES, dt))
        p, s = step(g, s, p)
      out[name] = (p, s)
    compare(f"{label} (5 steps)", out["gpu"], out["cpu"])


# (activations, matrices, batch, max_seq_len): fp32 and fp16 (the FMA GEMVs), bf16 (tensor cores,
# one 8-row batch tile), int8 / fp8 under bf16, bf16 at batch 12 (two batch tiles) over 1024
# positions (each warp's attention loop takes several rounds), and int8 / fp8 matrices of every
# code (every_code(); last, so that the sanitizer steps' time limits reach the others first),
# widened to bf16 for the tensor cores (bf16 and fp16 activations) and to fp32 for the FMA GEMVs
# (fp32 activations).
DECODER_CASES = [(jnp.float32, None, 3, 96), (jnp.float16, None, 3, 96),
                 (jnp.bfloat16, None, 3, 96), (jnp.bfloat16, "int8", 3, 96),
                 (jnp.bfloat16, "fp8", 3, 96), (jnp.bfloat16, None, 12, 1024),
                 (jnp.bfloat16, "int8 every code", 3, 96), (jnp.bfloat16, "fp8 every code", 3, 96),
                 (jnp.float16, "int8 every code", 3, 96), (jnp.float32, "int8 every code", 3, 96),
                 (jnp.float32, "fp8 every code", 3, 96)]


def every_code(weights, quantization, seed):
  """The 8-bit matrices' codes drawn uniformly, so that each code's widening (to bf16 or fp32)
  shows in the sums: int8 from all 256; fp8 from the 48 of its three lowest binades, a third of
  them subnormal (quantized weights hardly ever hold one, and a widening that flushed them would
  change nothing visible)."""
  from jaxfuse._decode.quantize import MATRICES
  rng = np.random.default_rng(seed)
  fp8_codes = np.array([c for c in range(256) if c & 0x78 < 0x18], np.uint8)
  drawn = {}
  for name in MATRICES:
    shape = getattr(weights, name).shape
    if quantization == "int8":
      drawn[name] = jnp.asarray(rng.integers(-128, 128, shape, dtype=np.int8))
    else:
      codes = rng.choice(fp8_codes, shape)
      drawn[name] = jnp.asarray(codes.view(jnp.float8_e4m3fn))
  return weights._replace(**drawn)


def run_decoder(gpu, cpu):
  for dt, matrices, batch, seq in DECODER_CASES:
    quantization = matrices.split()[0] if matrices else None
    cfg = jaxfuse.DecoderConfig(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                                head_dim=64, intermediate_size=640, max_seq_len=seq,
                                quantization=quantization)
    x, w, cache = random_decoder_problem(cfg, batch, dt, seed=3)
    if matrices and matrices.endswith("every code"):
      w = every_code(w, quantization, seed=4)
    pos = jnp.asarray(np.linspace(0, seq - 1, batch).astype(np.int32))
    f = jax.jit(lambda x, p, w, c, s: jaxfuse.persistent_decoder(x, p, w, c, cfg, schedule=s),
                static_argnums=4)
    res = {name: f(*on(d, (x, pos, w, cache)), "persistent")
           for name, d in (("gpu", gpu), ("cpu", cpu))}
    weights = f" {matrices} matrices" if matrices else ""
    name = f"persistent_decoder {jnp.dtype(dt).name}{weights} batch {batch} context {seq}"
    compare(name, res["gpu"], res["cpu"])
    compare_schedules(name, f(*on(gpu, (x, pos, w, cache)), "stage_kernels"), res["gpu"])
  run_model_step(gpu, cpu)


# (dtype, tied head, batch, quantization): bf16 at batch 18 (the tensor-core head's two passes,
# of 16 staged rows in two batch tiles and of 2), fp32 untied at batch 3, bf16 with int8 matrices
# and head (jaxfuse.quantize: the tied head's own 8-bit rows) and fp16 with fp8 ones; the draws at temperature 0.8, plain or filtered in the kernel
# (top_k, top_p): both, top-k alone (its first pass finds the largest score), top-p alone.
MODEL_STEP_CASES = [(jnp.bfloat16, True, 18, None, (None, None)),
                    (jnp.float32, False, 3, None, (50, 0.9)),
                    (jnp.bfloat16, True, 5, "int8", (20, None)),
                    (jnp.float16, False, 3, "fp8", (None, 0.6))]


def run_model_step(gpu, cpu):
  """The whole-model step (embedding, layers, head, draw): logits against the CPU handler's, and
  the GPU's tokens against jax.random.categorical of its own logits after the top-k and top-p
  filters (_sample; they must be equal)."""
  from jaxfuse._decode import generation
  for dt, tied, batch, quantization, (top_k, top_p) in MODEL_STEP_CASES:
    cfg = jaxfuse.DecoderConfig(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                                head_dim=64, intermediate_size=640, max_seq_len=96)
    _, w, cache = random_decoder_problem(cfg, batch, dt, seed=4)
    rng = np.random.default_rng(5)
    embed = jnp.asarray(rng.standard_normal((1000, 256)), dt)
    head = None if tied else jnp.asarray(0.3 * rng.standard_normal((1000, 256)), dt)
    model = jaxfuse.DecoderModel(cfg, w, embed, jnp.ones((256,), dt), head)
    if quantization is not None:
      model = jaxfuse.quantize(model, quantization)
      cfg = model.config
    tokens = jnp.asarray(rng.integers(0, 1000, batch).astype(np.int32))
    pos = jnp.asarray(np.linspace(0, 95, batch).astype(np.int32))
    key = jax.random.key(6)
    f = jax.jit(lambda m, t, p, c, k, s: generation._model_step(m, cfg, t, p, c, 0.8, k, top_k,
                                                                top_p, schedule=s),
                static_argnums=5)
    args = (model, tokens, pos, cache, jax.random.key_data(key))
    res = {name: f(*on(d, args), "persistent") for name, d in (("gpu", gpu), ("cpu", cpu))}
    name = (f"whole-model step {jnp.dtype(dt).name} {'tied' if tied else 'untied'} batch {batch}"
            + (f" {quantization}" if quantization else "")
            + (f" top-k {top_k}" if top_k else "") + (f" top-p {top_p}" if top_p else ""))
    compare(name, res["gpu"][0], res["cpu"][0])
    compare_schedules(name, f(*on(gpu, args), "stage_kernels"), res["gpu"])
    drawn = generation._sample(jnp.asarray(np.asarray(res["gpu"][0])), key, 0.8, top_k, top_p)
    wrong = int(np.sum(np.asarray(res["gpu"][1]) != np.asarray(drawn)))
    print(f"{name + ' draws':52s} {wrong:7d} of {batch:7d} tokens differ from jax.random's")
    if wrong:
      FAR_APART_CASES.append(name + " draws")


def main(ops):
  gpu, cpu = jax.devices("cuda")[0], jax.devices("cpu")[0]
  runs = {"norm": run_norm, "adam": run_adam, "families": run_families, "decoder": run_decoder}
  for op in ops or runs:
    runs[op](gpu, cpu)
  problems = []
  if FAR_APART_CASES:
    problems.append(f"GPU and CPU differ by more than {FAR_APART} of a leaf's max in: "
                    + ", ".join(FAR_APART_CASES))
  if SCHEDULES_DIFFER:
    problems.append("the decoder's stage kernels and persistent kernel differ in: "
                    + ", ".join(SCHEDULES_DIFFER))
  if problems:
    sys.exit("; ".join(problems))


if __name__ == "__main__":
  main(sys.argv[1:])
