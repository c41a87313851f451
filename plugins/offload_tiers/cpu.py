"""Tier ``cpu``: fp32 masters, optimizer state and gradient landing buffers in host memory.

Algorithm (ZeRO-Offload). Each trainable group gets, in page-locked host
memory allocated once at `initialize` (plain memory, with a warning, where
page-locking is unavailable, as on CPU-only torch): its fp32 master, its
declared optimizer state, an fp32 landing buffer for its gradient and, in
bf16/fp16 runs, a compute-dtype staging copy of the updated parameters. The
compute device keeps only the compute-dtype parameters, transient gradient
buckets and activations.

* Gradients: as soon as the partitioner reduced a group (during backward), its
  shard is copied device-to-host on the engine's d2h stream, after the
  collective and without blocking the host. The window's first landing is
  copied straight into the landing buffer; later ones go through a pinned
  staging buffer and are added on the host worker thread. The squared norm
  of a window's gradient is computed on the device from a gradient landed in
  one piece, and on the host (worker thread) from an accumulated one.
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
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from typing import Any

import attrs
import torch

from zkernel import hookimpl
from zkernel.host_memory import host_empty, host_zeros
from zkernel.log import get_logger
from zkernel.step_pipeline import SPECULATE_POLICIES
from zkernel.streams import record_event
from zkernel.tiers import OptimizerTier, ParamsTier, Resource
from zkernel.timeline import SpanKind

from .device import DeviceOptimizerTier, shares_storage, update_target

log = get_logger()


@attrs.frozen(kw_only=True)
class CpuTierOptions:
    """``offload.optimizer_options`` of the ``cpu`` tier."""

    # Page-lock the host buffers: None = where CUDA is available; True = required (error without CUDA).
    pin_memory: bool | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.instance_of(bool)))
    # Start host steps before the global norm is known and roll them back when clipping or an
    # fp16 overflow applies: "auto" (when the previous step needed neither), "always", "never".
    speculate: str = attrs.field(default="auto", validator=attrs.validators.in_(SPECULATE_POLICIES))
    # Fraction of trainable elements whose optimizer stays on the GPU ([Note: GPU share]), or "auto".
    gpu_share: float | str = attrs.field(default=0.0, validator=lambda _i, _a, v: _check_share(v))


def _check_share(value) -> None:
    if value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"offload.optimizer_options.gpu_share must be a number in [0, 1] or \"auto\", got {value!r}")


@attrs.define(eq=False)
class _Slot:
    """The host buffers of one group and the transfers in flight for it."""

    landing: torch.Tensor
    landed: bool = False  # a gradient landed in this window
    landed_event: Any = None  # CUDA event of the last device-to-host copy
    sq_norm: torch.Tensor | Future | None = None
    accumulation: Future | None = None  # host-side add of a later micro-batch
    on_device: bool = False  # moved to the GPU share: the inner device tier holds it
    # This tier's own ``copy_out`` (a params tier may lend another for a step: not counted here).
    staging: torch.Tensor | None = None


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
        self._state: dict[int, tuple] = {}  # declared optimizer state per group (for the GPU share)
        self._device_tier = DeviceOptimizerTier(context)
        self.gpu_share_numel = 0

    def _pin(self) -> bool | None:
        return self.options.pin_memory

    # -- placement ----------------------------------------------------------------

    def demand(self, numel, state, compute_dtype):
        staging = 0 if compute_dtype == torch.float32 else torch.empty((), dtype=compute_dtype).element_size()
        host = numel * (4 + 4 + staging) + sum(s.nbytes for s in state)
        return {Resource.HOST: host}

    def adopt(self, group, master, state):
        numel = master.numel()
        host_master = host_empty(numel, torch.float32, pin=self._pin())
        host_master.copy_(master)
        group.master = host_master
        group.optim_state = {
            s.name: host_zeros(s.shape, s.dtype, pin=self._pin()) if s.per_element else torch.zeros(s.shape, dtype=s.dtype)
            for s in state
        }
        group.copy_out = update_target(
            group, torch.device("cpu"), self.compute_dtype, lambda n, dt: host_empty(n, dt, pin=self._pin())
        )
        self._slots[group.index] = _Slot(landing=host_empty(numel, torch.float32, pin=self._pin()), staging=group.copy_out)
        self._state[group.index] = tuple(state)

    def _on_device(self, group) -> bool:
        slot = self._slots.get(group.index)
        return slot is not None and slot.on_device

    def after_first_step(self, order):
        if not self.cuda or self.options.gpu_share == 0.0:
            return
        total = sum(g.master.numel() for g in order)
        if self.options.gpu_share == "auto":
            free = torch.cuda.get_device_properties(self.device).total_memory - torch.cuda.max_memory_reserved(self.device)
            budget = int(0.8 * max(0, free)) // 16
        else:
            budget = int(self.options.gpu_share * total)
        for group in order:
            numel = group.master.numel()
            if numel > budget - self.gpu_share_numel:
                break
            self._move_to_device(group)
            self.gpu_share_numel += numel
        log.info(
            "zkernel.cpu_tier.gpu_share",
            groups=sum(s.on_device for s in self._slots.values()),
            numel=self.gpu_share_numel,
            fraction=round(self.gpu_share_numel / max(1, total), 4),
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
        nbytes = tensor.numel() * tensor.element_size()
        with torch.cuda.stream(d2h):
            if reduced.work is not None:
                reduced.work.wait()
            else:
                d2h.wait_stream(torch.cuda.current_stream(self.device))
            with self.timeline.span(SpanKind.D2H, stream=d2h, label=group.name, nbytes=nbytes):
                self._download(slot, tensor, first, final)
            tensor.record_stream(d2h)

    def _download(self, slot: _Slot, tensor: torch.Tensor, first: bool, final: bool) -> None:
        """On the d2h stream: the window's first gradient straight into the landing buffer, a later
        one through pinned staging and a host-side add (worker thread)."""
        d2h = self.streams.d2h
        if first:
            slot.landing.copy_(tensor, non_blocking=True)
            slot.sq_norm = tensor.pow(2).sum() if final else None
            slot.landed_event = record_event(d2h)
            return
        staging = torch.empty(tensor.numel(), dtype=tensor.dtype, pin_memory=True)
        staging.copy_(tensor, non_blocking=True)
        slot.landed_event = None
        copied = record_event(d2h)
        slot.accumulation = self.worker.submit(_accumulate, slot.landing, staging, copied, final)
        slot.sq_norm = slot.accumulation if final else None

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
        self._device_tier.flush()

    def grad_sq_norm(self, groups):
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.streams.d2h)
        out = self._device_tier.grad_sq_norm([g for g in groups if self._on_device(g)])
        for group in groups:
            slot = self._slots[group.index]
            if slot.on_device or not slot.landed:
                continue
            if self.cuda and slot.sq_norm is not None:
                out.append(slot.sq_norm)
            else:
                out.append(float(slot.landing.pow(2).sum()))
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

    def end_window(self, group):
        slot = self._slots[group.index]
        if slot.on_device:
            return self._device_tier.end_window(group)
        slot.landed = False
        slot.sq_norm = None
        group.grad = None

    def read_master(self, group):
        return group.master

    def close(self):
        for slot in self._slots.values():
            if slot.accumulation is not None:
                slot.accumulation.result()
        self._slots.clear()
        self._pending.clear()
        self._state.clear()

    @hookimpl
    def zkernel_memory_tensors(self, group):
        slot = self._slots.get(group.index)
        if slot is None:
            return None
        if slot.on_device:
            return self._device_tier.zkernel_memory_tensors(group)
        return {
            "params": [slot.staging] if slot.staging is not None else [],
            "grads": [slot.landing],
            "master_weights": [group.master],
            "optimizer_state": [t for t in group.optim_state.values() if isinstance(t, torch.Tensor)],
        }


def _accumulate(landing: torch.Tensor, staging: torch.Tensor, copied: Any, final: bool) -> float | None:
    """Host worker: add a later micro-batch's gradient once its copy arrived; the norm when final."""
    copied.synchronize()
    landing.add_(staging)
    return float(landing.pow(2).sum()) if final else None


@attrs.frozen(kw_only=True)
class CpuParamsOptions:
    """``offload.params_options`` of the ``cpu`` tier."""

    # Page-lock the host shards: None = where CUDA is available; True = required (error without CUDA).
    pin_memory: bool | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.instance_of(bool)))
    # Bytes of shards ahead of the running unit, in the traced order, to upload to the device
    # (the nearest `prefetch_bytes` of them are also gathered ahead).
    prefetch_device_bytes: int = attrs.field(default=1 << 30, validator=attrs.validators.ge(0))


class CpuParamsTier(ParamsTier):
    """Compute-dtype parameter shards in (page-locked) host memory, uploaded to the device per gather.

    Each group's shard lives on the host; a gather needs it on the device, so
    `to_device` uploads it on the h2d stream into a transient device buffer
    (allocated from that stream's pool) and records an event; the consumer (the
    compute stream for a fetch, the gather stream for a prefetch) waits for that
    event only. The buffer is freed once the gather consumed it. An optimizer
    step on the host writes its rounded result straight into the home shard
    (zero copy); one on the device is downloaded on the d2h stream. Each rank
    moves only its own shard over its own link, so host bandwidth adds up with
    the number of GPUs (bandwidth-centric partitioning).
    """

    on_compute_device = False

    def __init__(self, context, role: str = "params") -> None:
        self.options = context.options or CpuParamsOptions()
        self.lookahead_device_bytes = self.options.prefetch_device_bytes
        self.device = context.device
        self.cuda = self.device.type == "cuda"
        self.streams = context.streams
        self.timeline = context.timeline
        # group index -> (device copy, its upload event); reads of the home in flight: group -> event
        self._device: dict[int, tuple[torch.Tensor, Any]] = {}
        self._home_reads: dict[int, Any] = {}
        self._downloads: dict[int, Any] = {}

    def demand(self, numel, compute_dtype):
        return {Resource.HOST: numel * torch.empty((), dtype=compute_dtype).element_size()}

    def adopt(self, group, shard):
        home = host_empty(shard.numel(), shard.dtype, pin=self.options.pin_memory)
        home.copy_(shard)
        return home

    def to_device(self, group, *, consume, block):
        home = group.param_shard
        if not self.cuda:
            if consume:
                group.device_shard = home
            return True
        entry = self._device.get(group.index)
        if entry is None:
            h2d = self.streams.h2d
            nbytes = home.numel() * home.element_size()
            with torch.cuda.stream(h2d), self.timeline.span(SpanKind.PARAM_H2D, stream=h2d, label=group.name, nbytes=nbytes):
                copy = torch.empty(home.shape, dtype=home.dtype, device=self.device)
                copy.copy_(home, non_blocking=True)
            entry = (copy, record_event(h2d))
            self._device[group.index] = entry
            self._home_reads[group.index] = entry[1]
        if consume:
            torch.cuda.current_stream(self.device).wait_event(entry[1])
            group.device_shard = entry[0]
        return True

    def drop_device(self, group):
        entry = self._device.pop(group.index, None)
        group.device_shard = None
        if entry is not None:
            copy = entry[0]
            copy.record_stream(torch.cuda.current_stream(self.device))
            if self.streams.gather is not None:
                copy.record_stream(self.streams.gather)

    def before_update(self, group):
        for pending in (self._home_reads, self._downloads):
            event = pending.pop(group.index, None)
            if event is not None:
                event.synchronize()

    def commit(self, group):
        home = group.param_shard
        source = group.copy_out if group.copy_out is not None else group.master
        stale = self._device.pop(group.index, None)  # a device copy of the old values
        if stale is not None:
            stale[0].record_stream(torch.cuda.current_stream(self.device))
        if shares_storage(source, home):
            return None
        if source.device.type == "cpu" or not self.cuda:
            home.copy_(source)
            return None
        d2h = self.streams.d2h
        d2h.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(d2h):
            home.copy_(source, non_blocking=True)
            source.record_stream(d2h)
        event = record_event(d2h)
        self._downloads[group.index] = event
        return event

    def close(self):
        for event in (*self._home_reads.values(), *self._downloads.values()):
            event.synchronize()
        self._device.clear()
        self._home_reads.clear()
        self._downloads.clear()

    @hookimpl
    def zkernel_memory_tensors(self, group):
        return {"params": [group.param_shard]} if group.param_shard is not None else None


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
