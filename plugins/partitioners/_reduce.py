"""Gradient reduction shared by the partitioners: what each hands to the optimizer tier.

Two schedules (see each partitioner's docstring for why it uses which):

* `reduce_at_boundary` (none, ZeRO-1): gradients accumulate whole and locally in
  one fp32 buffer over the window; at the boundary it is averaged over ranks
  (all-reduce, or reduce-scatter to this rank's slice) and handed over once.
* `reduce_every_micro_batch` (ZeRO-2, ZeRO-3): each backward's gradients go
  into a transient fp32 buffer, reduce-scattered at once, and this rank's
  slice is handed over to be accumulated by the tier; no whole gradient
  outlives the backward of its bucket. ZeRO-3's groups gathered through peer
  memory are reduced through it too (`_peer_reduce`), without the fp32 buffer.

Both return a `ReducedGradient` whose collective runs asynchronously; the
buffers the collective reads travel with it (``keepalive``) until it is done.
"""

from __future__ import annotations

import torch

from zkernel.spec.groups import ParamGroup, ReducedGradient

from ._flat import all_reduce_mean, gather_grads, reduce_scatter_mean


def reduce_at_boundary(group: ParamGroup, world: int, boundary: bool, scatter: bool) -> ReducedGradient | None:
    """Accumulate into ``group.layout.grad_full``; at the boundary reduce it (``scatter``: to this rank's slice)."""
    state = group.layout
    fresh = state.grad_full is None
    if fresh:
        state.grad_full = torch.empty(state.flat.padded, dtype=torch.float32, device=group.params[0].device)
    gather_grads(group.params, state.flat, state.grad_full, accumulate=not fresh)
    if not boundary:
        return None
    grad_full, state.grad_full = state.grad_full, None
    if world == 1:
        return ReducedGradient(grad_full, None, accumulate=False)
    if not scatter:
        return ReducedGradient(grad_full, all_reduce_mean(grad_full, async_op=True), accumulate=False)
    shard = torch.empty(state.flat.shard_size, dtype=torch.float32, device=grad_full.device)
    work = reduce_scatter_mean(shard, grad_full, async_op=True)
    return ReducedGradient(shard, work, accumulate=False, keepalive=grad_full)


def reduce_every_micro_batch(group: ParamGroup, world: int, boundary: bool, peers=None) -> ReducedGradient:
    """Reduce-scatter this backward's gradients of ``group``; the tier accumulates the slices.
    ``peers``: the `PeerReductions` to reduce through instead of NCCL ([Note: peer reductions])."""
    state = group.layout
    accumulate = state.contributed
    state.contributed = not boundary
    if peers is not None:
        shard, done = peers.reduce(group.params, state.flat, group.name)
        return ReducedGradient(shard, done, accumulate=accumulate)
    with torch._C.DisableTorchFunctionSubclass():  # a released parameter's device, without its trap
        device = group.params[0].device
    grad_full = torch.empty(state.flat.padded, dtype=torch.float32, device=device)
    gather_grads(group.params, state.flat, grad_full, accumulate=False)
    if world == 1:
        return ReducedGradient(grad_full, None, accumulate=accumulate)
    shard = torch.empty(state.flat.shard_size, dtype=torch.float32, device=grad_full.device)
    work = reduce_scatter_mean(shard, grad_full, async_op=True)
    return ReducedGradient(shard, work, accumulate=accumulate, keepalive=grad_full)
