"""Progress of laying out swap files at `initialize`: a rank-0 bar for a person, and one log event.

Pre-allocating a large model's swap files and writing its initial values can
take minutes. `Preallocation` counts the bytes laid out against the total the
tier planned (`OptimizerTier.demand` / `ParamsTier.demand`) on a
`zkernel.telemetry.progress` bar (rank 0, stderr a terminal, ``ZKERNEL_PROGRESS``
overrides), which also stays off when the ``zkernel`` logger is set above
WARNING (a program that silenced the library's warnings wants no bars from it).
It always logs one ``zkernel.nvme.preallocated`` event (INFO) with the files,
bytes and seconds.
"""

from __future__ import annotations

import logging
import time

from zkernel.telemetry.log import ROOT, get_logger
from zkernel.telemetry.progress import progress

log = get_logger()


class Preallocation:
    """Bytes of one tier's swap files laid out so far (see the module docstring)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.total = 0
        self.done_bytes = 0
        self.files = 0
        self._bar = None
        self._shown = 0  # bytes the bar has been advanced by (capped at the plan)
        self._start: float | None = None
        self._finished = False

    def plan(self, total: int) -> None:
        """The bytes the tier expects to lay out (from its `demand`)."""
        self.total = max(0, int(total))

    def advance(self, nbytes: int) -> None:
        """One more file laid out (pre-allocated and its initial values written)."""
        if self._finished:
            return
        if self._start is None:
            self._start = time.perf_counter()
            quiet = not logging.getLogger(ROOT).isEnabledFor(logging.WARNING)
            self._bar = progress(self.total or None, f"zkernel: laying out {self.what} swap files", enabled=False if quiet else None)
        self.done_bytes += nbytes
        self.files += 1
        if self._bar is not None:
            step = min(nbytes, max(0, self.total - self._shown)) if self.total else nbytes
            self._shown += step
            self._bar.update(step)
            if self.total and self.done_bytes >= self.total:  # the plan is met: off the screen before training prints
                self._close_bar()

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def finish(self) -> None:
        """Close the bar and log the totals (called at the tier's first use and at close). Idempotent."""
        if self._finished or self._start is None:
            return
        self._finished = True
        self._close_bar()
        log.info(
            "zkernel.nvme.preallocated",
            what=self.what,
            files=self.files,
            nbytes=self.done_bytes,
            seconds=round(time.perf_counter() - self._start, 3),
        )
