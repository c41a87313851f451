"""What the builtin partitioners answer for their bytes (``zkernel_size_partition``).

The layouts are the ones ``zkernel_partition_params`` builds, from the same
helpers (`split_buckets`, `module_units`, `FlatLayout`: the alignment and the
padding to a multiple of the world size live there only), computed from the
parameters' shapes alone, so a model on the meta device is laid out without
allocating it. The buffers per group are what each partitioner's
``zkernel_memory_tensors`` and its tiers' name after a step (tests/sizing/test_estimator.py
holds them to ``memory_report()``, byte for byte). A master's bytes are the placement's
(`Placement.master_bytes`: 4 an element, or 2.125 where the optimizer tier keeps it split).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from zkernel.spec import DEVICE, Buffer, PartitionSizing, Placement, Role, SizedGroup

from ._flat import FlatLayout, module_units, split_buckets, split_trainable, unique_named_params


def _sized(params: Sequence[nn.Parameter], shards: int, trainable: bool, module_bound: bool = False) -> SizedGroup:
    layout = FlatLayout.of(params, shards, 0)
    return SizedGroup(
        numel=layout.numel,
        shard=layout.shard_size,
        padded=layout.padded,
        trainable=trainable,
        elements=sum(p.numel() for p in params),
        params=len(params),
        module_bound=module_bound,
    )


class WholeFootprint(PartitionSizing):
    """none, zero1, zero2: whole compute-dtype parameters in reverse-order buckets; fp32 master,
    gradient and state slices of ``shards`` ways; frozen parameters whole, outside any group.

    ``accumulates_whole``: the window's whole fp32 gradient is kept on the device (none, zero1);
    a landing buffer on the device is it (none) or replaces it (zero1). Otherwise (zero2), and
    also for those when a window is one backward (``gradient_accumulation_steps = 1``: the whole
    gradient is reduced by the backward that made it and released), each backward's gradient is
    reduced to this rank's slice, which the optimizer tier lands.
    """

    def __init__(self, module: nn.Module, shards: int, bucket_numel: int, accumulates_whole: bool, divides: tuple[str, ...]) -> None:
        trainable, frozen = split_trainable(unique_named_params(module))
        buckets = split_buckets(trainable, bucket_numel)
        self.groups = [_sized([p for _, p in bucket], shards, True) for bucket in buckets]
        self.forward_order = list(range(len(self.groups)))[::-1]  # the last bucket holds the first parameters
        self.frozen = [p.numel() for _, p in frozen]
        self.shards = shards
        self.accumulates_whole = accumulates_whole
        self.divides = divides

    def buffers(self, group: SizedGroup, placement: Placement, compute_bytes: int) -> list[Buffer]:
        out = [placement.buffer(Role.PARAM_FULL, group.padded * compute_bytes)]
        if not placement.master_is_params(compute_bytes):
            out.append(placement.buffer(Role.MASTER, placement.master_bytes(group.shard)))
        if self.accumulates_whole and placement.accumulation_steps > 1:
            out.append(placement.buffer(Role.GRAD_REDUCE, 4 * group.padded))
            if not placement.on_device(Role.GRAD_LANDING):
                out.append(placement.buffer(Role.GRAD_LANDING, 4 * group.shard))
        else:
            out.append(placement.buffer(Role.GRAD_LANDING, 4 * group.shard))
        return out

    def transient(self, group: SizedGroup, compute_bytes: int) -> tuple[int, int]:
        # Accumulating whole, the gradient is a model state already; else one fp32 reduce bucket.
        return (0, 0) if self.accumulates_whole else (group.padded * 4, 0)

    def frozen_buffers(self, compute_bytes: int) -> list[list[Buffer]]:
        return [[Buffer(Role.PARAM_FULL, numel * compute_bytes, DEVICE)] for numel in self.frozen]


class Zero3Footprint(PartitionSizing):
    """zero3: one group per unit's trainable and frozen parameters (`module_units`), the parts
    under ``persistence_threshold`` pooled in one whole group each (trainable, then frozen),
    last; every group sharded ``world_size`` ways."""

    shards_params = True
    binds_modules = True
    divides = ("optimizer_state", "grads", "params")

    def __init__(self, module: nn.Module, world_size: int, options) -> None:
        groups: list[SizedGroup] = []
        pooled: dict[bool, list[nn.Parameter]] = {True: [], False: []}
        for _, _, named in module_units(module, options.units, options.leaf_modules, options.leaf_experts):
            for trainable in (True, False):
                params = [p for _, p in named if p.requires_grad == trainable]
                if sum(p.numel() for p in params) < options.persistence_threshold:
                    pooled[trainable] += params
                elif params:
                    groups.append(_sized(params, world_size, trainable, module_bound=True))
        groups += [_sized(params, world_size, trainable) for trainable, params in pooled.items() if params]
        self.groups = groups
        self.shards = world_size
        self.forward_order = list(range(len(groups)))
        self.gather_threshold = options.persistence_threshold if options.units == "modules" else None

    def buffers(self, group: SizedGroup, placement: Placement, compute_bytes: int) -> list[Buffer]:
        c = compute_bytes
        out = [] if group.module_bound else [placement.buffer(Role.PARAM_FULL, group.padded * c)]
        if not group.trainable:
            return [*out, placement.buffer(Role.PARAM_SHARD, group.shard * c)]
        params_on_device = placement.on_device(Role.PARAM_SHARD)
        # Gathers cast an fp32 master that stays on the device, for every group alike: the tier's own placement decides.
        casts_master = c != 4 and placement.tier.get(Role.MASTER) == DEVICE and params_on_device
        if not casts_master:
            out.append(placement.buffer(Role.PARAM_SHARD, group.shard * c))
        # An fp32 master on the device is the shard, unless the params tier moved the shard elsewhere.
        if not (placement.master_is_params(c) and params_on_device):
            out.append(placement.buffer(Role.MASTER, placement.master_bytes(group.shard)))
        out.append(placement.buffer(Role.GRAD_LANDING, 4 * group.shard))
        return out

    def transient(self, group: SizedGroup, compute_bytes: int) -> tuple[int, int]:
        if group.module_bound:
            # Gathered parameters and their gradient; the gathered part is what a prefetch holds ahead.
            return group.padded * (compute_bytes + 4), group.padded * compute_bytes
        return group.padded * 4, 0  # a pooled group's reduce
