"""A progress bar for laying out swap files at `initialize` (rank 0 only; quiet unless a person watches).

Pre-allocating a large model's swap files and writing its initial values can
take minutes. `Preallocation` counts the bytes laid out against the total the
tier planned (`OptimizerTier.demand` / `ParamsTier.demand`) and shows them as a
tqdm bar on stderr, on rank 0 only, when stderr is a terminal and the
``zkernel`` logger lets warnings through (its default: raise its level above
WARNING to silence the bar along with the library's warnings). It always logs
one ``zkernel.nvme.preallocated`` event (INFO) with the bytes and seconds.
"""

from __future__ import annotations

import logging
import sys
import time

from zkernel.log import ROOT, get_logger

log = get_logger()


def bar_wanted(rank: int) -> bool:
    """Whether a progress bar may be shown by this rank: rank 0, stderr a terminal, warnings on."""
    stream = sys.stderr
    tty = stream is not None and hasattr(stream, "isatty") and stream.isatty()
    return rank == 0 and tty and logging.getLogger(ROOT).isEnabledFor(logging.WARNING)


class Preallocation:
    """Bytes of one tier's swap files laid out so far (see the module docstring)."""

    def __init__(self, rank: int, what: str) -> None:
        self.rank = rank
        self.what = what
        self.total = 0
        self.done_bytes = 0
        self.files = 0
        self._bar = None
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
            if self.total > 0 and bar_wanted(self.rank):
                from tqdm import tqdm

                self._bar = tqdm(
                    total=self.total, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                    desc=f"zkernel: laying out {self.what} swap files", leave=False, dynamic_ncols=True,
                )
        self.done_bytes += nbytes
        self.files += 1
        if self._bar is not None:
            self._bar.update(min(nbytes, max(0, self.total - self._bar.n)))
            if self.done_bytes >= self.total:  # the plan is met: off the screen before training prints
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
