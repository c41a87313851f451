"""Partitioner ``zero2``: optimizer state, masters and gradients partitioned across ranks.

Algorithm. As ZeRO-1 (whole parameters, flat buckets, each rank owning a 1/N
slice), but no rank keeps whole gradients: as soon as the last gradient of a
bucket arrives in backward, the bucket's gradients are copied into a transient
fp32 flat buffer and averaged by an asynchronous reduce-scatter, and the
received slice is handed to the optimizer tier, which accumulates the
window's slices (the transient buffer is freed once the collective is done).
Reduction happens on every micro-batch, since whole gradients are not kept
between micro-batches. The optimizer updates the owned slice, and the slices
are all-gathered back into the whole parameters. With one rank nothing is
communicated.
"""

from __future__ import annotations

from zkernel.spec import MATERIALIZES_META, hookimpl

from ._reduce import reduce_every_micro_batch
from ._footprint import WholeFootprint
from ._whole import BucketOptions, build_whole_groups, describe, memory_of, publish, restore


class Zero2:
    """Sharded optimizer state, masters and gradients; whole parameters."""

    def __init__(self, context) -> None:
        self.context = context
        self.options = context.options or BucketOptions()

    @hookimpl
    def zkernel_partition_params(self, module, context):
        return build_whole_groups(module, context, shards=context.world_size, options=self.options)

    @hookimpl
    def zkernel_reduce_gradients(self, group, boundary):
        return reduce_every_micro_batch(group, self.context.world_size, boundary)

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
        "zero2",
        Zero2,
        description="ZeRO-2: optimizer state, masters and gradients partitioned; bucketed reduce-scatter during backward",
        options_cls=BucketOptions,
        capabilities=(MATERIALIZES_META,),
    )


@hookimpl
def zkernel_size_partition(name, module, world_size, options):
    if name != "zero2":
        return None
    return WholeFootprint(module, world_size, options.bucket_size, accumulates_whole=False, divides=("optimizer_state", "grads"))
