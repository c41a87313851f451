"""Reduce-scatters of ZeRO-3 gradients on the GPUs' copy engines, through peer memory.

[Note: peer reductions] An NCCL reduce-scatter is a kernel that holds
multiprocessors while it runs, and in a ZeRO-3 backward every one runs beside
the next unit's matrix multiplies, which then run up to about twice as long.
Starting ours at the same point as FSDP2's (a short kernel before the next
matmul) moved the cost instead of removing it (profiles: BENCHMARKS.md, "Figures formerly in docstrings").

So where gathers go through peer memory (`_peer_gather`), reductions do too,
all on a stream of their own, and none of it on a multiprocessor but one
short kernel:

1. the unit's gradients are copied flat, in the compute dtype, into one of two
   slots of a pool of symmetric memory (in place of the fp32 copy an NCCL
   reduce-scatter reads: two thirds of its bytes in bf16), one copy per
   gradient on the copy engines (`_flat.copy_grads_by_copy_engine`; the small
   ones in one kernel);
2. a barrier that holds no multiprocessor (every rank has filled its slot;
   `_stream_barrier`), then one copy per peer, on the copy engines, of the
   peer's slot over this rank's slice of the flat gradient (half the bytes of
   NCCL's fp32 in bf16);
3. one short kernel sums the ranks' slices in fp32, in rank order, and scales
   by 1/world into the fp32 gradient shard.

The copy into the slot runs on the copy engines, not as a kernel on the
compute stream, where it was a visible part of the step (BENCHMARKS.md, "Figures formerly in docstrings").

The sum is the one NCCL computes from fp32 inputs: the compute-dtype values
are exact in fp32 and, on two ranks, a + b is rounded once either way; on
more ranks the order is fixed by rank, which NCCL's ring does not promise.

A slot is written again only after every rank is past its copies out of it.
A rank reaches the barrier of reduction k only after its copies of reduction
k-1 (one stream, in order), so once this rank's stream is past that barrier,
the slot reduction k-1 read is free: the copy into it for reduction k+1
follows on the same stream, and two slots suffice without any event. The
compute stream never waits for a reduction but where the optimizer reads its
shard.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from zkernel.telemetry.log import get_logger
from zkernel.platform.streams import current_stream, record_event, use_stream
from zkernel.telemetry.timeline import SpanKind

from . import _peer_gather
from ._flat import FlatLayout, copy_grads_by_copy_engine
from ._stream_barrier import open_barrier

log = get_logger()

PEER_REDUCTION_POLICIES = ("auto", "never")
SLOTS = 2
BARRIER_CHANNEL = 1  # of the barrier kernel (the gathers' use 0), where stream memory operations cannot be used
BLOCK = 4096

_kernel = None


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def mean_of_ranks_kernel(
        out_ptr, own_ptr, peers_ptr, numel, scale, WORLD: tl.constexpr, RANK: tl.constexpr, BLOCK: tl.constexpr
    ):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < numel
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        for r in tl.static_range(WORLD):
            if r == RANK:
                total += tl.load(own_ptr + offsets, mask=mask).to(tl.float32)
            else:
                row = r if r < RANK else r - 1
                total += tl.load(peers_ptr + row * numel + offsets, mask=mask).to(tl.float32)
        tl.store(out_ptr + offsets, total * scale, mask=mask)

    return mean_of_ranks_kernel


def mean_of_ranks(out: torch.Tensor, own: torch.Tensor, peers: torch.Tensor, rank: int, world: int) -> None:
    """``out`` (fp32) = the mean over ranks, summed in rank order in fp32, of ``own`` (this rank's
    contribution) and the rows of ``peers`` (the other ranks', in rank order): one kernel on a GPU
    with Triton, torch's elementwise ops elsewhere (the same sums, in the same order)."""
    global _kernel
    # The kernel indexes a peer's row in 32 bits (row * numel); larger reductions take torch's path.
    if out.is_cuda and peers.numel() < 2**31 and _triton_available():
        if _kernel is None:
            _kernel = _build()
        grid = ((out.numel() + BLOCK - 1) // BLOCK,)
        _kernel[grid](out, own, peers, out.numel(), 1.0 / world, WORLD=world, RANK=rank, BLOCK=BLOCK)
        return
    rows = list(peers.unbind(0))
    rows.insert(rank, own)
    out.copy_(rows[0])
    for row in rows[1:]:
        out.add_(row)
    out.mul_(1.0 / world)


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class PeerReductions:
    """Slots of symmetric memory every rank's flat gradients pass through; reductions read peers' slots."""

    def __init__(self, slot_numel: int, dtype: torch.dtype, device: torch.device, timeline) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.world, self.rank, self.dtype, self.device = dist.get_world_size(), dist.get_rank(), dtype, device
        self.slot_numel, self.timeline = slot_numel, timeline
        self.pool = symm_mem.empty(SLOTS * slot_numel, dtype=dtype, device=device)
        self.handle = symm_mem.rendezvous(self.pool, dist.group.WORLD.group_name)
        _peer_gather.pool_bytes += self.pool.numel() * self.pool.element_size()
        self.stream = torch.cuda.Stream(device)
        self.barrier = open_barrier(self.handle, BARRIER_CHANNEL, device)
        # Every peer's pool (in rank order), mapped once: a reduction reads slices of them.
        self._peer_pools = [
            self.handle.get_buffer(peer, (SLOTS * slot_numel,), dtype, 0) for peer in range(self.world) if peer != self.rank
        ]
        self._next = 0
        log.info("zkernel.zero3.peer_reductions", pool_bytes=self.pool.numel() * self.pool.element_size())

    def reduce(self, params: Sequence[torch.nn.Parameter], flat: FlatLayout, label: str) -> tuple[torch.Tensor, torch.cuda.Event]:
        """Reduce-scatter the gradients of ``params`` (mean over ranks) into a new fp32 shard; returns it
        and the event after which it is complete (``wait()`` makes the current stream wait for it)."""
        index = self._next % SLOTS
        self._next += 1
        base = index * self.slot_numel
        slot = self.pool[base : base + flat.padded]
        shard = torch.empty(flat.shard_size, dtype=torch.float32, device=self.device)
        peers = torch.empty((self.world - 1, flat.shard_size), dtype=self.dtype, device=self.device)
        stream = self.stream
        stream.wait_stream(current_stream(self.device))
        nbytes = (self.world - 1) * flat.shard_size * slot.element_size()
        with use_stream(stream), self.timeline.span(SpanKind.COLLECTIVE, stream=stream, label=f"{label} reduce", nbytes=nbytes):
            # The slot was last read by the peers' copies two reductions back; every rank was past
            # them when it reached the previous reduction's barrier, which this stream has passed.
            grads = copy_grads_by_copy_engine(params, flat, slot)
            self.barrier(stream)
            start = base + flat.own.start
            for row, pool in enumerate(self._peer_pools):
                peers[row].copy_(pool[start : start + flat.shard_size])
            mean_of_ranks(shard, slot[flat.own], peers, self.rank, self.world)
        done = record_event(stream)
        # All were allocated in the compute stream's order and are read or written here: not handed
        # out again before this stream is done with them (see [Note: collective buffers on a side stream]).
        for tensor in (*grads, peers, shard):
            tensor.record_stream(stream)
        return shard, done

