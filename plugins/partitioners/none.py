"""Partitioner ``none``: plain data parallelism, every rank holds everything.

Algorithm. Parameters are flattened into buckets (``bucket_size`` elements,
reverse registration order). Gradients of a bucket are added into its fp32
flat gradient as soon as the bucket's last gradient arrives in backward; at an
accumulation boundary the bucket is averaged over ranks by an asynchronous
all-reduce and handed to the optimizer tier, so reduction of early buckets
overlaps the rest of backward. Every rank applies the same update to its whole
fp32 master, so nothing is published after the step. With one process there
is no collective at all. Off the boundary, gradients only accumulate locally
(like DDP's no_sync).
"""

from __future__ import annotations

from zkernel.spec import MATERIALIZES_META, hookimpl

from ._reduce import reduce_at_boundary
from ._footprint import WholeFootprint
from ._whole import BucketOptions, build_whole_groups, describe, memory_of, restore


class DataParallel:
    """Replicated parameters, gradients and optimizer state; bucketed all-reduce."""

    def __init__(self, context) -> None:
        self.context = context
        self.options = context.options or BucketOptions()

    @hookimpl
    def zkernel_partition_params(self, module, context):
        return build_whole_groups(module, context, shards=1, options=self.options)

    @hookimpl
    def zkernel_reduce_gradients(self, group, boundary):
        return reduce_at_boundary(group, self.context.world_size, boundary, scatter=False)

    @hookimpl
    def zkernel_restore_params(self, group, master):
        restore(group, master, self.context.device, world=1)

    @hookimpl
    def zkernel_describe_shard(self, group):
        return describe(group, replicated=True)

    # zkernel_restore_state: nothing to do; the parameters are views of the shard the tier refreshed.

    @hookimpl
    def zkernel_memory_tensors(self, group):
        return memory_of(group)


@hookimpl
def zkernel_register_partitioners(registry) -> None:
    registry.add(
        "none",
        DataParallel,
        description="plain data parallel: bucketed all-reduce of gradients, overlapping backward",
        options_cls=BucketOptions,
        capabilities=(MATERIALIZES_META,),
    )


@hookimpl
def zkernel_size_partition(name, module, world_size, options):
    if name != "none":
        return None
    return WholeFootprint(module, 1, options.bucket_size, accumulates_whole=True, divides=())
