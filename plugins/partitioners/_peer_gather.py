"""All-gathers of ZeRO-3 parameter shards on the GPUs' copy engines, through peer memory.

[Note: peer gathers] An NCCL all-gather is a kernel: while it runs it holds
streaming multiprocessors, and the matrix multiplies it overlaps with get
fewer of them, so they run markedly longer; beside the same gathers done as
peer copies, which the copy engines carry without any multiprocessor, they lose
far less (`bench/gather_contention.py`; BENCHMARKS.md, "Figures formerly in docstrings"). In ZeRO-3 every parameter is
gathered twice a step, under the forward's and the backward's matmuls.

So where every rank's GPU can map every other's memory (one host, CUDA peer
access), each rank keeps its compute-dtype shards of the gathered groups in
one pool of symmetric memory (`torch.distributed._symmetric_memory`: the same
allocation mapped into every rank's address space). The optimizer writes
each updated shard straight into the pool (it is the group's
``param_shard``), and a gather is, on a stream of its own: a barrier (every
rank has queued its update of this shard before arriving), then one copy per
rank from that rank's pool into the gathered buffer. The barrier holds no
multiprocessor (`_stream_barrier`, [Note: barriers off the multiprocessors]);
the copies run on the copy engines. The pool costs the shard in the
compute dtype (2 bytes per parameter and rank in bf16), which the NCCL path
avoids by casting the fp32 master at every gather; that cast (a kernel
reading 6 bytes per shard element, twice a step) is gone here too.

A peer gather costs more host time than an NCCL call (a barrier, one copy per
rank and an event, each queued from Python), and so does its reduction. It
pays where each unit brings enough GPU work to hide that; where units are small
the step is bound by the host and the extra time is lost. So with
``peer_gathers = "auto"`` the choice is made for the model: every gathered
group goes through the pool when the gathered shards average at least
`AUTO_MEAN_SHARD_BYTES` (the GPU work per unit of host work), else only the
groups whose shard is at least `AUTO_MIN_SHARD_BYTES`: a model of
transformer blocks a few GB large gains from the pool, one of a few hundred MB,
bound by the host, loses (the thresholds' measurements: BENCHMARKS.md, "Figures formerly in docstrings"). One unit per
block (tens of MB per shard) is in the pool either way.

Every rank issues the same gathers in the same order (the path check holds
them to it), so barriers pair up as collectives do. A peer reads a shard only
between the barrier of a gather and the end of its copies; the shard's owner
writes it only in its optimizer step, after the reduction of the same group
(an NCCL reduce-scatter, or a barrier of the peer reductions in `_peer_reduce`),
which no rank reaches before its own gathers of that group in the step are
done.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from zkernel.platform.distributed import every_rank
from zkernel.telemetry.log import get_logger
from zkernel.platform.streams import current_stream, record_event, use_stream
from zkernel.telemetry.timeline import SpanKind

from ._stream_barrier import open_barrier

log = get_logger()

PEER_GATHER_POLICIES = ("auto", "always", "never")
AUTO_MIN_SHARD_BYTES = 32 * 2**20
AUTO_MEAN_SHARD_BYTES = 4 * 2**20
BARRIER_CHANNEL = 0  # of the barrier kernel, where stream memory operations cannot be used


def pool_threshold(shard_bytes: Sequence[int], policy: str) -> float:
    """The smallest shard, in bytes of the compute dtype, that goes through the pool under
    ``policy``, given every gathered group's shard (see [Note: peer gathers]; the same on every rank)."""
    if policy == "always":
        return 0
    if policy == "never":
        return math.inf
    if shard_bytes and sum(shard_bytes) / len(shard_bytes) >= AUTO_MEAN_SHARD_BYTES:
        return 0
    return AUTO_MIN_SHARD_BYTES


# Bytes of symmetric memory the pools of this process hold: outside the caching allocator, so
# torch.cuda.memory_allocated() does not count them (benchmarks add them to its peak).
pool_bytes = 0


def peer_access_everywhere(device: torch.device) -> tuple[bool, str]:
    """Whether every rank can map every other rank's memory; the same answer on every rank
    (collective: every rank must call it). The second item says why not."""
    world = dist.get_world_size()
    reason = ""
    if int(os.environ.get("LOCAL_WORLD_SIZE", world)) != world:
        reason = "the ranks span several hosts"
    else:
        try:
            import torch.distributed._symmetric_memory  # noqa: F401
        except ImportError as exc:
            reason = f"this torch has no symmetric memory ({exc})"
    indices = torch.zeros(world, dtype=torch.int64, device=device)
    indices[dist.get_rank()] = device.index if device.index is not None else torch.cuda.current_device()
    dist.all_reduce(indices)
    if not reason:
        mine = int(indices[dist.get_rank()])
        blocked = [int(i) for i in indices.tolist() if int(i) != mine and not torch.cuda.can_device_access_peer(mine, int(i))]
        if blocked:
            reason = f"GPU {mine} cannot map the memory of GPU(s) {blocked}"
    if not every_rank(not reason, device) and not reason:
        reason = "another rank's GPU cannot map this one's memory"
    return not reason, reason


def open_pool(numel: int, dtype: torch.dtype, device: torch.device, required: bool, timeline) -> PeerGathers | None:
    """Map a pool of ``numel`` elements into every rank's memory (collective). Where that fails on
    any rank, every rank gathers with NCCL instead (a WARNING says why), or, when ``required``, raises."""
    import torch.distributed._symmetric_memory as symm_mem

    error = None
    try:
        pool = symm_mem.empty(max(numel, 1), dtype=dtype, device=device)
        handle = symm_mem.rendezvous(pool, dist.group.WORLD.group_name)
    except Exception as exc:  # noqa: BLE001 - reported below, after every rank has said how it went
        error, pool, handle = exc, None, None
    if every_rank(error is None, device):
        return PeerGathers(pool, handle, dtype, device, timeline)
    reason = f"zero3 could not map its parameter shards into every rank's memory ({error or 'it failed on another rank'})"
    if required:
        raise RuntimeError(f'{reason}; set partitioner_options.peer_gathers = "never" to gather them with NCCL instead')
    log.warning("zkernel.zero3.peer_gathers_unavailable", reason=reason, fallback="NCCL all-gathers")
    return None


class PeerGathers:
    """One pool of symmetric memory holding this rank's shards; gathers read every rank's pool."""

    def __init__(self, pool: torch.Tensor, handle, dtype: torch.dtype, device: torch.device, timeline) -> None:
        global pool_bytes
        self.world, self.rank, self.dtype, self.timeline = dist.get_world_size(), dist.get_rank(), dtype, timeline
        self.pool, self.handle = pool, handle
        pool_bytes += pool.numel() * pool.element_size()
        self.stream = torch.cuda.Stream(device)
        self.barrier = open_barrier(handle, BARRIER_CHANNEL, device)
        self._taken = 0
        # (offset, numel) -> [(destination, source)] per rank, for a group's own gathered buffer: views
        # made once (a view stays valid while the buffer's storage is freed and re-allocated).
        self._copies: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        log.info("zkernel.zero3.peer_gathers", pool_bytes=pool.numel() * pool.element_size())

    def take(self, numel: int) -> tuple[int, torch.Tensor]:
        """The next ``numel`` elements of the pool: their offset and a view (a group's shard)."""
        offset = self._taken
        if offset + numel > self.pool.numel():
            raise RuntimeError(f"peer-gather pool of {self.pool.numel()} elements has no room for {numel} more at {offset}")
        self._taken += numel
        return offset, self.pool[offset : offset + numel]

    def all_gather(self, full: torch.Tensor, offset: int, numel: int, reused: bool = False, label: str = ""):
        """Copy every rank's ``numel`` pool elements at ``offset`` into ``full`` (rank-major), after
        the work queued so far on the current stream; returns the event that ends the copies.
        ``reused``: ``full`` is the group's own buffer, gathered into again and again; ``label``
        names the gather in the timeline."""
        copies = self._copies.get((offset, numel)) if reused else None
        if copies is None or copies[0][0]._base is not full:
            copies = [
                (
                    full[peer * numel : (peer + 1) * numel],
                    self.pool[offset : offset + numel] if peer == self.rank else self.handle.get_buffer(peer, (numel,), self.dtype, offset),
                )
                for peer in (*range(self.rank + 1, self.world), *range(self.rank + 1))
            ]
            if reused:
                self._copies[(offset, numel)] = copies
        stream = self.stream
        stream.wait_stream(current_stream(full.device))
        nbytes = full.numel() * full.element_size()
        with use_stream(stream), self.timeline.span(SpanKind.COLLECTIVE, stream=stream, label=label, nbytes=nbytes):
            self.barrier(stream)
            for destination, source in copies:
                destination.copy_(source)
        return record_event(stream)
