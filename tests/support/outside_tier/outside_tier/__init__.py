"""Offload tier ``hostram``, shipped by a distribution of its own (``outside-tier``).

Registered through the entry-point group ``zkernel`` of its own
``outside_tier-0.1.dist-info``, it imports nothing of zkernel but the plugin
surface (`zkernel.spec`), like any third party's tier. It serves the optimizer
role only: the fp32 master, the optimizer's state and the gradient landing
buffer are copies in host memory, stepped there on the main thread (no
speculation); updates reach the parameters through the params tier's
``commit`` (or straight into a compute-dtype shard that lives on the host).
It answers for its bytes (``zkernel_size_offload_tier``), so ``zkernel
estimate`` has its row and "auto" placement may choose it.
"""

from __future__ import annotations

import attrs
import torch

from zkernel.spec import ConfigError, OptimizerTier, Resource, Role, ShardState, TierSizing, boolean, hookimpl

_HOST = torch.device("cpu")


@attrs.frozen(kw_only=True)
class HostRamOptions:
    """``offload.optimizer_options`` of ``hostram``."""

    # Zero the landing buffer before every window's first gradient (else it is overwritten).
    zero_landing: bool = attrs.field(default=False, validator=boolean())


class HostRamTier(OptimizerTier):
    """Masters, state and gradients in host memory, as copies of their own."""

    def __init__(self, context, role: str) -> None:
        if role != "optimizer":
            raise ConfigError(f"offload tier 'hostram' serves offload.optimizer only, not offload.{role}")
        self.options = context.options or HostRamOptions()
        self._landed: dict[int, bool] = {}  # group index -> a gradient landed in this window
        self._landing: dict[int, torch.Tensor] = {}  # group index -> its fp32 landing buffer
        self._pending: list = []

    def demand(self, numel, state, compute_dtype):
        return {Resource.HOST: numel * 8 + sum(s.nbytes for s in state)}

    def adopt(self, group, master, state):
        group.master = master.detach().to(_HOST, copy=True)
        group.optim_state = {s.name: torch.zeros(s.shape, dtype=s.dtype, device=_HOST) for s in state}
        self._landing[group.index] = torch.zeros(group.master.numel(), dtype=torch.float32, device=_HOST)
        shard = group.param_shard
        # A compute-dtype shard in host memory takes the rounded update straight; elsewhere the
        # params tier copies the master over (`ParamsTier.commit`).
        on_host = shard is not None and shard.device.type == "cpu" and shard.dtype != torch.float32
        group.copy_out = shard if on_host else None
        self._landed[group.index] = False

    def land(self, group, reduced, final):
        self._pending.append((group, reduced))

    def flush(self):
        pending, self._pending = self._pending, []
        for group, reduced in pending:
            if reduced.work is not None:
                reduced.work.wait()
            if reduced.accumulate and self._landed[group.index]:
                self._landing[group.index].add_(reduced.tensor.to(_HOST))
            else:
                self._landing[group.index].copy_(reduced.tensor)
            self._landed[group.index] = True
            group.grad = self._landing[group.index]

    def grad_sq_norm(self, groups):
        self.flush()
        return [float(self._landing[g.index].double().pow(2).sum()) for g in groups if self._landed[g.index]]

    def steps_on_host(self, group):
        return False

    def acquire(self, group):
        self.flush()
        if not self._landed[group.index]:
            self._landing[group.index].zero_()
        group.grad = self._landing[group.index]

    def end_window(self, group):
        self._landed[group.index] = False
        if self.options.zero_landing:
            self._landing[group.index].zero_()
        group.grad = None

    def read_master(self, group):
        return group.master

    def read_state(self, group):
        return ShardState(master=group.master, state=dict(group.optim_state))

    def write_state(self, group, state):
        group.master.copy_(state.master)
        for name, value in state.state.items():
            group.optim_state[name].copy_(value)

    @hookimpl
    def zkernel_memory_tensors(self, group):
        if not group.requires_grad:
            return None
        return {
            "grads": [self._landing[group.index]],
            "master_weights": [group.master],
            "optimizer_state": [t for t in group.optim_state.values() if isinstance(t, torch.Tensor)],
        }


@hookimpl
def zkernel_register_offload_tiers(registry) -> None:
    registry.add(
        "hostram",
        HostRamTier,
        description="optimizer: fp32 masters, state and gradients as copies in host memory, stepped there",
        options_cls={"optimizer": HostRamOptions, "params": None},
    )


@hookimpl
def zkernel_size_offload_tier(name, role, options, device):
    if name != "hostram" or role != "optimizer":
        return None
    where = {Role.MASTER: "cpu", Role.GRAD_LANDING: "cpu", Role.OPTIMIZER_STATE: "cpu", Role.STAGING: None}
    return TierSizing(role=role, where=where, steps_on="cpu")
