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
  the landing buffer, and writes rounded parameters into the staging copy;
  `release` uploads it (or the fp32 master) into the group's parameter shard
  on the h2d stream and returns that upload's event, which the next use of
  the shard waits for. A staging copy is rewritten only after its previous
  upload completed.

Without CUDA the same buffers exist and every copy is a plain host copy in
program order; landings are completed one behind the newest, as the device
tier does.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from typing import Any

import attrs
import torch

from zkernel import hookimpl
from zkernel.host_memory import host_empty, host_zeros
from zkernel.step_pipeline import SPECULATE_POLICIES
from zkernel.streams import record_event
from zkernel.tiers import OptimizerTier, Resource, ShardState

from ._state import write_optimizer_state


@attrs.frozen(kw_only=True)
class CpuTierOptions:
    """``offload.optimizer_options`` of the ``cpu`` tier."""

    # Page-lock the host buffers: None = where CUDA is available; True = required (error without CUDA).
    pin_memory: bool | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.instance_of(bool)))
    # Start host steps before the global norm is known and roll them back when clipping or an
    # fp16 overflow applies: "auto" (when the previous step needed neither), "always", "never".
    speculate: str = attrs.field(default="auto", validator=attrs.validators.in_(SPECULATE_POLICIES))


@attrs.define(eq=False)
class _Slot:
    """The host buffers of one group and the transfers in flight for it."""

    landing: torch.Tensor
    param_shard: torch.Tensor | None
    landed: bool = False  # a gradient landed in this window
    landed_event: Any = None  # CUDA event of the last device-to-host copy
    sq_norm: torch.Tensor | Future | None = None
    accumulation: Future | None = None  # host-side add of a later micro-batch
    upload_event: Any = None  # CUDA event of the last upload from the staging copy


class CpuTier(OptimizerTier):
    """Masters, optimizer state and gradients in host memory; the step runs on the host."""

    masters_on_compute_device = False

    def __init__(self, context, role: str) -> None:
        if role != "optimizer":
            raise ValueError(
                "tier 'cpu' for offload.params is not available yet; valid offload.params: 'none'"
            )
        self.options = context.options or CpuTierOptions()
        self.speculate = self.options.speculate
        self.device = context.device
        self.compute_dtype = context.compute_dtype
        self.cuda = self.device.type == "cuda"
        self.streams = context.streams
        self.worker = context.host_worker
        self._slots: dict[int, _Slot] = {}
        self._pending: deque = deque()  # CPU-only landings not completed yet

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
        group.copy_out = None if self.compute_dtype == torch.float32 else host_empty(numel, self.compute_dtype, pin=self._pin())
        self._slots[group.index] = _Slot(landing=host_empty(numel, torch.float32, pin=self._pin()), param_shard=group.param_shard)

    # -- gradients ------------------------------------------------------------------

    def land(self, group, reduced, final):
        slot = self._slots[group.index]
        first = not reduced.accumulate or not slot.landed
        slot.landed = True
        if not self.cuda:
            self._pending.append((slot, reduced, first))
            while len(self._pending) > 1:
                self._complete(*self._pending.popleft())
            return
        d2h = self.streams.d2h
        tensor = reduced.tensor
        with torch.cuda.stream(d2h):
            if reduced.work is not None:
                reduced.work.wait()
            else:
                d2h.wait_stream(torch.cuda.current_stream(self.device))
            if first:
                slot.landing.copy_(tensor, non_blocking=True)
                slot.sq_norm = tensor.pow(2).sum() if final else None
                slot.landed_event = record_event(d2h)
            else:
                staging = torch.empty(tensor.numel(), dtype=tensor.dtype, pin_memory=True)
                staging.copy_(tensor, non_blocking=True)
                slot.landed_event = None
                copied = record_event(d2h)
                slot.accumulation = self.worker.submit(_accumulate, slot.landing, staging, copied, final)
                slot.sq_norm = slot.accumulation if final else None
            tensor.record_stream(d2h)

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

    def grad_sq_norm(self, groups):
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.streams.d2h)
        out = []
        for group in groups:
            slot = self._slots[group.index]
            if not slot.landed:
                continue
            if self.cuda and slot.sq_norm is not None:
                out.append(slot.sq_norm)
            else:
                out.append(float(slot.landing.pow(2).sum()))
        return out

    # -- step (host worker thread) ------------------------------------------------------

    def steps_on_host(self, group):
        return True

    def acquire(self, group):
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
        if slot.upload_event is not None:  # the staging copy is about to be rewritten
            slot.upload_event.synchronize()
            slot.upload_event = None
        group.grad = slot.landing

    def release(self, group):
        slot = self._slots[group.index]
        if slot.param_shard is None:
            return None
        source = group.copy_out if group.copy_out is not None else group.master
        if not self.cuda:
            slot.param_shard.copy_(source)
            return None
        with torch.cuda.stream(self.streams.h2d):
            slot.param_shard.copy_(source, non_blocking=True)
            slot.upload_event = record_event(self.streams.h2d)
        return slot.upload_event

    def end_window(self, group):
        slot = self._slots[group.index]
        slot.landed = False
        slot.sq_norm = None
        group.grad = None

    def read_master(self, group):
        return group.master

    def read_state(self, group):
        return ShardState(master=group.master, state=dict(group.optim_state))

    def write_state(self, group, state):
        group.master.copy_(state.master)
        write_optimizer_state(group, state.state, torch.device("cpu"), make=self._host_like)
        slot = self._slots[group.index]
        if slot.upload_event is not None:
            slot.upload_event.synchronize()
            slot.upload_event = None
        if slot.param_shard is not None:
            slot.param_shard.copy_(group.master)  # rounds to the shard's dtype; synchronous

    def _host_like(self, value: torch.Tensor) -> torch.Tensor:
        if value.dim() == 0:
            return torch.empty((), dtype=value.dtype)
        return host_empty(value.shape, value.dtype, pin=self._pin())

    def close(self):
        for slot in self._slots.values():
            if slot.accumulation is not None:
                slot.accumulation.result()
        self._slots.clear()
        self._pending.clear()

    @hookimpl
    def zkernel_memory_tensors(self, group):
        slot = self._slots.get(group.index)
        if slot is None:
            return None
        return {
            "params": [group.copy_out] if group.copy_out is not None else [],
            "grads": [slot.landing],
            "master_weights": [group.master],
            "optimizer_state": [t for t in group.optim_state.values() if isinstance(t, torch.Tensor)],
        }


def _accumulate(landing: torch.Tensor, staging: torch.Tensor, copied: Any, final: bool) -> float | None:
    """Host worker: add a later micro-batch's gradient once its copy arrived; the norm when final."""
    copied.synchronize()
    landing.add_(staging)
    return float(landing.pow(2).sum()) if final else None


@hookimpl
def zkernel_register_offload_tiers(registry) -> None:
    registry.add(
        "cpu",
        CpuTier,
        description="fp32 masters, optimizer state and gradients in (page-locked) host memory; CPU step overlapping the GPU",
        options_cls=CpuTierOptions,
    )
