"""jaxfuse: fused multi-tensor optimizer and decode kernels for JAX, as XLA FFI custom calls.

Optimizer side (optax-compatible):
  adam, adamw          Adam/AdamW for a whole pytree in one fused kernel
  clip_by_global_norm  clipping whose norm and scale never leave the device
  global_norm          the L2 norm of a pytree, one call, deterministic
  fused_step           params and optimizer state updated in place (28 B/param fp32)
"""

from jaxfuse._ffi import backends
from jaxfuse.adam import AdamExtraState, adam, adamw
from jaxfuse.clip import clip_by_global_norm, global_norm
from jaxfuse.fused import fused_step

__version__ = "0.1.0"

__all__ = [
    "AdamExtraState",
    "adam",
    "adamw",
    "backends",
    "clip_by_global_norm",
    "fused_step",
    "global_norm",
]
