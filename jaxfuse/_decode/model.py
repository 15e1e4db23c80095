"""A whole decoder-only language model around the persistent decoder: embedding, layer stack,
final RMSNorm and LM head.

:class:`DecoderModel` holds what one decode step needs beyond the layer stack
(:class:`~jaxfuse.DecoderWeights`): the token embedding ``embed`` [V, D], the final norm weight
``final_norm`` [D] and the LM head ``lm_head`` [V, D] (Hugging Face's ``[out, in]`` layout), or
None when the head is tied to the embedding; a quantized model's head may be int8 or fp8 with a
scale per vocabulary row (``lm_head_scale``, :func:`jaxfuse.quantize`). It is a pytree (the
config and the stop tokens are static metadata), so it passes through ``jax.jit`` as one
argument. ``config.max_seq_len`` is the longest sequence the model supports (its
``max_position_embeddings``); the KV cache of a generation may be shorter.

:func:`jaxfuse.load_hf` builds one from a Hugging Face checkpoint; :func:`jaxfuse.generate` and
:func:`jaxfuse.decode_step` run it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxfuse._decode.config import DecoderConfig, DecoderWeights
from jaxfuse._decode.reference import _ref_rmsnorm

__all__ = ["DecoderModel"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecoderModel:
  """A decoder-only LM: ``logits = head(rmsnorm(stack(embed[tokens])) * final_norm)``.

  Attributes:
    config: the layer stack's static configuration (``max_seq_len``: the longest supported
      sequence).
    layers: the stacked layer weights, in the model's dtype.
    embed: [vocab, hidden] token embedding.
    final_norm: [hidden] weight of the RMSNorm after the last layer (eps ``config.rms_norm_eps``).
    lm_head: [vocab, hidden] output projection (``logits = h @ lm_head.T``), or None when tied to
      ``embed``. Quantized (``lm_head_scale`` set): int8 or float8_e4m3fn, the layer matrices'
      format, and ``logits = (h @ lm_head.T) * lm_head_scale``.
    lm_head_scale: float32 [vocab], the quantized head's scale per vocabulary row, or None.
    stop_tokens: the checkpoint's end-of-sequence token ids (metadata, e.g. for
      ``generate(..., stop_tokens=model.stop_tokens)``).
  """

  config: DecoderConfig = dataclasses.field(metadata=dict(static=True))
  layers: DecoderWeights
  embed: jax.Array
  final_norm: jax.Array
  lm_head: jax.Array | None = None
  lm_head_scale: jax.Array | None = None
  stop_tokens: tuple[int, ...] = dataclasses.field(default=(), metadata=dict(static=True))

  @property
  def dtype(self):
    return jnp.dtype(self.embed.dtype)

  @property
  def vocab_size(self) -> int:
    return int(self.embed.shape[0])

  @property
  def tied(self) -> bool:
    return self.lm_head is None

  @property
  def head_quantized(self) -> bool:
    return self.lm_head_scale is not None

  def embed_tokens(self, tokens) -> jax.Array:
    """int [...] -> [..., hidden] in the model's dtype (the decoder's input)."""
    return jnp.take(self.embed, tokens, axis=0)

  def logits(self, h) -> jax.Array:
    """Final RMSNorm (fp32) and LM head: [..., hidden] -> fp32 [..., vocab]. The head multiplies
    in the model's dtype with fp32 accumulation (full fp32 for an fp32 model); a quantized head's
    rows are widened to it (exactly) and their scales applied to the sums."""
    normed = _ref_rmsnorm(h.astype(jnp.float32), self.final_norm, self.config.rms_norm_eps)
    head = self.embed if self.lm_head is None else self.lm_head.astype(self.dtype)
    logits = jnp.einsum("...d,vd->...v", normed.astype(self.dtype), head,
                        preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
    return logits if self.lm_head_scale is None else logits * self.lm_head_scale
