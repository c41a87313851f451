"""Device accumulation: a host-stepped group's gradient adds up on the GPU over a window and crosses once.

[Note: device accumulation] With gradient accumulation, every micro-batch's
gradient of a host-stepped group crossed to the host and was added there: per
element and micro-batch, 4 bytes over the link and 16 bytes of host memory
traffic (the copy's write, the add's two reads and its write). For a large
model that is longer at the host's memory bandwidth than the backward that
was meant to hide it: backward waited for staging buffers, and accumulating
micro-batches ran slower than one large batch. Where the GPU has room the
gradient adds up there instead, in one fp32 arena allocated once (sums kept
in the caching allocator's blocks between micro-batches fragmented it into an
OOM): the window's first reduced shard is copied in and later ones added on
the compute stream, one landing behind so the add never waits for the
collective just issued; the final micro-batch adds its own on the d2h stream
and downloads the sum once (`HostLanding`). The sum is the host's, bit for
bit: the same fp32 additions in the same order. The room is known after the
first step: ``device_accumulation`` ``"auto"`` takes 80% of the GPU memory
that step left unused, less what the GPU share took, at 4 bytes per element;
a number is the fraction of host-stepped elements. Groups are chosen in
backward's landing order. With both ``"auto"`` the share is sized so that the
arena for what stays on the host fits beside it ([Note: GPU share]): per GPU
byte the arena saves more host traffic.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import attrs
import torch

from zkernel.telemetry.log import get_logger

log = get_logger()


@attrs.define(eq=False)
class DeviceSum:
    """One group's view of the arena and the state of its window's sum."""

    view: torch.Tensor
    live: bool = False  # holds this window's sum so far
    read: Any = None  # the d2h event after which the last window's sum was read


class DeviceAccumulation:
    """The fp32 device arena host-stepped groups' gradients add up in (see [Note: device accumulation]).

    `place` (main thread, once after the first step) chooses the groups and
    sets each chosen landing slot's ``device_sum`` to a `DeviceSum`. Then, on
    autograd's thread (from `HostLanding.land`): `hold` keeps a non-final
    landing and adds the one before it (so the add never waits for the
    collective just issued), and `take` adds every held landing and says
    whether a group's sum holds this window's earlier micro-batches, handing
    it to the final landing, which adds to it and downloads it on the d2h
    stream. `flush` (main thread, end of backward) adds what is still held.
    Adds run on the compute stream, in landing order.
    """

    def __init__(self, device: torch.device, option: float | str, accumulating: bool) -> None:
        self.device = device
        self.option = option
        self.accumulating = accumulating
        self._arena: torch.Tensor | None = None
        self._sums: list[DeviceSum] = []
        self._held: deque = deque()  # (DeviceSum, reduced) not added yet

    def fraction(self) -> float:
        """The fraction of host-stepped elements meant to add up on the GPU (1 for "auto")."""
        if not self.accumulating:
            return 0.0
        return 1.0 if self.option == "auto" else float(self.option)

    def place(self, slots, room: int) -> None:
        """Choose among ``slots`` (landing slots of host-stepped groups, in backward's landing order,
        each with a ``landing`` buffer and a ``device_sum`` attribute) within ``room`` bytes."""
        if not self.fraction():
            return
        total = sum(s.landing.numel() for s in slots)
        budget = max(0, room) // 4 if self.option == "auto" else int(self.option * total)
        chosen = []
        numel = 0
        for slot in slots:  # backward's landing order
            if slot.landing.numel() <= budget - numel:
                chosen.append(slot)
                numel += slot.landing.numel()
        if not chosen:
            return
        # One allocation for the run: sums kept in the caching allocator's blocks between
        # micro-batches fragmented it.
        try:
            self._arena = torch.empty(numel, dtype=torch.float32, device=self.device)
        except torch.OutOfMemoryError:
            log.warning("zkernel.cpu_tier.device_accumulation_skipped", numel=numel, reason="out of GPU memory")
            return
        offset = 0
        for slot in chosen:
            slot.device_sum = DeviceSum(self._arena[offset : offset + slot.landing.numel()])
            self._sums.append(slot.device_sum)
            offset += slot.landing.numel()
        log.info(
            "zkernel.cpu_tier.device_accumulation",
            groups=len(chosen),
            numel=numel,
            fraction=round(numel / max(1, total), 4),
        )

    def hold(self, target: DeviceSum, reduced) -> None:
        """A non-final landing into ``target``: added once the next landing comes (autograd's thread)."""
        self._held.append((target, reduced))
        while len(self._held) > 1:
            self._add(*self._held.popleft())

    def take(self, target: DeviceSum | None) -> bool:
        """Add every held landing (a landing of any group comes after them); whether ``target`` holds
        this window's earlier micro-batches (it is then handed over: the final landing adds to it and
        downloads it)."""
        self.flush()
        if target is None:
            return False
        live, target.live = target.live, False
        return live

    def flush(self) -> None:
        """Add every held landing (the end of backward)."""
        while self._held:
            self._add(*self._held.popleft())

    @staticmethod
    def _add(target: DeviceSum, reduced) -> None:
        """On the compute stream: a non-final landing into its group's device sum."""
        if reduced.work is not None:
            reduced.work.wait()
        if target.live and reduced.accumulate:
            target.view.add_(reduced.tensor)
            return
        if target.read is not None:  # the last window's sum is downloaded by now; in order
            torch.cuda.current_stream(target.view.device).wait_event(target.read)
            target.read = None
        target.view.copy_(reduced.tensor)
        target.live = True

    def close(self) -> None:
        """Wait for the last downloads of the sums and free the arena."""
        for target in self._sums:
            if target.read is not None:
                target.read.synchronize()
        self._held.clear()
        self._sums.clear()
        self._arena = None
