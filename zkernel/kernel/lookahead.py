"""Which units each prefetch stage takes next, in amortised constant time per unit.

[Note: lookahead windows] Before every unit runs, the prefetcher starts each
stage (the all-gather, the upload to the device, the read into host memory) for
the units within that stage's byte budget after it in the pass's order. Walking
the order from the current unit on every call is quadratic: with small units
the window holds most of the model (the `bench/host_overhead.py` GPT, 147
units, spent a tenth of its step's host time under cProfile in that walk), and with
GPT-1.3B at one unit per module it walked ~15 units per call, 300 calls a step.

A stage's window after position ``p`` is the units ``i > p`` whose bytes from
``p + 1`` up to ``i`` (exclusive) are under the budget: with prefix sums of the
units' bytes, one bisection. Within a pass the position only grows (forward
positions follow the trace; backward positions the order a backward reaches
units), so each stage's window only moves forward, and a cursor per stage
remembers how far the stage has been handed units: each unit is handed to each
stage at most once per pass. The budget counts every unit in the window,
whether it needs the transfer or is already whole (a unit in use still holds
its bytes).

A unit a stage could not take yet (its update still running on the host, or an
occurrence of a unit that is in use now and runs again later in the order) is
handed again on the stage's next call: the caller moves the cursor back to it.
"""

from __future__ import annotations

import enum
from bisect import bisect_left
from collections.abc import Callable, Sequence

from zkernel.spec.groups import ParamGroup


class Stage(enum.IntEnum):
    """The prefetch stages, nearest first."""

    GATHER = 0
    DEVICE = 1
    HOST = 2


class Lookahead:
    """Per-pass cursors of the prefetch stages over one order (see [Note: lookahead windows])."""

    def __init__(self, nbytes: Callable[[ParamGroup], int]) -> None:
        self._nbytes = nbytes
        self._order: Sequence[ParamGroup] | None = None
        self._cumulative: list[int] = [0]
        self._repeats: list[bool] = []
        self._cursors = [0] * len(Stage)

    def restart(self) -> None:
        """A new pass begins: every stage may be handed every unit again."""
        self._cursors = [0] * len(Stage)

    def _index(self, order: Sequence[ParamGroup]) -> list[int]:
        if order is not self._order:  # a new trace: its prefix sums, once
            cumulative, seen, repeats = [0], set(), []
            for group in order:
                cumulative.append(cumulative[-1] + self._nbytes(group))
                repeats.append(group.index in seen)
                seen.add(group.index)
            self._order, self._cumulative, self._repeats = order, cumulative, repeats
            self.restart()
        return self._cumulative

    def take(self, order: Sequence[ParamGroup], position: int, budgets: Sequence[int]) -> list[range]:
        """For each stage (nearest first, ``budgets`` in bytes, each at least the one before), the
        indices of ``order`` after ``position`` in its window and beyond the nearer stage's that it
        was not handed yet in this pass; marks them handed."""
        cumulative = self._index(order)
        first = position + 1
        taken, nearer = [], first
        for stage, budget in zip(Stage, budgets):
            end = nearer
            if first < len(order) and budget > 0:
                end = max(nearer, min(len(order), bisect_left(cumulative, cumulative[first] + budget, first)))
            begin = max(nearer, self._cursors[stage])
            if begin < end:
                self._cursors[stage] = end
            taken.append(range(begin, end))
            nearer = end
        return taken

    def again(self, stage: Stage, index: int) -> None:
        """Hand ``index`` (and what follows it) to ``stage`` again on its next call."""
        self._cursors[stage] = min(self._cursors[stage], index)

    def repeats(self, index: int) -> bool:
        """Whether the unit at ``index`` of the current order also occurs earlier in it."""
        return self._repeats[index]
