"""The pinned blocks the ``nvme`` params role stages shards in: a bounded pool, and making room in it.

A shard read from its swap file, uploaded from, or written back after a step
passes through a `HostCopy`: a block of the role's `PinnedArena`
(``buffer_bytes``) and the transfers still reading or writing it. A copy that
is no longer the group's current one is *retired* and goes back to the pool
once nobody uses it. A blocking allocation finds room by giving back blocks
read ahead but not used yet (the furthest ahead first); if all room is taken
by transfers in flight it waits for them, and where nothing can free room
(every block handed to a gather that has not ended) it takes a block outside
the pool, with a warning.
"""

from __future__ import annotations

import attrs
import torch

from zkernel.platform.aio import aligned_empty
from zkernel.telemetry.log import get_logger

from ._arena import Block, PinnedArena, aligned

log = get_logger()


@attrs.define(eq=False)
class HostCopy:
    """A block holding one shard image, and who still reads or writes it."""

    block: Block
    reading: int = 0  # reads in flight into it
    error: BaseException | None = None  # a read's failure
    writing: int = 0  # writes in flight from it
    write_error: BaseException | None = None
    in_use: bool = False  # without CUDA: handed to a gather as ``device_shard``
    waiters: int = 0  # fetches waiting for its reads (it is not given back meanwhile)
    uploads: list = attrs.field(factory=list)  # CUDA events of uploads reading it
    current: bool = True  # the group's host copy (else freed once nobody uses it)
    overflow: bool = False  # allocated outside the pool

    @property
    def busy(self) -> bool:
        return bool(self.reading or self.writing or self.in_use or self.uploads or self.waiters)


class ParamBlocks:
    """The pool of `NvmeParamsTier`'s host copies, and the copies retired but still in use.

    Shares the tier's ``slots`` (group index -> slot with ``host`` and
    ``ahead``) and its condition ``cv``, which every call holds: the main
    thread (reads ahead, fetches), the host worker (a step's `before_update`
    and `commit`), and the I/O queue's reaper (`collect_uploads` with
    ``query=False`` when a read or write completes).
    """

    def __init__(self, options, slots: dict, cv) -> None:
        self.options = options
        self._slots = slots
        self._cv = cv
        self.arena: PinnedArena | None = None
        self.retired: list[HostCopy] = []  # not current, still read or written
        self._warned_overflow = False

    def pool(self) -> PinnedArena:
        """The pool, sized at its first use from every group's shard (all are adopted by then)."""
        if self.arena is None:
            sizes = [aligned(s.nbytes) for s in self._slots.values()]
            size = self.options.buffer_bytes or min(
                2 * sum(sizes), self.options.lookahead_host_bytes + 4 * max(sizes, default=0)
            )
            self.arena = PinnedArena(size, pin=self.options.pin_memory, name="params")
        return self.arena

    def allocate(self, nbytes: int, *, wait: bool) -> HostCopy | None:
        """A block for ``nbytes`` (``_cv`` held); with ``wait``, room is made (see `NvmeParamsTier`)."""
        while True:
            self.collect_uploads()
            block = self.pool().allocate(nbytes)
            if block is not None:
                return HostCopy(block)
            if not wait:
                return None
            if self._give_back_read_ahead():
                continue
            if self._transfers_in_flight():
                self._cv.wait(timeout=0.005 if self._uploads_pending() else None)
                continue
            if not self._warned_overflow:
                self._warned_overflow = True
                log.warning(
                    "zkernel.nvme.params_pool_full", buffer_bytes=self.pool().capacity, nbytes=nbytes,
                    hint="every block is in use by a gather; raise offload.params_options.buffer_bytes",
                )
            data = aligned_empty(aligned(nbytes), torch.uint8, pin=self.options.pin_memory)
            return HostCopy(Block(-1, data.numel(), data), overflow=True)

    def _give_back_read_ahead(self) -> bool:
        """Free the idle read-ahead copy asked for last; whether one was found."""
        idle = [s for s in self._slots.values() if s.host is not None and not s.host.busy and s.host.error is None]
        if not idle:
            return False
        slot = max(idle, key=lambda s: s.ahead)
        self.retire(slot.host)
        slot.host = None
        return True

    def _transfers_in_flight(self) -> bool:
        copies = [s.host for s in self._slots.values() if s.host is not None] + self.retired
        return any(c.reading or c.writing or c.uploads for c in copies)

    def _uploads_pending(self) -> bool:
        copies = [s.host for s in self._slots.values() if s.host is not None] + self.retired
        return any(c.uploads for c in copies)

    def collect_uploads(self, *, query: bool = True) -> None:
        """Forget finished uploads and free retired copies nobody uses any more (``_cv`` held).
        ``query=False`` on the reaper thread, which makes no CUDA calls (it has no device bound)."""
        if query:
            for copy in [s.host for s in self._slots.values() if s.host is not None] + self.retired:
                if copy.uploads:
                    copy.uploads = [e for e in copy.uploads if not e.query()]
        still = []
        for copy in self.retired:
            if copy.busy:
                still.append(copy)
            else:
                self._free(copy)
        self.retired = still

    def retire(self, copy: HostCopy) -> None:
        copy.current = False
        if copy.busy:
            self.retired.append(copy)
        else:
            self._free(copy)

    def _free(self, copy: HostCopy) -> None:
        if copy.overflow:
            copy.block.data = copy.block.data[:0]
        elif self.arena is not None:
            self.arena.free(copy.block)
        self._cv.notify_all()
