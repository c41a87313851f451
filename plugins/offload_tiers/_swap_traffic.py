"""The swap-file traffic of one ``nvme`` role: its run directory, its I/O queue and its write failures.

Each role of the ``nvme`` tier (`NvmeTier`, `NvmeParamsTier`) holds one
`SwapTraffic` and delegates to it what both share about their files: where
they are (`RunDirectory`, [Note: run directories]), how they move (`IoQueue`,
[Note: one collector]), how a failed write is kept and reported ([Note: write
failures]), and how it all ends (`close`).
"""

from __future__ import annotations

import threading

from zkernel.telemetry.log import get_logger

from ._io_queue import IoQueue
from ._swap_dir import RunDirectory

log = get_logger()


class SwapTraffic:
    """A role's run directory and I/O queue, and the write failures not raised yet.

    Built on the main thread at the role's construction. `write_failed` runs
    on the I/O queue's reaper thread (a write's completion callback);
    `raise_failures` on whichever thread is about to update state (the main
    thread, autograd's for a step started during backward, the host worker
    for a params commit); `wait_writes` and `close` on the main thread.
    """

    def __init__(self, nvme_path, host_worker, *, threads: int, block_size: int, timeline, name: str) -> None:
        self.run_dir = RunDirectory.acquire(nvme_path, host_worker)
        self.io = IoQueue(threads=threads, block_size=block_size, timeline=timeline, name=name)
        self._lock = threading.Lock()
        self._failures: list[BaseException] = []

    def wait_writes(self) -> None:
        """Block until every swap-file write started so far is done (a group's writes start when its
        step ends: wait for the engine's pending updates first, ``engine.pipeline.wait_all()``)."""
        self.io.wait_idle()

    def write_failed(self, error: BaseException, name: str, path, note: str) -> None:
        """A swap-file write of ``name`` failed ([Note: write failures]): keep the error, with
        ``note``, for `raise_failures`, and log it now."""
        error.add_note(note)
        with self._lock:
            self._failures.append(error)
        log.error("zkernel.nvme.write_failed", group=name, path=str(path), error=str(error))

    def take_failures(self) -> list[BaseException]:
        """The write failures kept since the last call (or `raise_failures`), taken."""
        with self._lock:
            failures, self._failures = self._failures, []
        return failures

    def raise_failures(self) -> None:
        """Raise the write failures kept since the last call, the first with the others as notes."""
        with self._lock:
            failures, self._failures = self._failures, []
        if failures:
            first = failures[0]
            for other in failures[1:]:
                first.add_note(f"also failed: {other}")
            raise first

    def close(self, pool) -> None:
        """The last of the role's `close`: stop the I/O threads, then free ``pool`` (the role's
        `PinnedArena` or None: no I/O reads or writes it any more), remove the run directory."""
        self.io.close()
        if pool is not None:
            pool.close()
        self.run_dir.release()
        with self._lock:
            self._failures.clear()  # logged when they happened; the files are gone now, the values were given back

    @property
    def bytes_read(self) -> int:
        return self.io.bytes_read

    @property
    def bytes_written(self) -> int:
        return self.io.bytes_written


class SwapStats:
    """What a tier that holds a `SwapTraffic` as ``_traffic`` reports of it (both nvme roles):
    waiting for its writes, and the bytes it moved (the bench and the timeline read them)."""

    def wait_writes(self) -> None:
        """See `SwapTraffic.wait_writes`."""
        self._traffic.wait_writes()

    @property
    def bytes_read(self) -> int:
        return self._traffic.bytes_read

    @property
    def bytes_written(self) -> int:
        return self._traffic.bytes_written
