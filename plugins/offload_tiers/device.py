"""Tier ``none``: optimizer state and parameters stay on the compute device.

Masters stay where the partitioner built them (an fp32 run's master *is* the
parameter shard), optimizer state is allocated there, and a reduced gradient
is adopted as the landing buffer (later micro-batches of a window add into
it), so nothing is copied. Landings are completed at most one behind the
newest, as a partitioner's reduction would (on NCCL completing means a stream
dependency; on gloo a host wait), so two reductions stay in flight. The
optimizer writes the updated values straight into the parameter shard
(``copy_out``), so a step publishes in stream order.
"""

from __future__ import annotations

from collections import deque

import torch

from zkernel import hookimpl
from zkernel.tiers import OptimizerTier, ParamsTier, Resource, ShardState

from ._state import write_optimizer_state


def _aliases(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is not None and b is not None and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class DeviceTier(OptimizerTier, ParamsTier):
    """State stays where compute is; nothing to move."""

    masters_on_compute_device = True
    on_compute_device = True

    def __init__(self, context, role: str) -> None:
        self.role = role
        self.compute_dtype = context.compute_dtype
        # Landings not yet completed, oldest first: (group, reduced).
        self._pending: deque = deque()

    def __repr__(self) -> str:
        return f"DeviceTier(role={self.role!r})"

    # -- placement ----------------------------------------------------------------

    def demand(self, numel, *args):
        if self.role == "params":
            compute_dtype = args[0]
            return {Resource.DEVICE: numel * torch.empty((), dtype=compute_dtype).element_size()}
        state, compute_dtype = args
        master = 0 if compute_dtype == torch.float32 else 4
        return {Resource.DEVICE: numel * (master + 4) + sum(s.nbytes for s in state)}

    def adopt(self, group, *args):
        if self.role == "params":
            return args[0]
        master, state = args
        group.master = master
        group.optim_state = {s.name: torch.zeros(s.shape, dtype=s.dtype, device=master.device) for s in state}
        shard = group.param_shard
        group.copy_out = shard if shard is not None and not _aliases(shard, master) else None
        return None

    # -- gradients ------------------------------------------------------------------

    def land(self, group, reduced, final):
        self._pending.append((group, reduced))
        while len(self._pending) > 1:
            self._complete(*self._pending.popleft())

    def flush(self):
        while self._pending:
            self._complete(*self._pending.popleft())

    @staticmethod
    def _complete(group, reduced) -> None:
        if reduced.work is not None:
            reduced.work.wait()
        if reduced.accumulate and group.grad is not None:
            group.grad.add_(reduced.tensor)
        else:
            group.grad = reduced.tensor

    def grad_sq_norm(self, groups):
        grads = [g.grad for g in groups if g.grad is not None]
        if not grads:
            return []
        return [torch.stack(torch._foreach_norm(grads)).float().pow(2).sum()]

    # -- step -------------------------------------------------------------------------

    def steps_on_host(self, group):
        return False

    def acquire(self, group):
        if group.grad is None:  # no gradient landed in this window: step on zeros
            group.grad = torch.zeros_like(group.master)

    def release(self, group):
        return None

    def end_window(self, group):
        group.grad = None

    def read_master(self, group):
        return group.master

    def read_state(self, group):
        return ShardState(master=group.master, state=dict(group.optim_state))

    def write_state(self, group, state):
        # In fp32 runs the master is the parameter shard itself, so this also updates it.
        group.master.copy_(state.master)
        write_optimizer_state(group, state.state, group.master.device)
        if group.copy_out is not None:
            group.copy_out.copy_(group.master)

    @hookimpl
    def zkernel_memory_tensors(self, group):
        if self.role == "params" or not group.requires_grad:
            return None
        return {
            "grads": [group.grad] if group.grad is not None else [],
            "master_weights": [group.master],
            "optimizer_state": [t for t in group.optim_state.values() if isinstance(t, torch.Tensor)],
        }


@hookimpl
def zkernel_register_offload_tiers(registry) -> None:
    registry.add(
        "none",
        DeviceTier,
        description="state stays on the compute device (GPU when present, else CPU)",
    )
