"""The step's scaling and skip decisions: the loss scale, the norm read or not, the step's coefficient.

The step pipeline (`zkernel.kernel.step_pipeline.StepPipeline`) steps every
group with one gradient coefficient, which folds the loss unscale and the clip
factor; it is computed here from the global norm, where the norm is read. An
fp16 overflow anywhere shows up as a non-finite global norm on every rank, so
all ranks skip together.

[Note: non-finite gradients] A NaN or inf gradient is not applied, in any
precision, with clipping or without, wherever checking it costs no host sync
of its own: the global norm is computed at every boundary (its all-reduce is
the one clipping makes, so a non-finite gradient on one rank makes the norm inf
on every rank), and a non-finite norm skips the step on every rank, counted in
``skipped_steps`` and logged as ``zkernel.step.nonfinite`` (WARNING; fp16's
overflow at INFO, as the loss scale expects them). Host steps started during
backward with a known coefficient are checked first against their own group's
norm (a host value by then) and rolled back when another group or rank was not
finite, so they are taken only for an optimizer that can roll back.
Reading the norm makes the host wait for the end of backward. With clipping or
fp16 the step needs it anyway; on a CPU device, with an optimizer tier that
steps groups on the host (which waits for their gradients) or a tier whose
writes can fail (the outcome travels in the norm's all-reduce), the wait is
already there.
Where every group steps on a GPU with clipping off, it would be a new sync per
step (1-2% of GPT-1.3B's step on one H200: BENCHMARKS.md, issue 42's calls), so
there the norm is not read: the step gets a device flag instead, which the
optimizer honours on the device and the host reads one step late, before the
next step and before anything reads the counters ([Note: a non-finite flag
read one step late] in `zkernel.kernel.found_inf`); the step is skipped,
counted and warned all the same, only later. An optimizer that cannot honour
the flag (``takes_found_inf`` not declared) has the norm read instead.
"""

from __future__ import annotations

import math

import torch

from zkernel.kernel.loss_scale import DynamicLossScaler
from zkernel.kernel.step_pipeline import StepPipeline
from zkernel.spec.config import Config
from zkernel.telemetry.log import get_logger

log = get_logger()

__all__ = ["StepScaling"]


class StepScaling:
    """The loss scaler, whether a boundary reads the global norm, the step's coefficient from it,
    and the non-finite flag read one step late ([Note: non-finite gradients]).

    Built by `Engine.__init__` after its step pipeline, over that pipeline (whose tiers say
    whether the norm is free, and which holds the pending flag); it refers to neither the engine
    nor the scheduler ([Note: weak links] in `zkernel.kernel.wiring`). The engine calls it on the
    thread that runs a backward's prologue and epilogue (the training thread, or autograd's for a
    backward nobody announced) and on the training thread in `Engine.step`: `unscale` and
    `needs_norm` before a backward, `reads_norm` at its end, `coefficient_from` once a boundary
    has its norm, `settle_found_inf` before the next step and before anything reads counters or
    state.

    ``loss_scaler``: the fp16 run's `DynamicLossScaler` (None in other precisions);
    ``last_grad_norm``: the last global norm read on the host, unscaled (None before any);
    ``norm_is_free``: whether reading the norm adds no host wait (None until the first
    `reads_norm` works it out; tests set it False to take the device-flag path on a CPU device,
    [Note: a non-finite flag read one step late] in `zkernel.kernel.found_inf`)."""

    def __init__(self, config: Config, pipeline: StepPipeline, device: torch.device, takes_found_inf: bool) -> None:
        self.loss_scaler = DynamicLossScaler.from_config(config) if config.precision == "fp16" else None
        self.max_norm = config.gradient_clipping
        self.last_grad_norm: float | None = None
        self.norm_is_free: bool | None = None
        self._pipeline = pipeline
        self._device = device
        self._takes_found_inf = takes_found_inf

    def needs_norm(self) -> bool:
        """Whether the step's coefficient depends on the global norm (clipping, or fp16's overflow check)."""
        return self.max_norm > 0 or self.loss_scaler is not None

    def reads_norm(self) -> bool:
        """Whether a boundary reads the global norm: where the step needs it, or where the host waits
        for the end of backward anyway ([Note: non-finite gradients])."""
        if self.norm_is_free is None:
            tier = self._pipeline.tier
            self.norm_is_free = (
                self._device.type == "cpu"
                or tier.may_fail_writes
                or self._pipeline.params_tier.may_fail_writes
                or any(tier.steps_on_host(group) for group in self._pipeline.trainable)
            )
        return self.needs_norm() or self.norm_is_free or not self._takes_found_inf

    def unscale(self) -> float:
        """The factor that takes gradients of the scaled loss back to the loss's (1 outside fp16)."""
        return 1.0 / self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def coefficient_from(self, norm: float | None, step: int) -> float | None:
        """The step's gradient coefficient (unscale x clip) from the global norm; None to skip (overflow).

        ``norm``: the scaled global norm, None where it was not read; ``step``: the step it is for, to log."""
        unscale = self.unscale()
        if norm is None:
            return unscale
        norm *= unscale
        self.last_grad_norm = norm
        if not math.isfinite(norm):
            if self.loss_scaler is None:
                log.warning("zkernel.step.nonfinite", step=step, norm=norm, action="skipped")
            return None
        max_norm = self.max_norm
        clip = min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 else 1.0
        return unscale * clip

    def settle_found_inf(self, step: int) -> bool:
        """Read the last step's device flag if it is pending ([Note: a non-finite flag read one step
        late] in `zkernel.kernel.found_inf`); a set flag warns. Returns whether that step (``step``,
        to log) was skipped: the engine then counts it and gives the schedule's rate for the steps
        actually applied."""
        if not self._pipeline.found_inf_pending or not self._pipeline.settle_found_inf():
            return False
        log.warning(
            "zkernel.step.nonfinite",
            step=step,
            norm=None,  # not read on the host: the device flag said some gradient was NaN or inf
            action="skipped",
            found="device flag",
        )
        return True
