"""Thin wrappers over `torch.distributed`: set-up from torchrun's environment, world-size-1 fallback."""

from __future__ import annotations

import datetime
import os

import attrs
import torch
import torch.distributed as dist

from zkernel.telemetry.log import get_logger

log = get_logger()


@attrs.frozen
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None when no process group is used (world size 1)
    # Whether zkernel created the process group (then it also destroys it: `zkernel.kernel.lifecycle`).
    created_group: bool = False

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def every_rank(ok: bool, device: torch.device) -> bool:
    """Whether ``ok`` holds on every rank of the default group (collective: every rank must call
    it; ``device`` is where the backend reduces, the GPU on NCCL)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _compute_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def local_world_size(info: DistInfo) -> int:
    """Ranks on this machine (they share its host memory and disks)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))


def expected_world_size() -> int:
    """The world size `init_distributed` gives (or gave): the process group's, else torchrun's
    ``WORLD_SIZE``, else 1 (one process without torchrun)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(timeout_s: float = 600.0) -> DistInfo:
    """Join the process group torchrun describes, or run alone.

    An existing process group is reused. Without ``WORLD_SIZE`` (or with 1) and
    no process group, the process is world size 1 and no group is created.
    NCCL is used when CUDA is present, gloo otherwise.
    """
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        return DistInfo(rank, world, local_rank, _compute_device(local_rank), dist.get_backend())
    world = expected_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _compute_device(local_rank)
    if world == 1:
        return DistInfo(0, 1, local_rank, device, None)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"backend": backend, "timeout": datetime.timedelta(seconds=timeout_s)}
    if backend == "nccl":
        kwargs["device_id"] = device
    dist.init_process_group(**kwargs)
    info = DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, backend, created_group=True)
    log.debug("zkernel.dist.init", rank=info.rank, world_size=info.world_size, backend=backend)
    return info

