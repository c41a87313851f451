"""Dynamic loss scaling for fp16: halve on overflow, double after a window of clean steps."""

from __future__ import annotations

from zkernel.log import get_logger

log = get_logger()


class DynamicLossScaler:
    """The scale the loss is multiplied by before backward, adapted to overflows."""

    def __init__(self, initial_scale: float, window: int, min_scale: float = 1.0) -> None:
        self.scale = float(initial_scale)
        self.window = window
        self.min_scale = min_scale
        self._clean_steps = 0

    def state_dict(self) -> dict[str, float | int]:
        """JSON-serialisable state, for checkpoints."""
        return {"scale": self.scale, "window": self.window, "min_scale": self.min_scale, "clean_steps": self._clean_steps}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self.min_scale = float(state["min_scale"])
        self._clean_steps = int(state["clean_steps"])

    def update(self, overflow: bool) -> None:
        """Record one boundary step: back off on overflow, grow after ``window`` clean steps."""
        if overflow:
            self.scale = max(self.scale / 2.0, self.min_scale)
            self._clean_steps = 0
            log.debug("zkernel.loss_scale.backoff", scale=self.scale)
            return
        self._clean_steps += 1
        if self._clean_steps >= self.window:
            self.scale *= 2.0
            self._clean_steps = 0
            log.debug("zkernel.loss_scale.grow", scale=self.scale)
