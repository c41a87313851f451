"""Tier ``cpu``: fp32 masters, optimizer state and gradient landing buffers in host memory.

This module is the optimizer role (`CpuTier`) and the tier's registration;
the params role is `CpuParamsTier` (``_cpu_params``), and the staging buffers
updates are rounded into are a `StagingPool` (``_staging``), which the
``nvme`` tier shares.

Algorithm (ZeRO-Offload). Each trainable group gets, in page-locked host
memory allocated once at `initialize` (plain memory, with a warning, where
page-locking is unavailable, as on CPU-only torch): its fp32 master, its
declared optimizer state and an fp32 landing buffer for its gradient; in
bf16/fp16 runs the updated parameters are rounded into a staging buffer lent
for the step (or straight into the parameters' home when it is in host memory). The
compute device keeps only the compute-dtype parameters, transient gradient
buckets and activations.

* Gradients: as soon as the partitioner reduced a group (during backward), its
  shard is copied device-to-host on the engine's d2h stream, after the
  collective and without blocking the host. The window's first landing is
  copied straight into the landing buffer; later ones go through a pinned
  staging buffer and are added on the tier's own accumulation thread, or add
  up on the GPU (see [Note: device accumulation]). The squared norm
  of a window's gradient is computed on the device from a gradient landed in
  one piece (and copied to a page-locked scalar behind the landing, see
  [Note: a group's own norm]), and on the host (accumulation thread) from an
  accumulated one.
* Step: the optimizer runs on the host (the engine's worker thread), reading
  the landing buffer, and writes rounded parameters into the staging copy (or
  straight into the parameter shard when the params tier keeps it in host
  memory); the params tier then takes them home (`ParamsTier.commit`: an
  upload on the h2d stream whose event the next use of the shard waits for).

Without CUDA the same buffers exist and every copy is a plain host copy in
program order; landings are completed one behind the newest, as the device
tier does.

[Note: GPU share] The next forward needs the first layers first, and their
gradients land last in backward, so their host steps finish last: on a PCIe
machine the host step is as long as a whole GPU step, and the forward stalls
on it. ``gpu_share`` keeps the optimizer of the groups the next forward needs
first on the GPU (Twin-Flow): they step there, in milliseconds, while the host
steps the rest. After the first step (when the landing order, and so the
forward's need order, and the step's peak GPU memory are known) the tier moves
those groups' masters and optimizer state to the GPU and hands them to an
inner ``none`` tier. ``gpu_share`` is the fraction of trainable
elements to keep there, or ``"auto"``: as many as fit in 80% of the GPU memory
the first step left unused, at 16 bytes per element (master, two moments,
gradient).

[Note: device accumulation] With gradient accumulation, every micro-batch's
gradient of a host-stepped group crossed to the host and was added there: per
element and micro-batch, 4 bytes over the link and 16 bytes of host memory
traffic (the copy's write, the add's two reads and its write). For GPT-6.7B's
5.4 B host-stepped elements that is 87 GB a micro-batch, longer at the host's
memory bandwidth than the 0.4 s backward that was meant to hide it: backward
waited for staging buffers, and 4 micro-batches of 8 ran at 0.6x the speed of
one. Where the GPU has room the gradient adds up there instead, in one fp32
arena allocated once (sums kept in the caching allocator's blocks between
micro-batches fragmented it into an OOM): the window's first reduced shard is
copied in and later ones added on the compute stream, one landing behind so
the add never waits for the collective just issued; the final micro-batch
adds its own on the d2h stream and downloads the sum once. The sum is the
host's, bit for bit: the same fp32 additions in the same order. The room is known after the first step:
``device_accumulation`` ``"auto"`` takes 80% of the GPU memory that step left
unused, less what the GPU share took, at 4 bytes per element; a number is the
fraction of host-stepped elements. Groups are chosen in backward's landing order.
With both ``"auto"`` the share is sized so that the arena for what stays on the
host fits beside it: per GPU byte the arena saves more host traffic.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import attrs
import torch

from zkernel.spec import hookimpl
from zkernel.platform.host_memory import host_empty, host_zeros
from zkernel.telemetry.log import get_logger
from zkernel.spec.tiers import SPECULATE_POLICIES
from zkernel.platform.streams import record_event
from zkernel.spec.tiers import OptimizerTier, Resource, ShardState
from zkernel.telemetry.timeline import SpanKind

from ._cpu_params import CpuParamsOptions, CpuParamsTier
from ._host_grad import accumulate, sq_norm
from ._staging import POOLED, StagingPool
from ._state import write_optimizer_state
from .device import DeviceOptimizerTier, update_target

log = get_logger()


@attrs.frozen(kw_only=True)
class CpuTierOptions:
    """``offload.optimizer_options`` of the ``cpu`` tier."""

    # Page-lock the host buffers: None = where CUDA is available; True = required (error without CUDA).
    pin_memory: bool | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.instance_of(bool)))
    # Start host steps before the global norm is known and roll them back when clipping or an
    # fp16 overflow applies: "auto" (when the previous step needed neither), "always", "never".
    speculate: str = attrs.field(default="auto", validator=attrs.validators.in_(SPECULATE_POLICIES))
    # Page-locked compute-dtype buffers the host step rounds updated parameters into before their
    # upload, shared by all groups (each as large as the largest group); as many again carry later
    # micro-batches' gradients down for accumulation on the host.
    staging_buffers: int = attrs.field(default=4, validator=attrs.validators.ge(1))
    # Dtype gradients cross to the host in: "fp32" (as reduced), or "bf16" (half the bytes over the
    # link and in host memory, and a shorter host step; the gradient is rounded to bf16 before the
    # optimizer reads it, as DeepSpeed's offload does; the norm is still taken in fp32). With
    # gradient accumulation the landing buffer stays fp32 and the host adds in fp32.
    grad_dtype: str = attrs.field(default="fp32", validator=attrs.validators.in_(("fp32", "bf16")))
    # Fraction of trainable elements whose optimizer stays on the GPU ([Note: GPU share]), or "auto".
    gpu_share: float | str = attrs.field(default=0.0, validator=lambda _i, _a, v: _check_share(v, "gpu_share"))
    # With gradient accumulation: fraction of host-stepped elements whose gradient adds up on the GPU
    # over a window and crosses once ([Note: device accumulation]), or "auto".
    device_accumulation: float | str = attrs.field(
        default="auto", validator=lambda _i, _a, v: _check_share(v, "device_accumulation")
    )


def _check_share(value, key: str) -> None:
    if value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"offload.optimizer_options.{key} must be a number in [0, 1] or \"auto\", got {value!r}")


@attrs.define(eq=False)
class _Slot:
    """The host buffers of one group and the transfers in flight for it."""

    landing: torch.Tensor
    landed: bool = False  # a gradient landed in this window
    landed_event: Any = None  # CUDA event of the last device-to-host copy
    sq_norm: torch.Tensor | Future | None = None
    sq_norm_host: torch.Tensor | None = None  # page-locked copy of a device ``sq_norm``, ready with the landing
    accumulation: Future | None = None  # host-side add of a later micro-batch
    # [Note: device accumulation] Its view of the tier's fp32 device arena, or None; whether it
    # holds this window's sum so far; the d2h event after which the last window's sum was read.
    device_sum: torch.Tensor | None = None
    device_sum_live: bool = False
    device_sum_read: Any = None
    on_device: bool = False  # moved to the GPU share: the inner device tier holds it
    pooled: bool = False  # its rounded update goes through a shared staging buffer
    # Where its rounded update goes when not pooled (the parameters' home, or None): this tier's
    # own; a buffer a params tier lends as ``copy_out`` for one step is not counted here.
    update: torch.Tensor | None = None


class CpuTier(OptimizerTier):
    """Masters, optimizer state and gradients in host memory; the step runs on the host."""

    masters_on_compute_device = False

    def __init__(self, context, role: str = "optimizer") -> None:
        self.options = context.options or CpuTierOptions()
        self.speculate = self.options.speculate
        self.device = context.device
        self.compute_dtype = context.compute_dtype
        self.cuda = self.device.type == "cuda"
        self.streams = context.streams
        self.worker = context.host_worker
        self.timeline = context.timeline
        self._slots: dict[int, _Slot] = {}
        self._pending: deque = deque()  # CPU-only landings not completed yet
        self._held: deque = deque()  # a device-accumulated landing not added yet ([Note: device accumulation])
        self._accumulating = context.config.gradient_accumulation_steps > 1
        self._device_arena: torch.Tensor | None = None
        # Host adds run on their own thread: queued behind host steps on the worker, they held
        # backward's staging buffers for the whole step (measured: the final micro-batch's backward
        # of GPT-6.7B took 2.8 s instead of 0.4).
        self._adder: ThreadPoolExecutor | None = None
        self._state: dict[int, tuple] = {}  # declared optimizer state per group (for the GPU share)
        self._device_tier = DeviceOptimizerTier(context)
        bf16 = self.options.grad_dtype == "bf16" and self.cuda
        self._landing_dtype = (
            torch.bfloat16 if bf16 and context.config.gradient_accumulation_steps == 1 else torch.float32
        )
        self._transfer_dtype = torch.bfloat16 if bf16 else torch.float32
        self.gpu_share_numel = 0
        self._planned_numel = 0
        self._staging = StagingPool(self.options.staging_buffers, self.compute_dtype, self.options.pin_memory)
        # Later micro-batches' gradients cross through these (allocated at the first accumulation):
        # bounded, so a host worker that adds slower than backward downloads holds back the
        # downloads instead of page-locking a copy of every gradient.
        self._accumulation = StagingPool(self.options.staging_buffers, self._transfer_dtype, self.options.pin_memory)

    def _pin(self) -> bool | None:
        return self.options.pin_memory

    # -- placement ----------------------------------------------------------------

    def demand(self, numel, state, compute_dtype):
        self._planned_numel = numel
        share = self._adopt_time_share()
        landing = torch.empty((), dtype=self._landing_dtype).element_size()
        host = int(numel * (1 - share)) * (4 + landing) + int(sum(s.nbytes for s in state) * (1 - share))
        device = int(numel * share) * 16
        return {Resource.HOST: host, Resource.DEVICE: device} if device else {Resource.HOST: host}

    def _adopt_time_share(self) -> float:
        """A numeric gpu_share is placed as groups are adopted ([Note: GPU share])."""
        share = self.options.gpu_share
        return share if self.cuda and share != "auto" else 0.0

    def adopt(self, group, master, state):
        if self._takes_gpu_share(group, master.numel()):
            self._adopt_on_device(group, master, state)
        else:
            self._adopt_on_host(group, master, state)

    def _takes_gpu_share(self, group, numel: int) -> bool:
        """Module-bound groups come in module order, the next forward's order: the first ones
        within a numeric share stay on the GPU from the start, so their host buffers never exist."""
        budget = int(self._adopt_time_share() * self._planned_numel)
        return group.module is not None and numel <= budget - self.gpu_share_numel

    def _adopt_on_device(self, group, master, state) -> None:
        self._device_tier.adopt(group, master, state)
        self._slots[group.index] = _Slot(landing=torch.empty(0), on_device=True)
        self._state[group.index] = tuple(state)
        self.gpu_share_numel += master.numel()

    def _adopt_on_host(self, group, master, state) -> None:
        numel = master.numel()
        host_master = host_empty(numel, torch.float32, pin=self._pin())
        host_master.copy_(master)
        group.master = host_master
        group.optim_state = {
            s.name: host_zeros(s.shape, s.dtype, pin=self._pin()) if s.per_element else torch.zeros(s.shape, dtype=s.dtype)
            for s in state
        }
        self._adopt_gradient(group, numel)
        self._state[group.index] = tuple(state)

    def _adopt_gradient(self, group, numel: int) -> None:
        """The host side every host-stepped group has, whatever keeps its master: the gradient's
        landing buffer and where the rounded update goes (``group.master`` is set)."""
        group.copy_out = update_target(group, torch.device("cpu"), self.compute_dtype, lambda n, dt: POOLED)
        pooled = group.copy_out is POOLED
        self._accumulation.expect(numel)
        if pooled:
            group.copy_out = None  # lent from the staging pool for each step (`acquire`)
            self._staging.expect(numel)
        self._slots[group.index] = _Slot(
            landing=host_empty(numel, self._landing_dtype, pin=self._pin()), pooled=pooled, update=group.copy_out
        )

    def _update_buffers(self, slot: _Slot) -> list[torch.Tensor]:
        """What a group's rounded updates are written into, as `zkernel_memory_tensors` counts it."""
        if slot.pooled:
            return self._staging.buffers
        return [slot.update] if slot.update is not None else []

    def _on_device(self, group) -> bool:
        slot = self._slots.get(group.index)
        return slot is not None and slot.on_device

    def after_first_step(self, order):
        if not self.cuda:
            return
        room = int(0.8 * self._unused_device_bytes())
        moved = self._place_gpu_share(order, room) if self.options.gpu_share != 0.0 else 0
        self._place_device_accumulation(order, room - 16 * moved)

    def _unused_device_bytes(self) -> int:
        """GPU memory the steps so far never reserved."""
        total = torch.cuda.get_device_properties(self.device).total_memory
        return max(0, total - torch.cuda.max_memory_reserved(self.device))

    def _place_gpu_share(self, order, room: int) -> int:
        """Move the first-needed groups within the share to the GPU; returns the elements moved now.

        ``"auto"`` fits the share and the accumulation arena into ``room`` together: an element moved
        costs 16 bytes and frees its 4 in the arena ([Note: device accumulation]), which pays more per
        byte (it saves 16 bytes of host traffic per element and micro-batch, the share 30 per step)."""
        total = sum(g.master.numel() for g in order)
        before = self.gpu_share_numel
        if self.options.gpu_share == "auto":
            arena = 4 * self._accumulated_fraction()
            host = sum(s.landing.numel() for s in self._slots.values() if not s.on_device)
            budget = self.gpu_share_numel + int(max(0, room - arena * host) // (16 - arena))
        else:
            budget = int(self.options.gpu_share * total)
        for group in order:  # the next forward's order: the first-needed groups first
            numel = group.master.numel()
            if self._on_device(group) or numel > budget - self.gpu_share_numel:
                continue
            self._move_to_device(group)
            self.gpu_share_numel += numel
        log.info(
            "zkernel.cpu_tier.gpu_share",
            groups=sum(s.on_device for s in self._slots.values()),
            numel=self.gpu_share_numel,
            fraction=round(self.gpu_share_numel / max(1, total), 4),
        )
        return self.gpu_share_numel - before

    def _accumulated_fraction(self) -> float:
        """The fraction of host-stepped elements meant to add up on the GPU (1 for "auto")."""
        if not self._accumulating:
            return 0.0
        option = self.options.device_accumulation
        return 1.0 if option == "auto" else float(option)

    def _place_device_accumulation(self, order, room: int) -> None:
        """Choose the host-stepped groups whose gradient adds up on the GPU ([Note: device accumulation])."""
        option = self.options.device_accumulation
        if not self._accumulated_fraction():
            return
        slots = [self._slots[g.index] for g in reversed(order) if not self._on_device(g)]
        total = sum(s.landing.numel() for s in slots)
        budget = max(0, room) // 4 if option == "auto" else int(option * total)
        chosen: list[_Slot] = []
        numel = 0
        for slot in slots:  # backward's landing order
            if slot.landing.numel() <= budget - numel:
                chosen.append(slot)
                numel += slot.landing.numel()
        if not chosen:
            return
        # One allocation for the run: sums kept in the caching allocator's blocks between micro-batches
        # fragmented it (an OOM with 7.6 GiB reserved but free, GPT-6.7B).
        try:
            self._device_arena = torch.empty(numel, dtype=torch.float32, device=self.device)
        except torch.OutOfMemoryError:
            log.warning("zkernel.cpu_tier.device_accumulation_skipped", numel=numel, reason="out of GPU memory")
            return
        offset = 0
        for slot in chosen:
            slot.device_sum = self._device_arena[offset : offset + slot.landing.numel()]
            offset += slot.landing.numel()
        log.info(
            "zkernel.cpu_tier.device_accumulation",
            groups=len(chosen),
            numel=numel,
            fraction=round(numel / max(1, total), 4),
        )

    def _move_to_device(self, group) -> None:
        """Hand ``group`` to the inner device tier: master and state copied to the GPU, host buffers freed."""
        slot = self._slots[group.index]
        state = {k: v.to(self.device) for k, v in group.optim_state.items()}
        self._device_tier.adopt(group, group.master.to(self.device), self._state[group.index])
        for name, value in state.items():
            group.optim_state[name].copy_(value)
        slot.on_device = True
        slot.landing = torch.empty(0)
        group.grad = None

    # -- gradients ------------------------------------------------------------------

    def land(self, group, reduced, final):
        slot = self._slots[group.index]
        if slot.on_device:
            return self._device_tier.land(group, reduced, final)
        if slot.device_sum is not None and not final:
            self._held.append((slot, reduced))
            while len(self._held) > 1:
                self._add_held(*self._held.popleft())
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
        staging = None if first else self._take_accumulation_buffer(group, tensor.numel())
        nbytes = tensor.numel() * (slot.landing.element_size() if first else staging.element_size())
        # [Note: wait for the producer] The stream that produced the gradient is taken before
        # entering the d2h context: inside it the current stream *is* d2h, and waiting on it
        # would order nothing. Without this wait the copy read the gradient buffer before the
        # backward had written it whenever the GPU lagged the host (one GPU, host-stepped
        # groups: stale or uninitialised memory, seen as a rare NaN in bf16 runs).
        producer = torch.cuda.current_stream(self.device)
        summed = self._complete_device_sum(slot)
        with torch.cuda.stream(d2h):
            if reduced.work is not None:
                reduced.work.wait()
            if reduced.work is None or summed:
                d2h.wait_stream(producer)
            if summed:
                slot.device_sum.add_(tensor)
                tensor.record_stream(d2h)
                tensor = slot.device_sum
            with self.timeline.span(SpanKind.D2H, stream=d2h, label=group.name, nbytes=nbytes):
                self._download(slot, tensor, final, staging)
            if summed:
                slot.device_sum_read = record_event(d2h)
            # [Note: collective buffers on a side stream] The collective's output and inputs were
            # allocated on the compute stream, and only this stream waited for the collective:
            # without these marks the allocator could hand their memory to the next compute-stream
            # allocation while NCCL still reads or writes it (gradients of other groups, measured
            # on 2 GPUs as a 2.6e-3 loss error by the second step).
            tensor.record_stream(d2h)
            if isinstance(reduced.keepalive, torch.Tensor) and reduced.keepalive.is_cuda:
                reduced.keepalive.record_stream(d2h)

    def _take_accumulation_buffer(self, group, numel: int) -> torch.Tensor:
        """A free staging buffer for a later micro-batch's gradient; the wait for one is timed."""
        buffer = self._accumulation.try_take(numel)
        if buffer is None:
            with self.timeline.span(SpanKind.ACCUMULATE_WAIT, label=group.name):
                buffer = self._accumulation.take(numel)
        return buffer

    def _download(self, slot: _Slot, tensor: torch.Tensor, final: bool, staging: torch.Tensor | None) -> None:
        """On the d2h stream: the window's first gradient straight into the landing buffer, a later
        one through the pinned ``staging`` buffer and a host-side add (worker thread)."""
        d2h = self.streams.d2h
        if staging is None:
            slot.sq_norm = tensor.pow(2).sum() if final else None
            if final:
                if slot.sq_norm_host is None:
                    slot.sq_norm_host = torch.empty((), dtype=torch.float32, pin_memory=True)
                slot.sq_norm_host.copy_(slot.sq_norm, non_blocking=True)
            slot.landing.copy_(tensor.to(slot.landing.dtype), non_blocking=True)
            slot.landed_event = record_event(d2h)
            return
        staging.copy_(tensor.to(self._transfer_dtype), non_blocking=True)
        slot.landed_event = None
        copied = record_event(d2h)
        if self._adder is None:
            self._adder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zkernel-accumulate")
        slot.accumulation = self._adder.submit(
            accumulate, slot.landing, staging, copied, final, self._accumulation, self.timeline
        )
        slot.sq_norm = slot.accumulation if final else None

    @staticmethod
    def _add_held(slot: _Slot, reduced) -> None:
        """On the compute stream: a non-final landing into its group's device sum."""
        if reduced.work is not None:
            reduced.work.wait()
        if slot.device_sum_live and reduced.accumulate:
            slot.device_sum.add_(reduced.tensor)
            return
        if slot.device_sum_read is not None:  # the last window's sum is downloaded by now; in order
            torch.cuda.current_stream(slot.device_sum.device).wait_event(slot.device_sum_read)
            slot.device_sum_read = None
        slot.device_sum.copy_(reduced.tensor)
        slot.device_sum_live = True

    def _complete_device_sum(self, slot: _Slot) -> bool:
        """Add every held landing; whether ``slot``'s device sum holds this window's earlier micro-batches
        (it is then handed over: the final landing adds to it and downloads it)."""
        while self._held:
            self._add_held(*self._held.popleft())
        live, slot.device_sum_live = slot.device_sum_live, False
        return live

    @staticmethod
    def _complete(slot: _Slot, reduced, first: bool) -> None:
        if reduced.work is not None:
            reduced.work.wait()
        if first:
            slot.landing.copy_(reduced.tensor)
        else:
            slot.landing.add_(reduced.tensor)

    def flush(self):
        while self._pending:
            self._complete(*self._pending.popleft())
        while self._held:
            self._add_held(*self._held.popleft())
        self._device_tier.flush()

    def grad_sq_norm(self, groups):
        # [Note: a group's own norm] A speculative step started during backward asks, from the
        # host worker after `acquire`, whether its group's own gradient already shows the window
        # will clip. Reading the device scalar there (`float`) would wait for the compute stream
        # to drain everything the host has queued so far, nearly the whole backward, and made
        # every early step start after backward (measured: the whole CPU step exposed). The
        # landing copies the scalar to page-locked memory behind the gradient, so once `acquire`
        # has waited for the landing the value is on the host; only the device scalars returned
        # here are ordered after the d2h stream.
        out = self._device_tier.grad_sq_norm([g for g in groups if self._on_device(g)])
        ordered = False
        for group in groups:
            slot = self._slots[group.index]
            if slot.on_device or not slot.landed:
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

    # -- step (host worker thread) ------------------------------------------------------

    def steps_on_host(self, group):
        return not self._on_device(group)

    def acquire(self, group):
        slot = self._slots[group.index]
        if slot.on_device:
            return self._device_tier.acquire(group)
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
        if slot.pooled and group.copy_out is None:
            group.copy_out = self._staging.take(group.master.numel())

    def release(self, group):
        slot = self._slots[group.index]
        if slot.on_device:
            return self._device_tier.release(group)
        if slot.pooled and group.copy_out is not None:
            # Its upload is queued on h2d by now: the buffer is free once h2d got past it.
            self._staging.give(group.copy_out, record_event(self.streams.h2d) if self.cuda else None)
            group.copy_out = None

    def end_window(self, group):
        slot = self._slots[group.index]
        if slot.on_device:
            return self._device_tier.end_window(group)
        slot.landed = False
        slot.sq_norm = None
        group.grad = None

    def read_master(self, group):
        return group.master

    def read_state(self, group):
        if self._on_device(group):
            return self._device_tier.read_state(group)
        return ShardState(master=group.master, state=dict(group.optim_state))

    def write_state(self, group, state):
        if self._on_device(group):
            return self._device_tier.write_state(group, state)
        group.master.copy_(state.master)
        write_optimizer_state(group, state.state, torch.device("cpu"), make=self._host_like)

    def _host_like(self, value: torch.Tensor) -> torch.Tensor:
        if value.dim() == 0:
            return torch.empty((), dtype=value.dtype)
        return host_empty(value.shape, value.dtype, pin=self._pin())

    def close(self):
        for slot in self._slots.values():
            if slot.accumulation is not None:
                slot.accumulation.result()
            if slot.device_sum_read is not None:
                slot.device_sum_read.synchronize()
        if self._adder is not None:
            self._adder.shutdown(wait=True)
            self._adder = None
        self._slots.clear()
        self._pending.clear()
        self._held.clear()
        self._device_arena = None
        self._state.clear()
        self._staging.close()
        self._accumulation.close()

    @hookimpl
    def zkernel_memory_tensors(self, group):
        slot = self._slots.get(group.index)
        if slot is None:
            return None
        if slot.on_device:
            return self._device_tier.zkernel_memory_tensors(group)
        return {
            "params": self._update_buffers(slot),
            "grads": [slot.landing] + ([slot.device_sum] if slot.device_sum is not None else []),
            "master_weights": [group.master],
            "optimizer_state": [t for t in group.optim_state.values() if isinstance(t, torch.Tensor)],
        }


def cpu_tier(context, role: str):
    return CpuTier(context, role) if role == "optimizer" else CpuParamsTier(context, role)


@hookimpl
def zkernel_register_offload_tiers(registry) -> None:
    registry.add(
        "cpu",
        cpu_tier,
        description="optimizer: fp32 masters, state and gradients in page-locked host memory, CPU step overlapping the GPU; params: shards in host memory, uploaded per gather",
        options_cls={"optimizer": CpuTierOptions, "params": CpuParamsOptions},
    )


@hookimpl
def zkernel_size_offload_tier(name, role, options, device):
    from ._footprint import cpu_footprint

    return cpu_footprint(role, options) if name == "cpu" else None
