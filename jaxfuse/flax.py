"""flax helpers whose optimizer step is :func:`jaxfuse.fused_step`, in place (flax is optional:
``pip install 'jaxfuse[flax]'``).

* linen: ``jaxfuse.flax.TrainState``, flax's ``TrainState`` whose ``apply_gradients`` updates
  params and optimizer state in place (28 bytes per fp32 param) instead of ``tx.update`` then
  ``optax.apply_updates`` (a fresh update tree and a second pass);
* NNX: ``jaxfuse.flax.Optimizer``, ``nnx.Optimizer`` whose ``update`` does the same.

``tx`` is any transform :func:`jaxfuse.fused_step` accepts (a jaxfuse optimizer last: alone, in
``optax.chain`` after ``jaxfuse.clip_by_global_norm``, under ``optax.inject_hyperparams`` or
``jaxfuse.multi_steps``). States, checkpoints and everything else are flax's. Donate the train
state to the jitted step (``jax.jit(step, donate_argnums=0)``; NNX: ``nnx.jit(step,
donate_argnums=...)``) or XLA copies params and state first.
"""

from __future__ import annotations

from typing import Any

import flax.nnx as nnx
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from flax.nnx.training.optimizer import to_opt_state
from flax.training import train_state

from jaxfuse._core import packing as _packing

from jaxfuse._optim.fused import fused_step


class TrainState(train_state.TrainState):
  """``flax.training.train_state.TrainState`` with an in-place ``apply_gradients``.

  ``TrainState.create(apply_fn=..., params=..., tx=jaxfuse.adamw(...))`` as with flax's; the
  state is flax's (same fields, same ``opt_state``), so it checkpoints and restores alike.
  """

  def apply_gradients(self, *, grads: Any, grad_scale: Any = None, **kwargs) -> "TrainState":
    """``step + 1`` and params and ``opt_state`` after one :func:`jaxfuse.fused_step` on
    ``grads`` (``grad_scale``: an optional loss scale, divided out as the kernels read the
    gradients); ``kwargs`` replace other fields, as in flax. fp8 ``OVERWRITE_WITH_GRADIENT``
    params are overwritten with their gradients, as flax does."""
    owg = OVERWRITE_WITH_GRADIENT in grads
    grads_with_opt = grads["params"] if owg else grads
    params_with_opt = self.params["params"] if owg else self.params
    new_params_with_opt, new_opt_state = fused_step(self.tx, grads_with_opt, self.opt_state,
                                                    params_with_opt, grad_scale=grad_scale)
    new_params = ({"params": new_params_with_opt,
                   OVERWRITE_WITH_GRADIENT: grads[OVERWRITE_WITH_GRADIENT]}
                  if owg else new_params_with_opt)
    return self.replace(step=self.step + 1, params=new_params, opt_state=new_opt_state, **kwargs)


class Optimizer(nnx.Optimizer):
  """``flax.nnx.Optimizer`` whose ``update`` runs :func:`jaxfuse.fused_step`.

  ``jaxfuse.flax.Optimizer(model, jaxfuse.adamw(...), wrt=nnx.Param)`` as with nnx's.
  """

  def __init__(self, model, tx, *, wrt, **kwargs) -> None:
    super().__init__(model, tx, wrt=wrt, **kwargs)
    if _packing.contains_packed(self.opt_state):
      # update() hands the transform plain arrays (no Variables); a packed state's layout,
      # made by init, must describe that tree.
      params = nnx.as_pure(nnx.state(model, wrt, graph=self.graph))
      self.opt_state = nnx.data(to_opt_state(tx.init(params)))

  def update(self, model, grads, /, *, grad_scale: Any = None) -> None:
    """Updates the model's ``wrt`` variables and the optimizer state in place from ``grads``
    (from ``nnx.grad``) and advances ``step``. Unlike ``nnx.Optimizer.update`` it returns
    nothing: the in-place step makes no update tree. ``grad_scale``: an optional loss scale."""
    params = nnx.as_pure(nnx.state(model, self.wrt, graph=self.graph))
    grads = nnx.as_pure(nnx.state(grads, self.wrt, graph=self.graph))
    new_params, new_opt_state = fused_step(self.tx, grads, nnx.as_pure(self.opt_state), params,
                                           grad_scale=grad_scale)
    nnx.update(model, new_params)
    nnx.update(self.opt_state, nnx.state(new_opt_state, graph=self.graph))
    self.step[...] += 1
