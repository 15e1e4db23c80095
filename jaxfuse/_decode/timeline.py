"""The persistent decoder's stage timeline: where one decode step's time goes, block by block.

A call with the ``timeline`` flag has every block of the CUDA kernel record, for each stage it
runs (the embedding; per layer [q|k|v], attention, the O projection, gate/up and down; the LM
head and the draw of a whole-model step), when it entered the stage, when its first wait for
other blocks' results ended, when it left, and how long it waited in all (``StageTime`` in
csrc/decoder/decoder_workspace.h), on the device's global timer. The CPU handler records its stages as
one block that never waits. Every call keeps the clock; only a timeline call writes it out, so
the kernel timed is the kernel that runs.

What the numbers say (:meth:`StageTimeline.summary`): the step's time splits into the stages'
*shares*, the time from one stage's last block to leave to the next stage's, which add up to the
step; a block's *work* (its time in a stage less its waits) against its *wait* tells a stage
bound by its own loads and math from one that waits on the stage before; the *wake* latency,
from the previous stage's last block to leave to a block's first wait ending, is what one
boundary costs (the last split's finish, its release, the polls, the block's sync).

On the stage-kernel schedule (``schedule="stage_kernels"``) a stage's blocks are its own
launch's: a block's first wait is for the launch before, and a block may enter a stage before the
previous stage's last block leaves (its weights loading while that launch finishes).

  out, cache, timeline = layers_timeline(x, positions, w, cache, cfg)
  print(timeline.summary())
  timeline.plot("timeline.png")

``tools/decoder_timeline.py`` runs it on Llama-3.2-1B's shapes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse._decode.config import DecoderConfig, DecoderWeights, KVCache
from jaxfuse._decode.contract import _CONTRACT, _check_schedule, _workspace_layout
from jaxfuse._decode.generation import _check_model, _checked_step, _model_step
from jaxfuse._decode.kernel import _checked_operands, _decoder_step
from jaxfuse._decode.model import DecoderModel

# A layer's stages, in the order they run (decoder_plan.h's LayerStage).
LAYER_STAGES = tuple(_CONTRACT.names["layer_stages"])
_WORDS = 4  # a StageTime's 8-byte words: begin, ready, end, waited_ns | waits << 32


@dataclasses.dataclass(frozen=True)
class StageTimeline:
  """Every block's times in every stage of one decode step, in nanoseconds from the step's
  first block to enter its first stage.

  Attributes:
    names: the stages, in order: "embed", then "<layer>.<stage>" for each layer and stage of
      LAYER_STAGES, then "head" and "sample" when the step ran them.
    begin, end: int64 [blocks, stages], when each block entered and left each stage.
    ready: int64 [blocks, stages], when its first wait ended (-1: it did not wait).
    waited: int64 [blocks, stages], its time in waits.
    waits: int64 [blocks, stages], how many waits.
  """

  names: tuple[str, ...]
  begin: np.ndarray
  ready: np.ndarray
  end: np.ndarray
  waited: np.ndarray
  waits: np.ndarray

  @classmethod
  def from_workspace(cls, workspace, layout: dict[str, int], layers: int,
                     model_stages: int = 0) -> StageTimeline:
    """The timeline in a call's workspace bytes (``layout``: :func:`_workspace_layout`'s), of a
    step of ``layers`` layers that ran ``model_stages`` of the head and the draw."""
    raw = np.asarray(workspace)[layout["timeline"]:]
    header = raw[:layout["timeline_header_bytes"]].view(np.uint64)
    blocks = min(int(header[0]), layout["timeline_blocks"])
    slots = layout["timeline_slots"]
    used = 1 + len(LAYER_STAGES) * layers + model_stages
    size = blocks * slots * layout["timeline_record_bytes"]
    records = raw[layout["timeline_header_bytes"]:][:size].view(np.uint64)
    records = records.reshape(blocks, slots, _WORDS)[:, :used].astype(np.int64)
    if blocks == 0 or (records[..., 0] == 0).any():
      raise RuntimeError(f"the decoder's timeline is incomplete ({blocks} blocks recorded)")
    t0 = records[..., 0].min()
    ready = np.where(records[..., 1] > 0, records[..., 1] - t0, -1)
    names = ("embed",) + tuple(f"{layer}.{stage}" for layer in range(layers)
                               for stage in LAYER_STAGES) + ("head", "sample")[:model_stages]
    return cls(names=names, begin=records[..., 0] - t0, ready=ready, end=records[..., 2] - t0,
               waited=records[..., 3] & 0xFFFFFFFF, waits=records[..., 3] >> 32)

  @property
  def blocks(self) -> int:
    return self.begin.shape[0]

  @property
  def resolution_ns(self) -> int:
    """The smallest step between two distinct times recorded: the clock's resolution, at most."""
    stamps = np.unique(np.concatenate([self.begin.ravel(), self.end.ravel(),
                                       self.ready[self.ready >= 0]]))
    return int(np.diff(stamps).min()) if stamps.size > 1 else 0

  @property
  def step_ns(self) -> int:
    """From the first block to enter the first stage to the last to leave the last."""
    return int(self.end[:, -1].max())

  def stage_rows(self) -> list[dict]:
    """Per stage, in microseconds: its ``share`` of the step (from the previous stage's last
    block out to its own; the shares add up to the step), its ``span`` (first block in to last
    out), the median block's ``work`` (its time in the stage less its waits) and ``wait``, and
    the median ``wake`` (from the previous stage's last block out to a block's first wait
    ending; over the blocks that waited; negative where a stage waits for some of the previous
    stage's groups only, as attention for its q, k and v tiles)."""
    last_out = self.end.max(axis=0)
    before = np.concatenate([[0], last_out[:-1]])
    rows = []
    for s, name in enumerate(self.names):
      waited = self.ready[:, s] >= 0
      wake = np.median(self.ready[waited, s] - before[s]) if waited.any() else np.nan
      rows.append({"stage": name, "share": (last_out[s] - before[s]) / 1e3,
                   "span": (last_out[s] - self.begin[:, s].min()) / 1e3,
                   "work": np.median(self.end[:, s] - self.begin[:, s] - self.waited[:, s]) / 1e3,
                   "wait": np.median(self.waited[:, s]) / 1e3, "wake": wake / 1e3})
    return rows

  def summary(self) -> str:
    """A markdown table of :meth:`stage_rows` with the layers' stages averaged over the layers
    (the embedding, head and draw as they are), and the step's total."""
    rows = self.stage_rows()
    kinds: dict[str, list[dict]] = {}
    for row in rows:
      kinds.setdefault(row["stage"].split(".")[-1], []).append(row)
    fields = ("share", "span", "work", "wait", "wake")
    lines = [f"{self.blocks} blocks, step {self.step_ns / 1e3:.1f} us (layers' stages: the mean "
             f"over the layers; the clock's steps {self.resolution_ns} ns or finer)", "",
             "| stage | share of step us | span us | work us (median block) | wait us (median "
             "block) | wake us (median) |", "|---|---:|---:|---:|---:|---:|"]
    for kind, group in kinds.items():
      means = [np.nanmean([r[f] for r in group]) if not all(np.isnan(r[f]) for r in group)
               else np.nan for f in fields]
      lines.append(f"| {kind} | " + " | ".join("-" if np.isnan(v) else f"{v:.1f}"
                                                for v in means) + " |")
    return "\n".join(lines)

  def plot(self, path: str, layers: tuple[int, ...] = (1,)) -> None:
    """Saves a PNG: every block's stages over time, the whole step and the ``layers`` alone
    (waits light, work in the stage's color)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(zip(("embed",) + LAYER_STAGES + ("head", "sample"), plt.cm.tab10.colors))
    views = [("the whole step", range(len(self.names)))]
    for layer in layers:
      first = 1 + len(LAYER_STAGES) * layer
      if first + len(LAYER_STAGES) <= len(self.names):
        views.append((f"layer {layer}", range(first, first + len(LAYER_STAGES))))
    fig, axes = plt.subplots(len(views), 1, figsize=(12, 4 * len(views)), squeeze=False)
    for ax, (title, stages) in zip(axes[:, 0], views):
      for s in stages:
        kind = self.names[s].split(".")[-1]
        for b in range(self.blocks):
          start, ready, stop = self.begin[b, s], self.ready[b, s], self.end[b, s]
          work_from = ready if ready >= 0 else start
          ax.broken_barh([(start / 1e3, (work_from - start) / 1e3)], (b, 1),
                         color=colors[kind], alpha=0.25)
          ax.broken_barh([(work_from / 1e3, (stop - work_from) / 1e3)], (b, 1),
                         color=colors[kind])
      ax.set_title(f"{title}: light = before the block's first wait ended")
      ax.set_xlabel("us from the step's start")
      ax.set_ylabel("block")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, list(colors), loc="upper right", ncol=len(colors))
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _check_rows_present(fn: str, batch: int) -> None:
  """A step of no rows runs no stage: it has no timeline."""
  if batch == 0:
    raise ValueError(f"{fn}: a step of 0 rows runs no stage and records no timeline")


def layers_timeline(x, positions, w: DecoderWeights, cache: KVCache, cfg: DecoderConfig,
                    schedule: str = "persistent") -> tuple[jax.Array, KVCache, StageTimeline]:
  """:func:`jaxfuse.persistent_decoder`'s step on ``schedule``, recording its timeline (one
  device's call).

  Returns:
    ``(h_out, new_cache, timeline)``, the first two as :func:`jaxfuse.persistent_decoder`'s.
  """
  _check_schedule("layers_timeline", schedule)
  x, positions, w, cache = _checked_operands(x, positions, w, cache, cfg)
  _check_rows_present("layers_timeline", x.shape[0])
  step = _decoder_step(cfg, None, True, schedule)
  out, k, v, workspace = step(x, positions, jnp.asarray(cfg.rope_inv_freq()), w, cache.k,
                              cache.v, ())
  layout = _workspace_layout(cfg, x.shape[0], x.dtype, timeline=True)
  return out, KVCache(k, v), StageTimeline.from_workspace(workspace, layout, cfg.num_layers)


def model_timeline(model: DecoderModel, tokens, positions, cache: KVCache, sample: bool = True,
                   schedule: str = "persistent") -> tuple[jax.Array, KVCache, StageTimeline]:
  """One whole-model step (:func:`jaxfuse.decode_step`) on ``schedule``, with the greedy draw in
  the kernel when ``sample``, recording its timeline (one device's call).

  Returns:
    ``(logits, new_cache, timeline)``.
  """
  _check_model("model_timeline", model)
  _check_schedule("model_timeline", schedule)
  tokens, positions, cfg = _checked_step(model, tokens, positions, cache)
  _check_rows_present("model_timeline", tokens.shape[0])
  tokens, positions = tokens.astype(jnp.int32), positions.astype(jnp.int32)
  outs = _model_step(model, cfg, tokens, positions, cache, 0.0 if sample else None,
                     jnp.zeros((2,), jnp.uint32) if sample else None, timeline=True,
                     schedule=schedule)
  logits, k, v, workspace = outs[0], outs[-3], outs[-2], outs[-1]
  layout = _workspace_layout(cfg, tokens.shape[0], model.dtype, timeline=True)
  timeline = StageTimeline.from_workspace(workspace, layout, cfg.num_layers, 1 + int(sample))
  return logits, KVCache(k, v), timeline
