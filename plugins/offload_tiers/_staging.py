"""Where host-stepped groups round their updated parameters into: their home, or a page-locked staging buffer.

Shared by the host tiers (``cpu``, ``nvme``): each tier's `HostUpdates` lends
a buffer of one `StagingPool` per step instead of every group keeping a
compute-dtype copy of its parameters.
"""

from __future__ import annotations

import threading
from collections import deque

import attrs
import torch

from zkernel.platform.host_memory import host_empty
from zkernel.platform.streams import record_event

from .device import update_target

POOLED = object()  # `update_target` asked for a staging buffer: lent from the pool per step


@attrs.define(eq=False)
class _Target:
    pooled: bool  # its rounded update goes through a shared staging buffer
    # Where its rounded update goes when not pooled (the parameters' home, or None): this tier's
    # own; a buffer a params tier lends as ``copy_out`` for one step is not counted here.
    update: torch.Tensor | None


class HostUpdates:
    """``group.copy_out`` of host-stepped groups: where the host step writes the rounded update.

    At `adopt` (main thread, `OptimizerTier.adopt`) a group's target is chosen
    once (`update_target`): the parameters' home when it is a host tensor
    (zero copy), None when the fp32 master is the update or the params tier
    lends a buffer per step, else a buffer of the shared `StagingPool`, lent at
    `lend` (the host worker, from `OptimizerTier.acquire`) and taken back at
    `take_back` (the host worker, from `OptimizerTier.release`, when the
    upload from it is queued on h2d: the buffer is lent again once h2d got
    past it).
    """

    def __init__(self, count: int, dtype: torch.dtype, pin: bool | None, streams) -> None:
        self.dtype = dtype
        self.streams = streams
        self.pool = StagingPool(count, dtype, pin)
        self._targets: dict[int, _Target] = {}

    def adopt(self, group) -> None:
        """Choose ``group``'s target and set ``group.copy_out`` (``group.master`` is set)."""
        group.copy_out = update_target(group, torch.device("cpu"), self.dtype, lambda n, dt: POOLED)
        pooled = group.copy_out is POOLED
        if pooled:
            group.copy_out = None  # lent from the staging pool for each step (`lend`)
            self.pool.expect(group.master.numel())
        self._targets[group.index] = _Target(pooled=pooled, update=group.copy_out)

    def lend(self, group) -> None:
        """A pooled group's staging buffer for this step (``group.master`` is set), unless a params tier lent one."""
        if self._targets[group.index].pooled and group.copy_out is None:
            group.copy_out = self.pool.take(group.master.numel())

    def take_back(self, group) -> None:
        """After the params tier's `commit`: a pooled group's buffer goes back once h2d got past its upload."""
        if self._targets[group.index].pooled and group.copy_out is not None:
            self.pool.give(group.copy_out, record_event(self.streams.h2d) if self.streams.h2d is not None else None)
            group.copy_out = None

    def buffers(self, group) -> list[torch.Tensor]:
        """What ``group``'s rounded updates are written into, as `zkernel_memory_tensors` counts it."""
        target = self._targets[group.index]
        if target.pooled:
            return self.pool.buffers
        return [target.update] if target.update is not None else []

    def close(self) -> None:
        self._targets.clear()
        self.pool.close()


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
