"""Tier ``none``: optimizer state and parameters stay on the compute device.

Optimizer role: masters stay where the partitioner built them (an fp32 run's
master *is* the parameter shard), optimizer state is allocated there, and a
reduced gradient is adopted as the landing buffer (later micro-batches of a
window add into it), so nothing is copied. Landings are completed at most one
behind the newest, as a partitioner's reduction would (on NCCL completing
means a stream dependency; on gloo a host wait), so two reductions stay in
flight. The optimizer writes the updated values straight into the parameter
shard (``copy_out``) when the shard lives on its device.

Params role: the shard stays on the compute device, so it is its own device
copy and a step's update is already home.

[Note: the last landing] The last reduction of a backward (the first group of
the forward, whose gradients come last) was completed at the end of backward,
where the compute stream then stood idle until it finished. Where
nothing has to stay alive for it (no ``keepalive``) and nothing is added to
it, the wait moves to where the gradient is first read: the global norm, or
the group's step, which the step pipeline takes after others
(`StepPipeline._device_order`).
"""

from __future__ import annotations

from collections import deque

import torch

from zkernel.spec import ON_COMPUTE_DEVICE, hookimpl
from zkernel.platform.streams import record_event
from zkernel.spec.tiers import OptimizerTier, ParamsTier, Resource, ShardState
from zkernel.telemetry.timeline import SpanKind

from ._state import write_optimizer_state


def shares_storage(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is not None and b is not None and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def update_target(group, device: torch.device, compute_dtype: torch.dtype, allocate) -> torch.Tensor | None:
    """Where an optimizer stepping on ``device`` writes the rounded update: the shard's home when it
    lives there, else a new buffer from ``allocate(numel, dtype)``; None when the fp32 master itself
    is the update (an fp32 run), is the home, or there is no compute-dtype shard tensor: gathers
    cast the master, or the params tier's home is not a tensor (a swap file) and it lends a buffer
    for each step instead (`ParamsTier.before_update`)."""
    shard, master = group.param_shard, group.master
    if shard is None or shares_storage(shard, master):  # gathers cast the master, or it is the shard
        return None
    if shard is not None and shard.device == device and shard.dtype != torch.float32:
        return shard
    if compute_dtype == torch.float32:
        return None
    return allocate(master.numel(), compute_dtype)


class DeviceOptimizerTier(OptimizerTier):
    """Masters, state and gradients stay where compute is; nothing to move."""

    masters_on_compute_device = True

    def __init__(self, context, role: str = "optimizer") -> None:
        self.compute_dtype = context.compute_dtype
        # Landings not yet completed, oldest first: (group, reduced).
        self._pending: deque = deque()
        # Group index -> the reduction of its gradient, which no stream has waited for yet.
        self._unwaited: dict[int, object] = {}
        # Group index -> this tier's own ``copy_out`` (a params tier may lend another for a step).
        self._staging: dict[int, torch.Tensor | None] = {}

    def __repr__(self) -> str:
        return "DeviceOptimizerTier()"

    def demand(self, numel, state, compute_dtype):
        master = 0 if compute_dtype == torch.float32 else 4
        return {Resource.DEVICE: numel * (master + 4) + sum(s.nbytes for s in state)}

    def adopt(self, group, master, state):
        group.master = master
        group.optim_state = {s.name: torch.zeros(s.shape, dtype=s.dtype, device=master.device) for s in state}
        group.copy_out = self._staging[group.index] = update_target(
            group, master.device, self.compute_dtype, lambda n, dt: torch.empty(n, dtype=dt, device=master.device)
        )

    # -- gradients ------------------------------------------------------------------

    def land(self, group, reduced, final):
        self._pending.append((group, reduced))
        while len(self._pending) > 1:
            self._complete(*self._pending.popleft())

    def flush(self):
        while self._pending:
            self._complete(*self._pending.popleft(), last=True)

    def _complete(self, group, reduced, last: bool = False) -> None:
        self._wait_landed(group)
        adds = reduced.accumulate and group.grad is not None
        if last and reduced.work is not None and reduced.keepalive is None and not adds:
            # See [Note: the last landing] in the module docstring.
            self._unwaited[group.index] = reduced.work
        elif reduced.work is not None:
            reduced.work.wait()
        if adds:
            group.grad.add_(reduced.tensor)
        else:
            group.grad = reduced.tensor

    def _wait_landed(self, group) -> None:
        """Make the current stream wait for the reduction of ``group``'s gradient, if it has not yet."""
        work = self._unwaited.pop(group.index, None)
        if work is not None:
            work.wait()

    def grad_sq_norm(self, groups):
        for group in groups:
            self._wait_landed(group)
        grads = [g.grad for g in groups if g.grad is not None]
        if not grads:
            return []
        return [torch.stack(torch._foreach_norm(grads)).float().pow(2).sum()]

    # -- step -------------------------------------------------------------------------

    def steps_on_host(self, group):
        return False

    def acquire(self, group):
        self._wait_landed(group)
        if group.grad is None:  # no gradient landed in this window: step on zeros
            group.grad = torch.zeros_like(group.master)

    def end_window(self, group):
        self._unwaited.pop(group.index, None)  # a skipped step: its memory waits for the stream itself
        group.grad = None

    def read_grad(self, group):
        self._wait_landed(group)
        return group.grad

    def read_master(self, group):
        return group.master

    def read_state(self, group):
        return ShardState(master=group.master, state=dict(group.optim_state))

    def write_state(self, group, state):
        group.master.copy_(state.master)
        write_optimizer_state(group, state.state, group.master.device)

    @hookimpl
    def zkernel_memory_tensors(self, group):
        if not group.requires_grad:
            return None
        return {
            "params": [t] if (t := self._staging.get(group.index)) is not None else [],
            "grads": [group.grad] if group.grad is not None else [],
            "master_weights": [group.master],
            "optimizer_state": [t for t in group.optim_state.values() if isinstance(t, torch.Tensor)],
        }


class DeviceParamsTier(ParamsTier):
    """Parameter shards stay on the compute device: they are their own device copy.

    An update computed on the host (offloaded optimizer) is uploaded on the h2d
    stream; the buffer it came from is not rewritten before that upload is done.
    """

    on_compute_device = True

    def __init__(self, context, role: str = "params") -> None:
        self.streams = context.streams
        self.timeline = context.timeline
        self._uploads: dict[int, object] = {}  # group index -> CUDA event of its last upload

    def __repr__(self) -> str:
        return "DeviceParamsTier()"

    def demand(self, numel, compute_dtype):
        return {Resource.DEVICE: numel * torch.empty((), dtype=compute_dtype).element_size()}

    def adopt(self, group, shard):
        return shard

    def to_device(self, group, *, consume, block):
        group.device_shard = group.param_shard
        return True

    def before_update(self, group):
        event = self._uploads.pop(group.index, None)
        if event is not None:
            event.synchronize()

    def commit(self, group):
        shard = group.param_shard
        source = group.copy_out if group.copy_out is not None else group.master
        if shard is None or shares_storage(source, shard):
            return None
        if source.device == shard.device or self.streams.h2d is None:
            shard.copy_(source)
            return None
        h2d = self.streams.h2d
        nbytes = source.numel() * source.element_size()
        with torch.cuda.stream(h2d), self.timeline.span(SpanKind.H2D, stream=h2d, label=group.name, nbytes=nbytes):
            shard.copy_(source, non_blocking=True)
        event = record_event(h2d)
        self._uploads[group.index] = event
        return event

    def close(self):
        self._uploads.clear()


def device_tier(context, role: str):
    return DeviceOptimizerTier(context) if role == "optimizer" else DeviceParamsTier(context)


@hookimpl
def zkernel_register_offload_tiers(registry) -> None:
    registry.add(
        "none",
        device_tier,
        description="state stays on the compute device (GPU when present, else CPU)",
        capabilities=(ON_COMPUTE_DEVICE,),
    )


@hookimpl
def zkernel_size_offload_tier(name, role, options, device):
    from ._footprint import device_footprint

    return device_footprint(role) if name == "none" else None
