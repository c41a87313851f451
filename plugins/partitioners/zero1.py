"""Partitioner ``zero1``: optimizer state and fp32 masters partitioned across ranks.

Algorithm. Parameters stay whole on every rank, flattened into buckets, and
each rank owns one contiguous 1/N slice of every bucket. Gradients accumulate
whole and locally in an fp32 flat buffer over the micro-batches of an
accumulation window (no communication off the boundary); at the boundary each
bucket is averaged by an asynchronous reduce-scatter, so every rank hands only
the averaged gradient of its own slice to the optimizer tier. The optimizer
updates only that slice (state for 1/N of the model), and the updated slices
are all-gathered back into every rank's whole parameters. With one rank the
slice is the whole bucket and no collective runs.
"""

from __future__ import annotations

from zkernel.spec import MATERIALIZES_META, hookimpl

from ._reduce import reduce_at_boundary
from ._footprint import WholeFootprint
from ._whole import BucketOptions, build_whole_groups, describe, memory_of, publish, restore


class Zero1:
    """Sharded optimizer state and masters; whole parameters and gradients."""

    def __init__(self, context) -> None:
        self.context = context
        self.options = context.options or BucketOptions()

    @hookimpl
    def zkernel_partition_params(self, module, context):
        return build_whole_groups(module, context, shards=context.world_size, options=self.options)

    @hookimpl
    def zkernel_reduce_gradients(self, group, boundary):
        return reduce_at_boundary(group, self.context.world_size, boundary, scatter=True)

    @hookimpl
    def zkernel_publish_params(self, group):
        publish(group, self.context.world_size)

    @hookimpl
    def zkernel_restore_params(self, group, master):
        restore(group, master, self.context.device, self.context.world_size)

    @hookimpl
    def zkernel_describe_shard(self, group):
        return describe(group, replicated=False)

    @hookimpl
    def zkernel_restore_state(self, group):
        publish(group, self.context.world_size)

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
        capabilities=(MATERIALIZES_META,),
    )


@hookimpl
def zkernel_size_partition(name, module, world_size, options):
    if name != "zero1":
        return None
    return WholeFootprint(module, world_size, options.bucket_size, accumulates_whole=True, divides=("optimizer_state",))
