"""A group's own values, read from and written back through its tiers.

Used where values change outside the optimizer: a checkpoint load writes them,
and writes to whole parameters are folded into them (`param_writes`).
"""

from __future__ import annotations

import torch

from zkernel.spec.groups import ParamGroup
from zkernel.spec.tiers import ShardState


def kept_optimizer_state(state) -> dict[str, torch.Tensor]:
    """Host copies of the optimizer state in ``state`` (what `OptimizerTier.read_state` gave), to hand
    back with a new master: the tiers take master and state together, and `read_state` may return the
    tier's own staging buffers, which `write_state` must not be given."""
    return {name: t.detach().to("cpu", copy=True) for name, t in state.state.items()}


def read_shard_values(engine, group: ParamGroup) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
    """A host copy of ``group``'s own values, flat: its fp32 master (a trainable group, with host copies of
    its optimizer state to hand back) or its parameter shard (a frozen one, state None)."""
    if group.requires_grad:
        state = engine.optimizer_tier.read_state(group)
        return state.master.detach().to("cpu", copy=True).reshape(-1), kept_optimizer_state(state)
    return engine.params_tier.read_shard(group).detach().to("cpu", copy=True).reshape(-1), None


def write_shard_values(engine, group: ParamGroup, values: torch.Tensor, kept: dict[str, torch.Tensor] | None) -> None:
    """Give ``group`` the values `read_shard_values` returned, changed: its master and the rounded
    parameter shard, or a frozen group's shard."""
    if group.requires_grad:
        engine.optimizer_tier.write_state(group, ShardState(master=values, state=kept))
        engine.refresh_param_shard(group)
    else:
        engine.params_tier.write_shard(group, values)
