"""`EngineModule`: the model the Trainer's loop drives, an engine behind ``nn.Module``'s face.

The Trainer calls what it wraps (``model(**inputs)`` for the loss and for evaluation),
switches it between ``train()`` and ``eval()``, and zeroes its gradients; the accelerator's
``backward`` (`zkernel.integrations.transformers.accelerator`) hands each micro-batch's loss to
`EngineModule.backward_and_step`.

[Note: the loss the Trainer scaled] The Trainer's ``training_step`` already normalises each
micro-batch's loss for the accumulation window (divided by the window's micro-batches, or by the
window's token count across ranks through ``num_items_in_batch``), and its loop adds the
micro-batches' gradients. ``engine.backward`` divides by ``gradient_accumulation_steps`` itself (as
DeepSpeed's engine does unless told ``scale_wrt_gas=False``, which the Trainer tells it), so the loss
goes in multiplied by that number: the window's gradient is the plain Trainer's, averaged across
ranks as DDP averages it.

[Note: a short last window] When an epoch's micro-batches do not divide by the accumulation steps,
the Trainer steps after fewer micro-batches at the epoch's end (and says so through the
accelerator's ``sync_gradients``). The engine counts its windows in micro-batches, so its count is
moved on to that window's last place before the backward: the engine steps there too, with the
window's gradients, and the next epoch's windows start aligned again.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zkernel.telemetry.log import get_logger

log = get_logger()


class EngineModule(nn.Module):
    """The model (``.module``) as the engine (``.engine``) runs it: calling it runs the engine's forward.

    Built by `ZKernelTrainer._wrap_model`; ``rate_source`` is the Trainer's `EngineOptimizer`
    when the Trainer's scheduler sets the rate (None where the config's schedule does).
    """

    def __init__(self, engine, rate_source=None) -> None:
        super().__init__()
        self.module = engine.module
        self.engine = engine
        self.rate_source = rate_source
        self.last_lr: list[float] = []  # the rate of the last step taken (empty before the first)
        self.last_step_skipped = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: the engine zeroes gradients after each step."""

    def backward_and_step(self, loss: torch.Tensor, *, window_ends: bool) -> None:
        """Back-propagate one micro-batch's loss (as the Trainer scaled it) and count it; at the end of the
        Trainer's accumulation window (``window_ends``) the engine steps. Called by the accelerator's
        ``backward`` on every rank."""
        engine = self.engine
        steps = engine.config.gradient_accumulation_steps
        if window_ends and not engine.is_accumulation_boundary:  # [Note: a short last window]
            engine.micro_steps += steps - 1 - engine.micro_steps % steps
        if engine.is_accumulation_boundary and self.rate_source is not None:
            engine.lr = self.rate_source.lr
        rate, applied, skipped = engine.lr, engine.global_steps, engine.skipped_steps
        engine.backward(loss * steps)  # [Note: the loss the Trainer scaled]
        engine.step()
        if engine.global_steps != applied:
            self.last_lr[:] = [rate]
            self.last_step_skipped = engine.skipped_steps != skipped

    def grad_norm(self) -> torch.Tensor | None:
        """The global gradient norm of the last step, before clipping (None where the engine did not need it)."""
        norm = self.engine.last_grad_norm
        return None if norm is None else torch.tensor(float(norm))
