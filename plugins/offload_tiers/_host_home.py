"""Host placement: a group's fp32 master and declared optimizer state in (page-locked) host memory."""

from __future__ import annotations

import torch

from zkernel.platform.host_memory import host_empty, host_zeros
from zkernel.spec.tiers import ShardState

from ._split_master import SplitMasters
from ._state import write_optimizer_state


class HostPlacement:
    """Keeps masters and optimizer state of host-stepped groups in host memory for the whole run.

    `adopt` (main thread, `OptimizerTier.adopt`) allocates them once, page-locked
    when ``pin`` (or when None and CUDA is available), and points ``group.master``
    and ``group.optim_state`` at them; the host step then updates them in place
    on the engine's host worker, so nothing moves between steps. Where ``split``
    asks for it (True, or None: where possible), `settle` keeps a group's master
    as its low half beside its bf16 parameter shard instead ([Note: split masters
    in the tiers] in ``_split_master``): `acquire` rebuilds it for the step and
    `release` stores it back, on the host worker. The checkpoint calls
    (`read_state`, `write_state`) run on the main thread between steps.
    """

    def __init__(self, pin: bool | None, *, split: bool | None = False, compute_dtype=None, streams=None, tier: str = "cpu") -> None:
        self.pin = pin
        self.split_wish = split
        self.compute_dtype = compute_dtype
        self.tier = tier
        self.split = SplitMasters(torch.device("cpu"), pin=pin, streams=streams) if split is not False else None

    def adopt(self, group, master: torch.Tensor, state) -> None:
        """Copy the initial ``master`` to the host and allocate the declared ``state`` (zeros)."""
        host_master = host_empty(master.numel(), torch.float32, pin=self.pin)
        host_master.copy_(master)
        group.master = host_master
        group.optim_state = {
            s.name: host_zeros(s.shape, s.dtype, pin=self.pin) if s.per_element else torch.zeros(s.shape, dtype=s.dtype)
            for s in state
        }

    def settle(self, group) -> None:
        """Once the tier's other parts have read the new ``group.master``: keep it split where asked."""
        if self.split is not None:
            self.split.settle(group, self.split_wish, self.compute_dtype, self.tier)

    def splits_on_disk(self, group) -> bool:
        """Whether a group whose master lives in a swap file keeps it split there: only where the option
        says true (as `settle` decides then); ``"auto"`` keeps swap files whole."""
        return self.split_wish is True and self.split.decide(group, True, self.compute_dtype, self.tier)

    def splits(self, group) -> bool:
        return self.split is not None and self.split.holds(group)

    def split_numel(self) -> int:
        """Elements of the masters kept split."""
        return self.split.numel() if self.split is not None else 0

    def unsplit(self, group) -> None:
        """``group.master`` as a whole fp32 host tensor again (before the GPU share takes the group)."""
        if self.splits(group):
            group.master = self.split.drop(group)

    def acquire(self, group) -> None:
        """On the stepping thread: ``group.master`` ready (rebuilt for the step where it is split)."""
        if self.splits(group):
            self.split.lend(group)

    def release(self, group) -> None:
        """On the stepping thread, after the step's update was committed: a split master stored back."""
        if self.splits(group):
            self.split.take_back(group)

    def read_master(self, group) -> torch.Tensor:
        return self.split.read(group) if self.splits(group) else group.master

    def read_state(self, group) -> ShardState:
        return ShardState(master=self.read_master(group), state=dict(group.optim_state))

    def write_state(self, group, state: ShardState) -> None:
        if self.splits(group):
            self.split.write(group, state.master)
        else:
            group.master.copy_(state.master)
        write_optimizer_state(group, state.state, torch.device("cpu"), make=self._host_like)

    def _host_like(self, value: torch.Tensor) -> torch.Tensor:
        if value.dim() == 0:
            return torch.empty((), dtype=value.dtype)
        return host_empty(value.shape, value.dtype, pin=self.pin)

    def tensors(self, group) -> dict[str, list]:
        """The master and state, under `zkernel_memory_tensors`'s categories."""
        return {
            "master_weights": [*self.split.tensors(group), *self.split.working()] if self.splits(group) else [group.master],
            "optimizer_state": [t for t in group.optim_state.values() if isinstance(t, torch.Tensor)],
        }

    def close(self) -> None:
        if self.split is not None:
            self.split.close()
