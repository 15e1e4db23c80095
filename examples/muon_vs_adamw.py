"""Muon against AdamW on the character-level language model of train_char_lm.py: the same model,
data, seed, steps, clip and learning-rate schedule, trained once with each optimizer
(``jaxfuse.adamw`` for every leaf; ``jaxfuse.muon`` for the layers' matrices, AdamW for the
embedding, head and norm gains), both through ``jaxfuse.fused_step``. Saves the two loss curves
and each optimizer's time per step as one PNG.

    python3 examples/muon_vs_adamw.py            # ~5 minutes on a 2-core CPU
    python3 examples/muon_vs_adamw.py --quick    # ~30-second smoke run
"""

from __future__ import annotations

import argparse
import os

import jax
import numpy as np

import train_char_lm as lm


def plot(histories: dict, path: str, title: str) -> str:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(9, 5.5))
  for (name, h), color in zip(histories.items(), ("tab:blue", "tab:orange")):
    loss = np.asarray(h["loss"])
    k = max(1, len(loss) // 40)
    smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
    label = f"{name}, {h['ms_per_step']:.0f} ms/step"
    ax.plot(np.asarray(h["step"])[k - 1:], smooth, color=color, lw=1.6,
            label=f"{label}: train ({k}-step mean)")
    ax.plot(h["val_step"], h["val_loss"], "o--", color=color, ms=4, lw=1,
            label=f"{name}: validation (final {h['val_loss'][-1]:.3f})")
  ax.set_xlabel("step")
  ax.set_ylabel("cross-entropy (nats / byte)")
  ax.set_ylim(top=min(4.0, ax.get_ylim()[1]))
  ax.grid(alpha=0.3)
  ax.legend()
  ax.set_title(title, fontsize=10)
  fig.tight_layout()
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def main() -> None:
  here = os.path.dirname(os.path.abspath(__file__))
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="~30-second smoke run")
  parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of both (3e-3)")
  parser.add_argument("--out", default=os.path.join(here, "out", "muon_vs_adamw.png"))
  args = parser.parse_args()
  preset = lm.PRESETS["quick" if args.quick else "default"]
  device = jax.devices()[0]
  corpus = lm.load_corpus(4 << 20)
  cfg = lm.build_model_config(vocab_size=256, dim=preset["dim"], n_layers=preset["layers"],
                              n_heads=preset["heads"], n_kv_heads=preset["kv_heads"],
                              max_seq_len=preset["seq_len"])
  histories = {}
  for name in ("adamw", "muon"):
    print(f"== {name}", flush=True)
    _, histories[name] = lm.train(cfg, corpus, steps=preset["steps"], batch=preset["batch"],
                                  seq_len=preset["seq_len"], lr=args.lr,
                                  log_every=preset["log_every"], device=device, optimizer=name)
  for name, h in histories.items():
    print(f"{name}: val loss {h['val_loss'][-1]:.4f}, {h['ms_per_step']:.1f} ms/step, "
          f"compile {h['compile_s']:.1f} s")
  title = (f"char LM (L={cfg.n_layers}, D={cfg.dim}), {preset['batch']}x{preset['seq_len']} "
           f"tokens/step, {preset['steps']} steps, peak lr {args.lr}, on {device.platform}")
  print(f"plot: {plot(histories, args.out, title)}")


if __name__ == "__main__":
  main()
