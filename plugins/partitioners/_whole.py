"""Group construction for partitioners whose parameters stay whole on every rank (none, ZeRO-1, ZeRO-2).

Parameters are cut into buckets (reverse registration order, ``bucket_size``
elements each); each bucket becomes one `ParamGroup` whose parameters are views
of one flat compute-dtype buffer (see [Note: flat layout] in `_flat`). The
fp32 master is that buffer itself (or this rank's slice of it) in fp32 runs,
and a separate fp32 copy in bf16/fp16 runs, written back through
``group.copy_out``.
"""

from __future__ import annotations

import attrs
import torch
import torch.distributed as dist
from torch import nn

from zkernel.config import integer
from zkernel.groups import ParamGroup

from ._flat import FlatLayout, flatten_into, split_buckets, split_trainable, unique_named_params


@attrs.frozen(kw_only=True)
class BucketOptions:
    """``partitioner_options`` of none, zero1 and zero2."""

    # Elements per bucket: the unit of gradient reduction and of the optimizer step.
    bucket_size: int = attrs.field(default=25_000_000, validator=integer(minimum=1))


@attrs.define(eq=False)
class WholeState:
    """Per-group buffers of a whole-parameter partitioner (``group.layout``)."""

    flat: FlatLayout
    full: torch.Tensor  # compute dtype, ``padded`` elements; parameters are views of it
    grad_full: torch.Tensor | None = None  # fp32 full gradient (persistent or transient)
    grad_shard: torch.Tensor | None = None  # fp32 owned slice of the reduced gradient
    work: list = attrs.field(factory=list)  # outstanding collectives
    pending: list = attrs.field(factory=list)  # callbacks to run once ``work`` is done

    @property
    def numel(self) -> int:
        return self.flat.numel

    def finish(self) -> None:
        for work in self.work:
            work.wait()
        for callback in self.pending:
            callback()
        self.work.clear()
        self.pending.clear()


def _move_frozen(frozen: list[tuple[str, nn.Parameter]], device, dtype) -> None:
    for _, p in frozen:
        p.data = p.data.to(device=device, dtype=dtype if p.is_floating_point() else p.dtype)


def build_whole_groups(
    module: nn.Module, context, shards: int, bucket_numel: int
) -> list[ParamGroup]:
    """Flatten the trainable parameters into bucket groups sharded ``shards`` ways.

    Rank 0's values are broadcast, so every rank starts from the same model.
    """
    device, dtype = context.device, context.compute_dtype
    trainable, frozen = split_trainable(unique_named_params(module))
    _move_frozen(frozen, device, dtype)
    rank = context.rank if shards > 1 else 0
    groups = []
    for index, bucket in enumerate(split_buckets(trainable, bucket_numel)):
        names = tuple(n for n, _ in bucket)
        params = tuple(p for _, p in bucket)
        flat = FlatLayout.of(params, shards, rank)
        master_full = None
        if dtype != torch.float32:
            master_full = torch.empty(flat.padded, dtype=torch.float32, device=device)
            flatten_into(master_full, flat, [p.data.float() for p in params])
        full = torch.empty(flat.padded, dtype=dtype, device=device)
        flatten_into(full, flat, [p.data for p in params])
        if context.dist.distributed:
            dist.broadcast(full, src=0)
            if master_full is not None:
                dist.broadcast(master_full, src=0)
        for p, view in zip(params, flat.views(full)):
            p.data = view
        state = WholeState(flat=flat, full=full)
        own = flat.own if shards > 1 else slice(0, flat.padded)
        if master_full is None:
            master, copy_out = full[own], None
        else:
            master = master_full[own].clone() if shards > 1 else master_full
            copy_out = full[own]
        groups.append(
            ParamGroup(
                index=index,
                name=f"bucket{index}",
                params=params,
                param_names=names,
                requires_grad=True,
                master=master,
                copy_out=copy_out,
                grad_is_shard=shards > 1,
                layout=state,
            )
        )
    return groups


def memory_of(group: ParamGroup) -> dict[str, list[torch.Tensor]]:
    state: WholeState = group.layout
    report = {
        "params": [state.full],
        "grads": [t for t in (state.grad_full, state.grad_shard) if t is not None],
        "optimizer_state": [t for t in group.optim_state.values() if isinstance(t, torch.Tensor)],
    }
    if group.copy_out is not None:
        report["master_weights"] = [group.master]
    return report
