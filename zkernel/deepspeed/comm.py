"""``deepspeed.comm``: the collectives a DeepSpeed script calls, over ``torch.distributed``.

A script imports it as DeepSpeed's (``import zkernel.deepspeed.comm as dist``, or
``from zkernel.deepspeed import comm as dist``) and calls ``dist.get_rank()``,
``dist.barrier()``, ``dist.all_reduce(t)``. With a process group (torchrun, after
`zkernel.deepspeed.init_distributed`) each call is ``torch.distributed``'s. Without
one (a single process, which zkernel runs without a group where DeepSpeed makes one
of size 1) each answers as a group of one would: rank 0 of 1, a barrier returns at
once, and a collective leaves its tensors as they are (a sum, mean or maximum over
one rank is the rank's own value); a group or a rank that cannot exist there is an
error.
"""

from __future__ import annotations

import os

import torch.distributed as _dist
from torch.distributed import ReduceOp

from zkernel.deepspeed.initialize import init_distributed

__all__ = [
    "ReduceOp",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "barrier",
    "broadcast",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_available",
    "is_initialized",
    "reduce",
]


def _alone() -> bool:
    return not (_dist.is_available() and _dist.is_initialized())


def _single_rank(what: str, rank: int | None = None, group=None) -> None:
    """Refuse what a group of one cannot do: another group, a rank other than 0."""
    if group is not None:
        raise ValueError(f"{what}: no process group is initialised (one process), so a group cannot be given")
    if rank not in (None, 0):
        raise ValueError(f"{what}: rank {rank} does not exist: one process, rank 0 of 1")


def is_available() -> bool:
    """Whether ``torch.distributed`` is built in (as DeepSpeed's ``comm.is_available``)."""
    return _dist.is_available()


def is_initialized() -> bool:
    """Whether a process group is initialised (False in a single process, which zkernel runs without one)."""
    return not _alone()


def get_rank(group=None) -> int:
    """This process's rank in ``group`` (the world by default); 0 without a process group."""
    if _alone():
        _single_rank("get_rank", group=group)
        return 0
    return _dist.get_rank(group)


def get_world_size(group=None) -> int:
    """The number of ranks in ``group`` (the world by default); 1 without a process group."""
    if _alone():
        _single_rank("get_world_size", group=group)
        return 1
    return _dist.get_world_size(group)


def get_local_rank() -> int:
    """The rank within this node, from ``LOCAL_RANK`` as the launcher sets it (0 where it is not set)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_global_rank(group=None, group_rank: int = 0) -> int:
    """The world rank of ``group``'s rank ``group_rank``."""
    if _alone():
        _single_rank("get_global_rank", group_rank, group)
        return 0
    if group is None:
        return group_rank
    return _dist.get_global_rank(group, group_rank)


def barrier(group=None, async_op: bool = False, device_ids=None):
    """Wait until every rank of ``group`` reaches it; returns at once without a process group."""
    if _alone():
        _single_rank("barrier", group=group)
        return None
    return _dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    """Reduce ``tensor`` in place over the ranks of ``group``; without a process group it stays as it is."""
    if _alone():
        _single_rank("all_reduce", group=group)
        return None
    return _dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def reduce(tensor, dst: int, op=ReduceOp.SUM, group=None, async_op: bool = False):
    """Reduce ``tensor`` onto rank ``dst``; without a process group it stays as it is."""
    if _alone():
        _single_rank("reduce", dst, group)
        return None
    return _dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def broadcast(tensor, src: int, group=None, async_op: bool = False):
    """Give every rank ``src``'s ``tensor``; without a process group it stays as it is."""
    if _alone():
        _single_rank("broadcast", src, group)
        return None
    return _dist.broadcast(tensor, src, group=group, async_op=async_op)


def all_gather(tensor_list, tensor, group=None, async_op: bool = False):
    """Every rank's ``tensor`` into ``tensor_list`` (one entry per rank)."""
    if _alone():
        _single_rank("all_gather", group=group)
        if len(tensor_list) != 1:
            raise ValueError(f"all_gather: tensor_list has {len(tensor_list)} entries for 1 rank")
        tensor_list[0].copy_(tensor)
        return None
    return _dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op: bool = False):
    """Every rank's ``input_tensor``, concatenated into ``output_tensor``."""
    if _alone():
        _single_rank("all_gather_into_tensor", group=group)
        output_tensor.copy_(input_tensor.reshape(output_tensor.shape))
        return None
    return _dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
