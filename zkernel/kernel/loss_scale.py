"""Dynamic loss scaling for fp16: halve on overflow, double after a window of clean steps.

[Note: loss-scale hysteresis] With ``hysteresis`` h > 1 (DeepSpeed's
``fp16.hysteresis``, 2 by default there) the scale tolerates h - 1
overflows before it halves: each overflow uses one up (its step is skipped
all the same), and once one is left every further overflow halves the
scale. The allowance is refilled when the scale grows, or, with
``consecutive_hysteresis``, after every clean step. The scale grows as
[Note: when the scale grows] says. This is DeepSpeed's
`DynamicLossScaler.update_scale` step for step, so a run ported with its
config keeps its scales; with h = 1 (zkernel's default) every overflow halves
the scale, as torch's `GradScaler` does.

[Note: when the scale grows] DeepSpeed counts, at a clean step, the clean
steps before it since the last overflow (or the start), and doubles the scale
when that count is a positive multiple of ``window``: the first growth comes
at the ``window + 1``-th clean step in a row, later ones every ``window``
clean steps (a growth does not restart the count; an overflow does, even one
the hysteresis absorbs). So with window 1000 the scale first doubles at the
1001st clean step, then at the 2001st, and so on. ``clean_steps`` counts the
clean steps since the last overflow, the current one included.

[Note: overflow at the minimum scale] The scale never goes below
``min_scale``. An overflow that would halve it there (at the default minimum
of 1: gradients that overflow fp16 unscaled) will most likely recur at every
later step, each skipped too, and a run that only logged it would go on
"training" a model that never changes. So
that overflow raises `LossScaleError` (DeepSpeed's ``raise_error_at_min_scale``,
on there by default), after the engine has recorded the skipped step: nothing
was changed, and the engine can still save a checkpoint. With
``error_at_min_scale`` off the step is skipped and the scale stays.
"""

from __future__ import annotations

from zkernel.telemetry.log import get_logger

log = get_logger()

__all__ = ["DynamicLossScaler", "LossScaleError"]


class LossScaleError(RuntimeError):
    """An fp16 overflow at the minimum loss scale ([Note: overflow at the minimum scale])."""


class DynamicLossScaler:
    """The scale the loss is multiplied by before backward, adapted to overflows."""

    def __init__(
        self,
        initial_scale: float,
        window: int,
        min_scale: float = 1.0,
        hysteresis: int = 1,
        consecutive_hysteresis: bool = False,
        error_at_min_scale: bool = False,
    ) -> None:
        self.scale = float(initial_scale)
        self.window = window
        self.min_scale = min_scale
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.error_at_min_scale = error_at_min_scale
        self._clean_steps = 0
        self._allowance = hysteresis  # overflows left before the next one halves the scale, plus one

    @classmethod
    def from_config(cls, config) -> DynamicLossScaler:
        """The scaler an fp16 run's `zkernel.spec.config.Config` asks for."""
        return cls(
            config.initial_loss_scale,
            config.loss_scale_window,
            min_scale=config.min_loss_scale,
            hysteresis=config.loss_scale_hysteresis,
            consecutive_hysteresis=config.loss_scale_consecutive_hysteresis,
            error_at_min_scale=config.loss_scale_error_at_min,
        )

    def state_dict(self) -> dict[str, float | int]:
        """JSON-serialisable state, for checkpoints."""
        return {
            "scale": self.scale,
            "window": self.window,
            "min_scale": self.min_scale,
            "clean_since_overflow": self._clean_steps,
            "hysteresis_left": self._allowance,
        }

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        # The configured minimum holds (a resumed run may set another); the scale respects it.
        self.scale = max(float(state["scale"]), self.min_scale)
        # Checkpoints from before [Note: when the scale grows] kept "clean_steps", the clean steps since
        # the last overflow or growth; taken as since the last overflow, the next growth comes one step later.
        self._clean_steps = int(state.get("clean_since_overflow", state.get("clean_steps", 0)))
        # A checkpoint from before hysteresis, or from a run with another setting, starts full.
        self._allowance = min(int(state.get("hysteresis_left", self.hysteresis)), self.hysteresis)

    def update(self, overflow: bool) -> None:
        """Record one boundary step ([Note: loss-scale hysteresis]); raise `LossScaleError` for an overflow
        at the minimum scale when asked to ([Note: overflow at the minimum scale])."""
        if overflow:
            self._clean_steps = 0
            if self._allowance > 1:
                self._allowance -= 1
                log.debug("zkernel.loss_scale.hysteresis", scale=self.scale, hysteresis_left=self._allowance)
                return
            if self.scale <= self.min_scale and self.error_at_min_scale:
                raise LossScaleError(
                    f"fp16 gradients overflowed at the minimum loss scale {self.min_scale:g}: the step was "
                    "skipped, and every later step would be too. Lower the learning rate, train in bf16, or "
                    "set min_loss_scale lower (or loss_scale_error_at_min = false to keep skipping)"
                )
            self.scale = max(self.scale / 2.0, self.min_scale)
            log.debug("zkernel.loss_scale.backoff", scale=self.scale)
            return
        if self.consecutive_hysteresis:
            self._allowance = self.hysteresis
        self._clean_steps += 1
        before = self._clean_steps - 1  # the clean steps before this one ([Note: when the scale grows])
        if before > 0 and before % self.window == 0:
            self.scale *= 2.0
            self._allowance = self.hysteresis
            log.debug("zkernel.loss_scale.grow", scale=self.scale)
