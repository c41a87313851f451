"""Partitioner ``zero1``: optimizer state and fp32 masters partitioned across ranks.

Algorithm. Parameters stay whole on every rank, flattened into buckets, and
each rank owns one contiguous 1/N slice of every bucket. Gradients accumulate
whole and locally in an fp32 flat buffer over the micro-batches of an
accumulation window (no communication off the boundary); at the boundary each
bucket is averaged by an asynchronous reduce-scatter, so every rank
receives the averaged gradient of its own slice. The optimizer updates only
that slice (state for 1/N of the model), and the updated slices are
all-gathered back into every rank's whole parameters. With one rank the slice
is the whole bucket and no collective runs.
"""

from __future__ import annotations

from zkernel import hookimpl
from zkernel.groups import Phase

from ._flat import all_gather_flat, gather_grads, reduce_scatter_mean
from ._whole import BucketOptions, build_whole_groups, memory_of


class Zero1:
    """Sharded optimizer state and masters; whole parameters and gradients."""

    def __init__(self, context) -> None:
        self.context = context
        self.options = context.options or BucketOptions()

    @hookimpl
    def zkernel_partition_params(self, module, context):
        world = context.world_size
        groups = build_whole_groups(module, context, shards=world, bucket_numel=self.options.bucket_size)
        for group in groups:
            state = group.layout
            state.grad_full = state.full.new_zeros(state.flat.padded, dtype=group.master.dtype)
            state.grad_shard = state.grad_full[state.flat.own] if world == 1 else group.master.new_zeros(state.flat.shard_size)
            group.grad = state.grad_shard
        return groups

    @hookimpl
    def zkernel_release_params(self, group, phase, boundary):
        state = group.layout
        world = self.context.world_size
        if phase is Phase.GRADIENTS:
            gather_grads(group.params, state.flat, state.grad_full, accumulate=True)
            if boundary and world > 1:
                state.work.append(reduce_scatter_mean(state.grad_shard, state.grad_full, async_op=True))
        elif phase is Phase.STEP:
            if world > 1:
                all_gather_flat(state.full, state.full[state.flat.own])
            state.grad_full.zero_()

    @hookimpl
    def zkernel_fetch_params(self, group, phase, boundary):
        if phase is Phase.STEP:
            group.layout.finish()

    @hookimpl
    def zkernel_memory_tensors(self, group):
        return memory_of(group)


@hookimpl
def zkernel_register_partitioners(registry) -> None:
    registry.add(
        "zero1",
        Zero1,
        description="ZeRO-1: optimizer state and fp32 masters partitioned across ranks",
        options_cls=BucketOptions,
    )
