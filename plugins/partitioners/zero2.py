"""Partitioner ``zero2``: optimizer state, masters and gradients partitioned across ranks.

Algorithm. As ZeRO-1 (whole parameters, flat buckets, each rank owning a 1/N
slice), but no rank keeps whole gradients: as soon as the last gradient of a
bucket arrives in backward, the bucket's gradients are copied into a transient
fp32 flat buffer, pre-divided by N and reduce-scattered asynchronously; the
buffer is freed and the received slice added into the rank's fp32 gradient
shard when the next bucket is launched (or at the step), so reduction overlaps
backward with at most two buckets in flight. Reduction happens on every
micro-batch, since whole gradients are not kept between micro-batches. The
optimizer updates the owned slice, and the slices are all-gathered back into
the whole parameters. With one rank nothing is communicated.
"""

from __future__ import annotations

import torch

from zkernel import hookimpl
from zkernel.groups import Phase

from ._flat import all_gather_flat, gather_grads, reduce_scatter_flat
from ._whole import BucketOptions, build_whole_groups, memory_of


def launch_grad_reduction(state, params, world: int, in_flight: list) -> None:
    """Reduce-scatter ``params``' gradients into ``state.grad_shard`` (shared with ZeRO-3)."""
    grad_full = torch.empty(state.flat.padded, dtype=state.grad_shard.dtype, device=state.grad_shard.device)
    gather_grads(params, state.flat, grad_full, accumulate=False)
    if world == 1:
        state.grad_shard.add_(grad_full)
        return
    grad_full.mul_(1.0 / world)
    received = torch.empty_like(state.grad_shard)
    state.work.append(reduce_scatter_flat(received, grad_full, async_op=True))
    # grad_full must stay alive until the collective is done.
    state.pending.append(lambda: (state.grad_shard.add_(received), grad_full))
    while in_flight:
        in_flight.pop().finish()
    in_flight.append(state)


class Zero2:
    """Sharded optimizer state, masters and gradients; whole parameters."""

    def __init__(self, context) -> None:
        self.context = context
        self.options = context.options or BucketOptions()
        self.in_flight: list = []

    @hookimpl
    def zkernel_partition_params(self, module, context):
        world = context.world_size
        groups = build_whole_groups(module, context, shards=world, bucket_numel=self.options.bucket_size)
        for group in groups:
            state = group.layout
            state.grad_shard = group.master.new_zeros(state.flat.shard_size)
            group.grad = state.grad_shard
        return groups

    @hookimpl
    def zkernel_release_params(self, group, phase, boundary):
        state = group.layout
        world = self.context.world_size
        if phase is Phase.GRADIENTS:
            launch_grad_reduction(state, group.params, world, self.in_flight)
        elif phase is Phase.STEP:
            if world > 1:
                all_gather_flat(state.full, state.full[state.flat.own])
            state.grad_shard.zero_()

    @hookimpl
    def zkernel_fetch_params(self, group, phase, boundary):
        if phase is Phase.STEP:
            group.layout.finish()
            self.in_flight.clear()

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
    )
