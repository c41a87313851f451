"""Dynamic loss scaling for fp16: halve on overflow, double after a window of clean steps.

[Note: loss-scale hysteresis] With ``hysteresis`` h > 1 (DeepSpeed's
``fp16.hysteresis``, 2 by default there) the scale tolerates h - 1
overflows before it halves: each overflow uses one up (its step is skipped
all the same), and once one is left every further overflow halves the
scale. The allowance is refilled when the scale grows, or, with
``consecutive_hysteresis``, after every clean step. The scale grows after
``window`` steps in a row without an overflow. This is DeepSpeed's
`DynamicLossScaler.update_scale`, so a run ported with its config keeps its
scales; with h = 1 (zkernel's default) every overflow halves the scale, as
torch's `GradScaler` does.
"""

from __future__ import annotations

from zkernel.log import get_logger

log = get_logger()


class DynamicLossScaler:
    """The scale the loss is multiplied by before backward, adapted to overflows."""

    def __init__(
        self,
        initial_scale: float,
        window: int,
        min_scale: float = 1.0,
        hysteresis: int = 1,
        consecutive_hysteresis: bool = False,
    ) -> None:
        self.scale = float(initial_scale)
        self.window = window
        self.min_scale = min_scale
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self._clean_steps = 0
        self._allowance = hysteresis  # overflows left before the next one halves the scale, plus one

    def state_dict(self) -> dict[str, float | int]:
        """JSON-serialisable state, for checkpoints."""
        return {
            "scale": self.scale,
            "window": self.window,
            "min_scale": self.min_scale,
            "clean_steps": self._clean_steps,
            "hysteresis_left": self._allowance,
        }

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self.min_scale = float(state["min_scale"])
        self._clean_steps = int(state["clean_steps"])
        # A checkpoint from before hysteresis, or from a run with another setting, starts full.
        self._allowance = min(int(state.get("hysteresis_left", self.hysteresis)), self.hysteresis)

    def update(self, overflow: bool) -> None:
        """Record one boundary step ([Note: loss-scale hysteresis])."""
        if overflow:
            self._clean_steps = 0
            if self._allowance > 1:
                self._allowance -= 1
                log.debug("zkernel.loss_scale.hysteresis", scale=self.scale, hysteresis_left=self._allowance)
                return
            self.scale = max(self.scale / 2.0, self.min_scale)
            log.debug("zkernel.loss_scale.backoff", scale=self.scale)
            return
        if self.consecutive_hysteresis:
            self._allowance = self.hysteresis
        self._clean_steps += 1
        if self._clean_steps >= self.window:
            self.scale *= 2.0
            self._clean_steps = 0
            self._allowance = self.hysteresis
            log.debug("zkernel.loss_scale.grow", scale=self.scale)
