"""Partitioner ``zero2``: optimizer state, masters and gradients partitioned across ranks.

Algorithm. As ZeRO-1 (whole parameters, flat buckets, each rank owning a 1/N
slice), but no rank keeps whole gradients: as soon as the last gradient of a
bucket arrives in backward, the bucket's gradients are copied into a transient
fp32 flat buffer and averaged by an asynchronous reduce-scatter; the
buffer is freed and the received slice added into the rank's fp32 gradient
shard when the next bucket is launched (or at the step), so reduction overlaps
backward with at most two buckets in flight. The gradient shard exists from
the first reduction of an accumulation window to the end of its step. Reduction happens on every
micro-batch, since whole gradients are not kept between micro-batches. The
optimizer updates the owned slice, and the slices are all-gathered back into
the whole parameters. With one rank nothing is communicated.
"""

from __future__ import annotations

import torch

from zkernel import hookimpl
from zkernel.groups import Phase

from ._flat import all_gather_flat, gather_grads, reduce_scatter_mean
from ._whole import BucketOptions, build_whole_groups, memory_of


def launch_grad_reduction(group, world: int, in_flight: list) -> None:
    """Reduce-scatter ``group``'s gradients into its fp32 shard (shared with ZeRO-3).

    The shard is allocated by the first reduction of an accumulation window
    and freed after the step (as ``zero_grad(set_to_none=True)`` would), so it
    does not exist during the forward of the next window's first micro-batch.
    """
    state = group.layout
    device = group.master.device
    grad_full = torch.empty(state.flat.padded, dtype=torch.float32, device=device)
    gather_grads(group.params, state.flat, grad_full, accumulate=False)
    if world == 1:
        if state.grad_shard is None:
            state.grad_shard = grad_full
        else:
            state.grad_shard.add_(grad_full)
        group.grad = state.grad_shard
        return
    first = state.grad_shard is None
    received = torch.empty(state.flat.shard_size, dtype=torch.float32, device=device)
    state.work.append(reduce_scatter_mean(received, grad_full, async_op=True))
    if first:
        state.grad_shard = received
        group.grad = received
        state.pending.append(lambda: grad_full)  # keep the input alive until the collective is done
    else:
        state.pending.append(lambda: (state.grad_shard.add_(received), grad_full))
    while in_flight:
        in_flight.pop().finish()
    in_flight.append(state)


def take_grad_shard(group) -> None:
    """Before the step: a group that got no gradient in the window steps on zeros."""
    state = group.layout
    if state.grad_shard is None:
        state.grad_shard = torch.zeros(state.flat.shard_size, dtype=torch.float32, device=group.master.device)
    group.grad = state.grad_shard


def drop_grad_shard(group) -> None:
    """After the step: free the gradient shard."""
    group.layout.grad_shard = None
    group.grad = None


class Zero2:
    """Sharded optimizer state, masters and gradients; whole parameters."""

    def __init__(self, context) -> None:
        self.context = context
        self.options = context.options or BucketOptions()
        self.in_flight: list = []

    @hookimpl
    def zkernel_partition_params(self, module, context):
        world = context.world_size
        return build_whole_groups(module, context, shards=world, bucket_numel=self.options.bucket_size)

    @hookimpl
    def zkernel_release_params(self, group, phase, boundary):
        state = group.layout
        world = self.context.world_size
        if phase is Phase.GRADIENTS:
            launch_grad_reduction(group, world, self.in_flight)
        elif phase is Phase.STEP:
            if world > 1:
                all_gather_flat(state.full, state.full[state.flat.own])
            drop_grad_shard(group)

    @hookimpl
    def zkernel_fetch_params(self, group, phase, boundary):
        if phase is Phase.STEP:
            group.layout.finish()
            self.in_flight.clear()
            take_grad_shard(group)

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
