"""Partitioner ``none``: plain data parallelism, every rank holds everything.

Algorithm. Parameters are flattened into buckets (``bucket_size`` elements,
reverse registration order). Gradients of a bucket are added into its fp32
flat gradient as soon as the bucket's last gradient arrives in backward; at an
accumulation boundary the bucket is averaged over ranks by an asynchronous
all-reduce, so reduction of early buckets overlaps the rest of
backward. The step waits for the reductions, and every rank applies the same
update to its whole fp32 master. With one process there is no collective at
all. Off the boundary, gradients only accumulate locally (like DDP's no_sync).
"""

from __future__ import annotations

from zkernel import hookimpl
from zkernel.groups import Phase

from ._flat import all_reduce_mean, gather_grads
from ._whole import BucketOptions, build_whole_groups, memory_of


class DataParallel:
    """Replicated parameters, gradients and optimizer state; bucketed all-reduce."""

    def __init__(self, context) -> None:
        self.context = context
        self.options = context.options or BucketOptions()

    @hookimpl
    def zkernel_partition_params(self, module, context):
        groups = build_whole_groups(module, context, shards=1, bucket_numel=self.options.bucket_size)
        for group in groups:
            state = group.layout
            state.grad_full = state.full.new_zeros(state.flat.padded, dtype=group.master.dtype)
            group.grad = state.grad_full
        return groups

    @hookimpl
    def zkernel_release_params(self, group, phase, boundary):
        state = group.layout
        if phase is Phase.GRADIENTS:
            gather_grads(group.params, state.flat, state.grad_full, accumulate=True)
            world = self.context.world_size
            if boundary and world > 1:
                state.work.append(all_reduce_mean(state.grad_full, async_op=True))
        elif phase is Phase.STEP:
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
        "none",
        DataParallel,
        description="plain data parallel: bucketed all-reduce of gradients, overlapping backward",
        options_cls=BucketOptions,
    )
