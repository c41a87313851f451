"""The page-locked staging buffers host-stepped groups round their updated parameters into.

Shared by the host tiers (``cpu``, ``nvme``): one `StagingPool` per tier
lends a buffer per step instead of every group keeping a compute-dtype copy
of its parameters.
"""

from __future__ import annotations

import threading
from collections import deque

import torch

from zkernel.platform.host_memory import host_empty

POOLED = object()  # `update_target` asked for a staging buffer: lent from the pool per step


class StagingPool:
    """Page-locked compute-dtype buffers shared by every host-stepped group.

    A host step rounds its updated parameters into one (taken at `acquire`) and
    the params tier uploads from it; the buffer goes back with an event on the
    h2d stream after that upload and is lent again once the event completed.
    ``count`` buffers as large as the largest group bound the host memory this
    takes, instead of a copy of every parameter.
    """

    def __init__(self, count: int, dtype: torch.dtype, pin: bool | None) -> None:
        self.count, self.dtype, self.pin = count, dtype, pin
        self._numel = 0
        self.buffers: list[torch.Tensor] = []
        self._free: deque = deque()  # (buffer, event after which it is free)
        self._cond = threading.Condition()

    def expect(self, numel: int) -> None:
        self._numel = max(self._numel, numel)

    def take(self, numel: int) -> torch.Tensor:
        """A free buffer's first ``numel`` elements, waiting for one to be given back if need be."""
        return self._take(numel, wait=True)

    def try_take(self, numel: int) -> torch.Tensor | None:
        """As `take`, or None at once when every buffer is lent."""
        return self._take(numel, wait=False)

    def _take(self, numel: int, wait: bool) -> torch.Tensor | None:
        with self._cond:
            if not self.buffers:
                self.buffers = [host_empty(self._numel, self.dtype, pin=self.pin) for _ in range(self.count)]
                self._free.extend((b, None) for b in self.buffers)
            while not self._free:
                if not wait:
                    return None
                self._cond.wait()
            buffer, event = self._free.popleft()
        if event is not None:
            event.synchronize()
        return buffer[:numel]

    def give(self, view: torch.Tensor, event) -> None:
        base = next(b for b in self.buffers if b.data_ptr() == view.data_ptr())
        with self._cond:
            self._free.append((base, event))
            self._cond.notify()

    def close(self) -> None:
        for _, event in self._free:
            if event is not None:
                event.synchronize()
        self.buffers, self._free = [], deque()
