"""A bounded pool of page-locked, aligned host memory handed out in blocks (the NVMe tiers' staging).

One buffer from `zkernel.platform.aio.aligned_empty` (page-locked when CUDA is
available: pinning is slow, so it is done once) is cut into blocks, first fit
over a sorted free list with neighbours merged on free. Every block starts
and ends on the O_DIRECT alignment, so a block feeds the disk directly and,
when pinned, the GPU at full speed. The caller serialises calls (the tiers
hold their lock). The buffer itself is allocated on first use, so a tier that
never moves anything pins nothing.
"""

from __future__ import annotations

import bisect

import attrs
import torch

from zkernel.platform.aio import ALIGNMENT, aligned_empty
from zkernel.telemetry.log import get_logger

log = get_logger()


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to the O_DIRECT alignment."""
    return -(-int(nbytes) // ALIGNMENT) * ALIGNMENT


@attrs.define(eq=False)
class Block:
    """``nbytes`` of the pool starting at ``offset``; ``data`` is its uint8 view."""

    offset: int
    nbytes: int
    data: torch.Tensor

    def view(self, dtype: torch.dtype, start: int, numel: int) -> torch.Tensor:
        """``numel`` elements of ``dtype`` starting ``start`` bytes into the block."""
        size = torch.empty((), dtype=dtype).element_size()
        return self.data[start : start + numel * size].view(dtype)


class PinnedArena:
    """``capacity`` bytes of aligned (page-locked) host memory, allocated in blocks."""

    def __init__(self, capacity: int, *, pin: bool | None, name: str) -> None:
        self.capacity = aligned(max(capacity, ALIGNMENT))
        self._pin = pin
        self._name = name
        self._buffer: torch.Tensor | None = None
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # (offset, nbytes), sorted by offset
        self.used = 0
        self.peak = 0

    def allocate(self, nbytes: int) -> Block | None:
        """A block of at least ``nbytes`` (rounded up to the alignment), or None when none is free."""
        need = aligned(max(nbytes, 1))
        for i, (offset, size) in enumerate(self._free):
            if size < need:
                continue
            if size == need:
                del self._free[i]
            else:
                self._free[i] = (offset + need, size - need)
            self.used += need
            self.peak = max(self.peak, self.used)
            return Block(offset, need, self._memory()[offset : offset + need])
        return None

    def free(self, block: Block) -> None:
        """Give ``block`` back (its views must not be used any more)."""
        start, size = block.offset, block.nbytes
        i = bisect.bisect_left(self._free, (start, 0))
        if i < len(self._free) and self._free[i][0] == start + size:  # merge with the next
            size += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:  # and the previous
            i -= 1
            start, size = self._free[i][0], self._free[i][1] + size
            del self._free[i]
        self._free.insert(i, (start, size))
        self.used -= block.nbytes
        block.data = block.data[:0]

    def _memory(self) -> torch.Tensor:
        if self._buffer is None:
            self._buffer = aligned_empty(self.capacity, torch.uint8, pin=self._pin)
            log.info("zkernel.nvme.buffer_pool", pool=self._name, nbytes=self.capacity)
        return self._buffer

    def close(self) -> None:
        """Drop the memory (freed once no block's view is alive any more)."""
        self._buffer = None
        self._free = [(0, self.capacity)]
        self.used = 0
