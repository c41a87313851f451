"""Gradient landing on the host: a host-stepped group's reduced gradient crosses to its host landing buffer.

Algorithm. Each host-stepped group has one landing buffer in page-locked
host memory (fp32, or bf16 with ``grad_dtype = "bf16"`` and no
accumulation). As soon as the partitioner reduced a group (during backward),
its shard is copied device-to-host on the engine's d2h stream, after the
collective and without blocking the host. The window's first landing is
copied straight into the landing buffer; later ones go through a pinned
staging buffer and are added on the accumulation thread (`HostAccumulation`),
or add up on the GPU ([Note: device accumulation], `DeviceAccumulation`). The
squared norm of a window's gradient is computed on the device from a gradient
landed in one piece (and copied to a page-locked scalar behind the landing,
see [Note: a group's own norm]), and on the accumulation thread from an
accumulated one. Without CUDA every copy is a plain host copy in program
order; landings are completed one behind the newest, as the device tier does.

Threads: `adopt` on the main thread; `land` on autograd's thread; `flush`
and `sq_norms` on the main thread at the end of backward (`sq_norms` also on
the host worker for a group a speculative step acquired); `acquire` and
`end_window` on the thread that steps the group (the host worker).
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from typing import Any

import attrs
import torch

from zkernel.platform.host_memory import host_empty
from zkernel.platform.streams import record_event
from zkernel.telemetry.timeline import SpanKind

from ._device_accumulation import DeviceAccumulation, DeviceSum
from ._host_grad import HostAccumulation, sq_norm


@attrs.define(eq=False)
class LandingSlot:
    """The landing buffer of one group and the transfers in flight for it."""

    landing: torch.Tensor
    landed: bool = False  # a gradient landed in this window
    landed_event: Any = None  # CUDA event of the last device-to-host copy
    sq_norm: torch.Tensor | Future | None = None
    sq_norm_host: torch.Tensor | None = None  # page-locked copy of a device ``sq_norm``, ready with the landing
    accumulation: Future | None = None  # host-side add of a later micro-batch
    device_sum: DeviceSum | None = None  # its share of the device arena ([Note: device accumulation])


class HostLanding:
    """Landing buffers of host-stepped groups, the downloads into them and their norms (see the module docstring)."""

    def __init__(self, context, *, pin: bool | None, grad_dtype: str, staging_buffers: int, device_accumulation) -> None:
        self.device = context.device
        self.cuda = self.device.type == "cuda"
        self.streams = context.streams
        self.timeline = context.timeline
        self.pin = pin
        accumulating = context.config.gradient_accumulation_steps > 1
        bf16 = grad_dtype == "bf16" and self.cuda
        self.landing_dtype = torch.bfloat16 if bf16 and not accumulating else torch.float32
        self.transfer_dtype = torch.bfloat16 if bf16 else torch.float32
        self.adds = HostAccumulation(staging_buffers, self.transfer_dtype, pin, context.timeline)
        self.sums = DeviceAccumulation(self.device, device_accumulation, accumulating)
        self._slots: dict[int, LandingSlot] = {}
        self._pending: deque = deque()  # CPU-only landings not completed yet

    @property
    def element_size(self) -> int:
        """Bytes per element of a landing buffer."""
        return torch.empty((), dtype=self.landing_dtype).element_size()

    def adopt(self, group, numel: int) -> None:
        """Allocate ``group``'s landing buffer."""
        self.adds.expect(numel)
        self._slots[group.index] = LandingSlot(landing=host_empty(numel, self.landing_dtype, pin=self.pin))

    def drop(self, group) -> None:
        """``group`` no longer lands on the host (the GPU share took it): free its buffer."""
        del self._slots[group.index]

    def numel(self) -> int:
        """Elements of every landing buffer."""
        return sum(s.landing.numel() for s in self._slots.values())

    def place_device_accumulation(self, order, room: int) -> None:
        """Choose the groups whose gradient adds up on the GPU, among those of ``order`` (the next
        forward's order) landing here, in backward's landing order ([Note: device accumulation])."""
        self.sums.place([self._slots[g.index] for g in reversed(order) if g.index in self._slots], room)

    # -- landing (autograd's thread) ---------------------------------------------------------------

    def land(self, group, reduced, final: bool) -> None:
        slot = self._slots[group.index]
        if slot.device_sum is not None and not final:
            self.sums.hold(slot.device_sum, reduced)
            return
        first = not reduced.accumulate or not slot.landed
        slot.landed = True
        if not self.cuda:
            # The window's last landing completes at once: the host worker may step the group now.
            self._pending.append((slot, reduced, first))
            while len(self._pending) > (0 if final else 1):
                self._complete(*self._pending.popleft())
            return
        d2h = self.streams.d2h
        tensor = reduced.tensor
        staging = None if first else self.adds.take(group.name, tensor.numel())
        nbytes = tensor.numel() * (slot.landing.element_size() if first else staging.element_size())
        # [Note: wait for the producer] The stream that produced the gradient is taken before
        # entering the d2h context: inside it the current stream *is* d2h, and waiting on it
        # would order nothing. Without this wait the copy read the gradient buffer before the
        # backward had written it whenever the GPU lagged the host (one GPU, host-stepped
        # groups: stale or uninitialised memory, seen as a rare NaN in bf16 runs).
        producer = torch.cuda.current_stream(self.device)
        summed = self.sums.take(slot.device_sum)
        with torch.cuda.stream(d2h):
            if reduced.work is not None:
                reduced.work.wait()
            if reduced.work is None or summed:
                d2h.wait_stream(producer)
            if summed:
                slot.device_sum.view.add_(tensor)
                tensor.record_stream(d2h)
                tensor = slot.device_sum.view
            with self.timeline.span(SpanKind.D2H, stream=d2h, label=group.name, nbytes=nbytes):
                self._download(slot, tensor, final, staging)
            if summed:
                slot.device_sum.read = record_event(d2h)
            # [Note: collective buffers on a side stream] The collective's output and inputs were
            # allocated on the compute stream, and only this stream waited for the collective:
            # without these marks the allocator could hand their memory to the next compute-stream
            # allocation while NCCL still reads or writes it (gradients of other groups, seen on
            # two GPUs as a wrong loss by the second step).
            tensor.record_stream(d2h)
            if isinstance(reduced.keepalive, torch.Tensor) and reduced.keepalive.is_cuda:
                reduced.keepalive.record_stream(d2h)

    def _download(self, slot: LandingSlot, tensor: torch.Tensor, final: bool, staging: torch.Tensor | None) -> None:
        """On the d2h stream: the window's first gradient straight into the landing buffer, a later
        one through the pinned ``staging`` buffer and an add on the accumulation thread."""
        if staging is None:
            slot.sq_norm = tensor.pow(2).sum() if final else None
            if final:
                if slot.sq_norm_host is None:
                    slot.sq_norm_host = torch.empty((), dtype=torch.float32, pin_memory=True)
                slot.sq_norm_host.copy_(slot.sq_norm, non_blocking=True)
            slot.landing.copy_(tensor.to(slot.landing.dtype), non_blocking=True)
            slot.landed_event = record_event(self.streams.d2h)
            return
        staging.copy_(tensor.to(self.transfer_dtype), non_blocking=True)
        slot.landed_event = None
        copied = record_event(self.streams.d2h)
        slot.accumulation = self.adds.submit(slot.landing, staging, copied, final)
        slot.sq_norm = slot.accumulation if final else None

    @staticmethod
    def _complete(slot: LandingSlot, reduced, first: bool) -> None:
        if reduced.work is not None:
            reduced.work.wait()
        if first:
            slot.landing.copy_(reduced.tensor)
        else:
            slot.landing.add_(reduced.tensor)

    def flush(self) -> None:
        """Complete every landing started so far (the end of backward, main thread)."""
        while self._pending:
            self._complete(*self._pending.popleft())
        self.sums.flush()

    def sq_norms(self, groups, out: list) -> list:
        """Append to ``out`` the parts of the squared norm of ``groups``' landed gradients (groups not
        landing here, or without a landed gradient, add nothing); returns ``out``."""
        # [Note: a group's own norm] A speculative step started during backward asks, from the
        # host worker after `acquire`, whether its group's own gradient already shows the window
        # will clip. Reading the device scalar there (`float`) would wait for the compute stream
        # to drain everything the host has queued so far, nearly the whole backward, and made
        # every early step start after backward (the whole CPU step exposed). The landing copies
        # the scalar to page-locked memory behind the gradient, so once `acquire` has waited for
        # the landing the value is on the host; only the device scalars returned here are ordered
        # after the d2h stream.
        ordered = False
        for group in groups:
            slot = self._slots.get(group.index)
            if slot is None or not slot.landed:
                continue
            if self.cuda and isinstance(slot.sq_norm, torch.Tensor):
                if slot.landed_event is None and slot.sq_norm_host is not None:  # acquired: the copy is done
                    out.append(float(slot.sq_norm_host))
                    continue
                if not ordered:
                    torch.cuda.current_stream(self.device).wait_stream(self.streams.d2h)
                    ordered = True
                out.append(slot.sq_norm)
            elif self.cuda and slot.sq_norm is not None:
                out.append(slot.sq_norm)
            else:
                out.append(sq_norm(slot.landing))
        return out

    def read(self, group) -> torch.Tensor | None:
        """``group``'s gradient of the window so far (main thread, after a backward, read only): the
        device sum while later micro-batches still add up on the GPU, else the landing buffer once
        its copies and adds are done; None where none landed in this window."""
        slot = self._slots[group.index]
        if slot.device_sum is not None and slot.device_sum.live:
            return slot.device_sum.view  # added on the compute stream, in its order
        if not slot.landed:
            return None
        accumulation, landed = slot.accumulation, slot.landed_event  # the step's acquire may clear them
        if accumulation is not None:
            accumulation.result()
        if landed is not None:
            landed.synchronize()
        return slot.landing

    # -- the step (the host worker) -----------------------------------------------------------------

    def acquire(self, group) -> None:
        """Wait for ``group``'s landing and set ``group.grad`` to it (zeros when none landed)."""
        slot = self._slots[group.index]
        if slot.accumulation is not None:
            slot.accumulation.result()
            slot.accumulation = None
        if slot.landed_event is not None:
            slot.landed_event.synchronize()
            slot.landed_event = None
        if not slot.landed:  # no gradient landed in this window: step on zeros
            slot.landing.zero_()
            slot.landed = True
        group.grad = slot.landing

    def end_window(self, group) -> None:
        """The next window's first landing starts from zero."""
        slot = self._slots[group.index]
        slot.landed = False
        slot.sq_norm = None
        group.grad = None

    def tensors(self, group, *, device_sum: bool = True) -> list[torch.Tensor] | None:
        """``group``'s landing buffer (and its device sum when ``device_sum``), or None when it lands elsewhere."""
        slot = self._slots.get(group.index)
        if slot is None:
            return None
        if device_sum and slot.device_sum is not None:
            return [slot.landing, slot.device_sum.view]
        return [slot.landing]

    def close(self) -> None:
        """Finish the adds and downloads in flight; free the buffers and the thread."""
        for slot in self._slots.values():
            if slot.accumulation is not None:
                slot.accumulation.result()
        self.sums.close()
        self.adds.close()
        self._slots.clear()
        self._pending.clear()
