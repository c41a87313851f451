"""The order module-bound groups run in, relearnt from every pass, for the prefetcher.

[Note: trace] The prefetcher brings in the groups that will run next, which it
knows only from earlier passes. A model's order is not fixed: an evaluation
forward may skip modules, a data-dependent branch runs every other step, a
recomputation runs inside backward. So:

* there is one trace per kind of pass (with and without autograd), so an
  evaluation forward neither replaces the training order nor is predicted by it;
* every pass is recorded; at its end a recording that differs from the trace
  becomes the trace (it is what the next pass of that kind most likely does);
* during a pass the prefetcher is trusted only while the pass follows the
  trace: the first group that is not the one predicted takes the pass off the
  trace, and from there on nothing is prefetched in this pass (forward or its
  backward); what was prefetched and not used is dropped at the end of the pass
  by the scheduler's release of every module-bound group.

Prefetched gathers are collectives, so the decision to prefetch must be the
same on every rank: it depends only on the module order, which every rank
shares (ranks that run different modules are an error, see
`zkernel.divergence`).
"""

from __future__ import annotations

from zkernel.groups import ParamGroup
from zkernel.log import get_logger

log = get_logger()


class ModuleTrace:
    """Records passes and predicts the next groups (see [Note: trace])."""

    def __init__(self) -> None:
        self._traces: dict[bool, list[ParamGroup]] = {True: [], False: []}
        self._positions: dict[bool, dict[int, int]] = {True: {}, False: {}}
        self.grad = True
        self.seen: list[ParamGroup] = []
        self._cursor = 0
        self.on_track = False
        self.retraces = 0

    @property
    def trace(self) -> list[ParamGroup]:
        """The trace of the current kind of pass."""
        return self._traces[self.grad]

    def training(self) -> list[ParamGroup]:
        """The trace of passes with autograd (the order the next training forward most likely runs)."""
        return self._traces[True]

    def begin(self, grad: bool) -> None:
        """A forward pass starts (with autograd when ``grad``)."""
        self.grad = grad
        self.seen = []
        self._cursor = 0
        self.on_track = bool(self._traces[grad])

    def visit(self, group: ParamGroup) -> int | None:
        """``group`` runs its forward now: its position in the trace while the pass follows it, else None."""
        self.seen.append(group)
        trace = self._traces[self.grad]
        if self.on_track and self._cursor < len(trace) and trace[self._cursor] is group:
            self._cursor += 1
            return self._cursor - 1
        self.on_track = False
        return None

    def position(self, group: ParamGroup) -> int | None:
        """Where ``group`` first ran in the trace, if this pass followed the trace so far (backward)."""
        if not self.on_track:
            return None
        return self._positions[self.grad].get(group.index)

    def end(self) -> bool:
        """The pass ended: adopt its order when it differs from the trace. Returns whether it did."""
        trace = self._traces[self.grad]
        if not self.seen or (len(self.seen) == len(trace) and all(a is b for a, b in zip(self.seen, trace))):
            return False
        first = not trace
        self._traces[self.grad] = self.seen
        positions: dict[int, int] = {}
        for i, group in enumerate(self.seen):
            positions.setdefault(group.index, i)
        self._positions[self.grad] = positions
        if not first:
            self.retraces += 1
        log.debug("zkernel.scheduler.trace", groups=len(self.seen), grad=self.grad, retrace=not first)
        return True
