"""Host placement: a group's fp32 master and declared optimizer state in (page-locked) host memory."""

from __future__ import annotations

import torch

from zkernel.platform.host_memory import host_empty, host_zeros
from zkernel.spec.tiers import ShardState

from ._state import write_optimizer_state


class HostPlacement:
    """Keeps masters and optimizer state of host-stepped groups in host memory for the whole run.

    `adopt` (main thread, `OptimizerTier.adopt`) allocates them once, page-locked
    when ``pin`` (or when None and CUDA is available), and points ``group.master``
    and ``group.optim_state`` at them; the host step then updates them in place
    on the engine's host worker, so nothing moves between steps. The
    checkpoint calls (`read_state`, `write_state`) run on the main thread
    between steps. Holds no state of its own: the group's fields are the home.
    """

    def __init__(self, pin: bool | None) -> None:
        self.pin = pin

    def adopt(self, group, master: torch.Tensor, state) -> None:
        """Copy the initial ``master`` to the host and allocate the declared ``state`` (zeros)."""
        host_master = host_empty(master.numel(), torch.float32, pin=self.pin)
        host_master.copy_(master)
        group.master = host_master
        group.optim_state = {
            s.name: host_zeros(s.shape, s.dtype, pin=self.pin) if s.per_element else torch.zeros(s.shape, dtype=s.dtype)
            for s in state
        }

    @staticmethod
    def read_state(group) -> ShardState:
        return ShardState(master=group.master, state=dict(group.optim_state))

    def write_state(self, group, state: ShardState) -> None:
        group.master.copy_(state.master)
        write_optimizer_state(group, state.state, torch.device("cpu"), make=self._host_like)

    def _host_like(self, value: torch.Tensor) -> torch.Tensor:
        if value.dim() == 0:
            return torch.empty((), dtype=value.dtype)
        return host_empty(value.shape, value.dtype, pin=self.pin)

    @staticmethod
    def tensors(group) -> dict[str, list]:
        """The master and state, under `zkernel_memory_tensors`'s categories."""
        return {
            "master_weights": [group.master],
            "optimizer_state": [t for t in group.optim_state.values() if isinstance(t, torch.Tensor)],
        }
