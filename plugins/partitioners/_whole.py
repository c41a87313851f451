"""Group construction for partitioners whose parameters stay whole on every rank (none, ZeRO-1, ZeRO-2).

Parameters are cut into buckets (reverse registration order, ``bucket_size``
elements each); each bucket becomes one `ParamGroup` whose parameters are views
of one flat compute-dtype buffer (see [Note: flat layout] in `_flat`). Rank
``r`` owns slice ``r`` of it (the whole buffer without sharding): that slice is
the group's ``param_shard``, which the optimizer's result reaches and which the
partitioner all-gathers after a step. The initial fp32 master is that slice
itself in fp32 runs and an fp32 copy of it otherwise; the optimizer tier
decides where the master then lives.

[Note: a meta-device model kept whole] A model built on the meta device is
materialised as zero3 materialises it (`_materialize`: zero3's ``"modules"``
units, unit *i* under ``init_seed + i``, the model's initialiser, then its
buffers), so one meta-built model starts from the same values under every
builtin partitioner and a checkpoint or a comparison across them holds. These
partitioners keep the parameters whole, so every unit is built before the
buckets are cut; each bucket's flat buffers then take its parameters' values
and the unit's own storage is freed, so the model never takes more than it
holds once built (its materialised dtype, then the buckets').
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs
import torch
import torch.distributed as dist
from torch import nn

from zkernel.spec.options import integer
from zkernel.spec.groups import ParamGroup
from zkernel.params.param_writes import unbind, watch

from ._flat import FlatLayout, all_gather_flat, flatten_into, module_units, split_buckets, split_trainable, unique_named_params
from ._materialize import materialized_units


@attrs.frozen(kw_only=True)
class BucketOptions:
    """``partitioner_options`` of none, zero1 and zero2."""

    # Elements per bucket: the unit of gradient reduction and of the optimizer step.
    bucket_size: int = attrs.field(default=25_000_000, validator=integer(minimum=1))
    # Seed from which each unit of a meta-device model is initialised, as zero3's
    # ([Note: a meta-device model kept whole]).
    init_seed: int = attrs.field(default=0, validator=integer())


@attrs.define(eq=False)
class WholeState:
    """Per-group buffers of a whole-parameter partitioner (``group.layout``)."""

    flat: FlatLayout
    full: torch.Tensor  # compute dtype, ``padded`` elements; parameters are views of it
    # fp32 whole gradient accumulated locally over the window (none, zero1), or None.
    grad_full: torch.Tensor | None = None
    # Whether this window already handed a gradient to the optimizer tier (zero2).
    contributed: bool = False

    @property
    def numel(self) -> int:
        return self.flat.numel


def _move_frozen(frozen: list[tuple[str, nn.Parameter]], device, dtype) -> None:
    for _, p in frozen:
        p.data = p.data.to(device=device, dtype=dtype if p.is_floating_point() else p.dtype)


def build_whole_groups(module: nn.Module, context, shards: int, options: BucketOptions) -> Iterator[ParamGroup]:
    """Flatten the trainable parameters into bucket groups sharded ``shards`` ways, one at a time.

    Rank 0's values are broadcast, so every rank starts from the same model; a
    meta-device model is built first ([Note: a meta-device model kept whole]).
    """
    device, dtype = context.device, context.compute_dtype
    if any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        for _ in materialized_units(module, module_units(module), device, options.init_seed, context.init_fn, context.left_unset):
            pass
    trainable, frozen = split_trainable(unique_named_params(module))
    _move_frozen(frozen, device, dtype)
    rank = context.rank if shards > 1 else 0
    for index, bucket in enumerate(split_buckets(trainable, options.bucket_size)):
        params = tuple(p for _, p in bucket)
        flat = FlatLayout.of(params, shards, rank)
        full = torch.empty(flat.padded, dtype=dtype, device=device)
        flatten_into(full, flat, [p.data for p in params])
        master_full = None
        if dtype != torch.float32:
            master_full = torch.empty(flat.padded, dtype=torch.float32, device=device)
            flatten_into(master_full, flat, [p.data.float() for p in params])
        if context.dist.distributed:
            dist.broadcast(full, src=0)
            if master_full is not None:
                dist.broadcast(master_full, src=0)
        for (name, p), view in zip(bucket, flat.views(full)):
            p.data = view
            watch(p, view, name)  # [Note: writes to gathered parameters] in `zkernel.params.param_writes`
        own = flat.own if shards > 1 else slice(0, flat.padded)
        param_shard = full[own]
        if master_full is None:
            master = param_shard
        else:  # a copy of the slice: a view would keep the whole fp32 buffer alive on every rank
            master = master_full[own].clone() if shards > 1 else master_full
        yield ParamGroup(
            index=index,
            name=f"bucket{index}",
            params=params,
            param_names=tuple(n for n, _ in bucket),
            requires_grad=True,
            master=master,
            param_shard=param_shard,
            grad_is_shard=shards > 1,
            layout=WholeState(flat=flat, full=full),
        )
        del master_full, master


def publish(group: ParamGroup, world: int) -> None:
    """After a step: every rank's updated slice goes into every rank's whole parameters."""
    if world > 1:
        state: WholeState = group.layout
        all_gather_flat(state.full, state.full[state.flat.own])


def describe(group: ParamGroup, replicated: bool):
    """This rank's slice of the bucket (`zkernel_describe_shard`); ``replicated`` without sharding."""
    return group.layout.flat.shard_layout(replicated=replicated)


def gather_master(flat: FlatLayout, master: torch.Tensor, device: torch.device, world: int) -> torch.Tensor:
    """The whole fp32 flat buffer from every rank's master slice (collective when sharded)."""
    shard = master.to(device=device, dtype=torch.float32)
    if world == 1 or flat.shards == 1:
        return shard
    full = torch.empty(flat.padded, dtype=torch.float32, device=device)
    all_gather_flat(full, shard)
    return full


def restore(group: ParamGroup, master: torch.Tensor | None, device: torch.device, world: int) -> None:
    """Give the parameters their fp32 master values in storage of their own (`Engine.close`)."""
    if master is None:
        return
    full = gather_master(group.layout.flat, master, device, world)
    for p, view in zip(group.params, group.layout.flat.views(full)):
        unbind(p)  # storage of its own again ([Note: assignments keep the storage] in `zkernel.params.param_writes`)
        p.data = view.clone()


def memory_of(group: ParamGroup) -> dict[str, list[torch.Tensor]]:
    state: WholeState = group.layout
    return {
        "params": [state.full],
        "grads": [state.grad_full] if state.grad_full is not None else [],
    }
