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

[Note: backward order] A backward reaches a unit when the gradient reaches its
module's outputs, which happens in the reverse of the order the modules'
forwards *finished*, not of the order they started. The two differ wherever a
unit's module encloses others: a root that owns the embedding and the output
head starts first and finishes last, so its backward comes first and the last
block's right after it; a module that owns parameters of its own besides its
children's (``units = "modules"``) is reached in backward before its children.
Walking the start order backwards from such a unit prefetched nothing after
the root (it is first) and skipped a parent's children, so their gathers were
issued only by their own backward hooks and waited for at once (the last
block's gather exposed at every backward's start).
So each pass also records the order its groups finished in, and the backward
prefetcher walks that order reversed (as FSDP2 orders its backward prefetch by
the post-forward order). A pass whose finishes leave the recorded order is
off the trace, as one whose starts do.

Prefetched gathers are collectives, so the decision to prefetch must be the
same on every rank: it depends only on the module order, which every rank
shares (ranks that run different modules are an error, see
`zkernel.kernel.divergence`).
"""

from __future__ import annotations

from zkernel.spec.groups import ParamGroup
from zkernel.telemetry.log import get_logger

log = get_logger()


class ModuleTrace:
    """Records passes and predicts the next groups (see [Note: trace] and [Note: backward order])."""

    def __init__(self) -> None:
        self._traces: dict[bool, list[ParamGroup]] = {True: [], False: []}
        # Each kind's groups in the order a backward reaches them (its finish order reversed), and
        # where each is first reached.
        self._backward: dict[bool, list[ParamGroup]] = {True: [], False: []}
        self._positions: dict[bool, dict[int, int]] = {True: {}, False: {}}
        self.grad = True
        self.seen: list[ParamGroup] = []
        self.finished: list[ParamGroup] = []
        self._cursor = 0
        self._finish_cursor = 0
        self.on_track = False
        self.retraces = 0

    @property
    def trace(self) -> list[ParamGroup]:
        """The trace of the current kind of pass: the order its groups start their forward."""
        return self._traces[self.grad]

    @property
    def backward(self) -> list[ParamGroup]:
        """The order the current kind of pass's backward reaches its groups (see [Note: backward order])."""
        return self._backward[self.grad]

    def training(self) -> list[ParamGroup]:
        """The trace of passes with autograd (the order the next training forward most likely runs)."""
        return self._traces[True]

    def begin(self, grad: bool) -> None:
        """A forward pass starts (with autograd when ``grad``)."""
        self.grad = grad
        self.seen = []
        self.finished = []
        self._cursor = 0
        self._finish_cursor = 0
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

    def finish(self, group: ParamGroup) -> None:
        """``group``'s module finished its forward; a finish out of the recorded order takes the pass off the trace."""
        self.finished.append(group)
        done = self._backward[self.grad]
        expected = len(done) - 1 - self._finish_cursor
        if self.on_track and expected >= 0 and done[expected] is group:
            self._finish_cursor += 1
        else:
            self.on_track = False

    def position(self, group: ParamGroup) -> int | None:
        """Where the backward first reaches ``group`` in `backward`, if this pass followed the trace so far."""
        if not self.on_track:
            return None
        return self._positions[self.grad].get(group.index)

    def end(self) -> bool:
        """The pass ended: adopt its orders when they differ from the trace. Returns whether they did."""
        trace, backward = self._traces[self.grad], self._backward[self.grad]
        finished = self.finished[::-1]
        if not self.seen or (_same(self.seen, trace) and _same(finished, backward)):
            return False
        first = not trace
        self._traces[self.grad] = self.seen
        self._backward[self.grad] = finished
        positions: dict[int, int] = {}
        for i, group in enumerate(finished):
            positions.setdefault(group.index, i)
        self._positions[self.grad] = positions
        if not first:
            self.retraces += 1
        log.debug("zkernel.scheduler.trace", groups=len(self.seen), grad=self.grad, retrace=not first)
        return True


def _same(a: list[ParamGroup], b: list[ParamGroup]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))
