"""Tier ``nvme``, optimizer role: the swap files fp32 masters and optimizer state live in, streamed through the step.

Algorithm (ZeRO-Infinity's optimizer swapping). `OptimizerSwap` is the part
of `NvmeTier` (``nvme``) that keeps a trainable group's fp32 master and
declared optimizer state in one swap file of the engine's run directory (see
[Note: run directories]), laid out as the image of a host block:
``[master | state 1 | state 2 | ...]``, each tensor on O_DIRECT alignment.
Gradients land as in the ``cpu`` tier (the tier's `HostLanding`). Between
steps nothing of the master and state is in memory. The step pipeline tells
the tier the groups it will step, in order (`prepare`); they stream through a
bounded pool of page-locked blocks (`PinnedArena`, ``buffer_bytes``):

* `prepare` queues the group; as soon as the pool has room for its whole file
  image, its extents are read (``sub_group_size`` elements per request, each
  checked against the CRC32C of its last write, [Note: swap-file integrity]).
  Groups get room strictly in the order they will step, so the reads of the
  next groups are in flight while the host worker steps this one;
* `acquire` (host worker) waits for the group's reads only, then points
  ``group.master`` and ``group.optim_state`` at the block;
* `release` (right after the optimizer) starts writing the block back (each
  extent's CRC32C computed by the I/O threads as they write) and returns at
  once; the block goes back to the pool when its writes are done, and the
  next queued group's reads start in its room;
* `release` also queues the group again, behind every group wanted for this
  step, for the *next* step's read ([Note: read-ahead]): once this step's
  groups have room, the pool's room, idle until the next step otherwise,
  fills with the next step's first groups while forward and backward run.

So disk reads of later groups, the Adam step of this one and the writes of
earlier ones overlap, the first reads of the next step overlap its forward
and backward, and the pool bounds the host memory the optimizer state takes,
however large the model. Nothing waits on a device-wide
synchronise; the only host waits are a group's own reads (in `acquire`).
Rounded updates go through the tier's staging pool (`HostUpdates`, lent at
`acquire`, given back at `release`) or into a block the params tier lends.

Outside a step, `read_master` / `read_state` (close, state dicts,
checkpoints) read the newest image (the group's block while it has one, the
rescue copy, else the file, checked as every read), and `write_state` (a
checkpoint load) writes a new image once the group's I/O has drained.

[Note: write failures] A write can fail (disk full, an I/O error). The
state then stays consistent: an extent's CRC32C is recorded only when its
write completed, a failed extent is marked unreadable, and the group's block
is copied to plain host memory (the *rescue copy*) before it returns to the
pool, so the newest master and state of every group are always either in its
file (all extents written and checksummed) or in memory, never lost and never
read back half-written. The step during which the write failed completes for
every group (a write failure of one group does not stop another's step, and
no `prepare` raises); the error, naming the file and offset, is taken by the
step pipeline at the end of the next boundary backward (`take_write_failures`),
which then takes that step on no group and no rank and raises it from
`Engine.step` on every rank ([Note: a step is all-or-nothing] in
`zkernel.kernel.step_outcome`): every group has been stepped the same number
of times. The next step of that group starts from its
rescue copy and writes it again, so once the disk has room training can go
on; `read_master` (and so `Engine.close`, which gives the model back) reads
the rescue copy. `close` removes the files and does not raise a failure that
was only logged by then.

[Note: the disk phase's order] Where the disk sits in a step with
clipping (the 15.4 B run of issue 46: zero3, micro-batch 8 x 24, clipping 1.0,
34 GB of state in 36 files). The groups on disk are the last layers
in module order ([Note: spill] in ``nvme``). Their gradients are final first
in the last micro-batch's backward, but with clipping the step's coefficient
is known only when backward ends, and this tier takes no speculative step
([Note: no speculation on disk]), so nothing of theirs is stepped or written
during backward. At `Engine.step` the pipeline prepares every host group in
the next forward's order: the host-memory groups first (stepped at once), then
the disk groups, whose reads start as the pool has room. Per disk group, in
that order: read (as soon as room frees), Adam on the host worker, release
(its writes start), its room back when they end, the next group's read in it.
The next forward waits for the first disk layer's update after about three
quarters of one micro-batch's forward, so every read, step and write of the
disk groups but the last writes is on the critical path, between the end of
backward and that wait; only what the pool read ahead ([Note: read-ahead]) is
off it. With a pool of two groups (the default: twice the largest file image)
the read of group i+2 waits for the writes of group i, so reads and writes
take turns; a pool of four lets reads stream beside the writes, but measured
on that run the phase is no shorter (about 36 s of an 85-92 s step either way):
the disk moves about 2.0 GB/s of reads and writes together however they are
ordered, and the larger pool's host memory puts as much more state on disk.
So this phase is bound by the bytes on disk and the disk's combined rate, not
by the pool (the numbers, and what would shorten it: BENCHMARKS.md, issue 46).

[Note: read-ahead] A group's state does not change between its release and
its next step (only a checkpoint load, `write_state`, replaces it, and drops
any copy in memory first). So `release` queues the group again for its next
step at once, as *not wanted* (``_SwapSlot.wanted`` False): queued groups get
room in queue order, and a group prepared or acquired for the step being
taken (*wanted*) is queued ahead of every unwanted one, so a read-ahead never
delays this step's own reads. A wanted group at the head of the queue that
finds no room evicts read-ahead blocks already resident (the last read
first; each goes back to the queue's end and is read again later), so a
step whose order differs from the last one (another landing order, groups
without gradients) cannot wait on room held for groups it steps later. A
step not taken (`end_window` of a wanted group not stepped) leaves a group
read, or being read, resident as a read-ahead: its state is still the file's.
A written-back block is the newest image too: it stays in the pool
as its group's next read until the room is needed by a group queued before
it (the block of the group queued last goes first), so where the pool holds
every group no read is issued at all after the first step.
The payoff is the pool's size: that much of the next step's reads moves off
the critical path into forward and backward, with no memory the pool did not
already hold; the rest of the disk phase stays exposed while the disk groups'
steps wait for the end of backward (what remains is bounded in BENCHMARKS.md,
issue 46). A rescue copy ([Note: write failures]) is read ahead like a file.

[Note: block reuse] A block may still be read after `release`: by its own
writes, and, in fp32 runs where the master itself is the update
(``copy_out`` None), by the params tier's `commit`, which runs right after
`release` on the same thread and may copy it to the parameter shard on a side
stream. Such a block is *fenced*: it goes back to the pool only once its
writes completed and the host worker has moved on (its next `acquire`, or
`close` once it is idle), with CUDA after an event recorded on
the side streams at that point has completed.
"""

from __future__ import annotations

import collections
import enum
import threading
import weakref
from concurrent.futures import Future

import attrs
import torch

from zkernel.platform.aio import aligned_empty
from zkernel.platform.split_master import tie_bytes
from zkernel.spec.config import ConfigError
from zkernel.spec.tiers import ShardState, StoredBytes
from zkernel.telemetry.timeline import SpanKind

from ._arena import Block, PinnedArena, aligned
from ._nvme_options import NvmeTierOptions
from ._progress import Preallocation
from ._split_master import Halves
from ._swap_file import Extent, SwapFile, extents_of
from ._swap_traffic import SwapTraffic

# Pool size when ``buffer_bytes`` is not given: this, or two of the largest group's file image,
# whichever is more, but never more than all files together.
DEFAULT_BUFFER_BYTES = 2 << 30


class _State(enum.Enum):
    ON_DISK = "on disk"  # the file (or the rescue copy) holds the newest state; no block
    QUEUED = "queued"  # waits for room in the pool (wanted, or a read-ahead), or holds its written-back block
    READING = "reading"
    RESIDENT = "resident"  # read and verified (or its written-back block kept), not acquired yet
    STEPPING = "stepping"  # acquired: the optimizer works on the block
    WRITING = "writing"  # released: writes in flight from the block


@attrs.define(eq=False)
class _Segment:
    name: str  # "master" (or "master_low" and "master_ties", split), or a declared state's name
    offset: int  # in the file image
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


@attrs.define(eq=False)
class _SwapSlot:
    """One group's file, where its state is, and the I/O in flight for it."""

    group: weakref.ref
    name: str
    file: SwapFile
    segments: list[_Segment]
    state: _State = _State.ON_DISK
    block: Block | None = None
    pending: int = 0  # reads or writes of the block still in flight
    error: BaseException | None = None  # a read's failure, raised by `acquire`
    write_error: BaseException | None = None
    zeros: list[Extent] = attrs.field(factory=list)  # extents to fill with zeros at `acquire`
    rescue: torch.Tensor | None = None  # the newest file image, when its last write failed
    fenced: bool = True  # see [Note: block reuse]
    wanted: bool = False  # prepared or acquired for the step being taken; else a read-ahead ([Note: read-ahead])
    read_seq: int = 0  # when its current block's read started (evictions take the newest read-ahead first)
    split: bool = False  # its file holds the master's low half and tie bits ([Note: split masters in the tiers])

    @property
    def footprint(self) -> int:
        return self.file.nbytes


class OptimizerSwap:
    """Masters and optimizer state of the groups on disk, streamed through a bounded pinned pool for each step.

    Threads: `plan` and `adopt` on the main thread at `initialize`; `prepare`
    on the main thread (autograd's for a step started during backward);
    `acquire`, `release` and `end_window` on the host worker; the read and
    write callbacks on the I/O queue's reaper; `read_master`, `read_state`,
    `write_state` and `close` on the main thread between steps. ``_cv`` guards
    every group's state, the queue and the pool.
    """

    def __init__(self, options: NvmeTierOptions, traffic: SwapTraffic, streams, cuda: bool, split=None) -> None:
        self.split = split  # a `SplitMasters` that rebuilds split masters (its own halves unused here), or None
        self.nvme_options = options
        self.traffic = traffic
        self.io = traffic.io
        self.run_dir = traffic.run_dir
        self.streams = streams
        self.cuda = cuda
        self._cv = threading.Condition(threading.RLock())
        self._swap: dict[int, _SwapSlot] = {}
        self._queue: collections.deque[_SwapSlot] = collections.deque()
        self._arena: PinnedArena | None = None
        self._layout = Preallocation("optimizer state")
        self._reads_started = 0
        self._closing = False  # no read-ahead once `close` began
        self.evictions = 0  # read-ahead blocks given back to a wanted group ([Note: read-ahead])

    def _pin(self) -> bool | None:
        return self.nvme_options.pin_memory

    # -- placement ------------------------------------------------------------------------------

    def plan(self, nbytes: int) -> None:
        """The bytes of swap files `adopt` will lay out (from the tier's `demand`)."""
        self._layout.plan(nbytes)

    def holds(self, group) -> bool:
        return group.index in self._swap

    def numel(self) -> int:
        """Master elements on disk."""
        return sum(s.segments[0].numel for s in self._swap.values())

    def split_numel(self) -> int:
        """Master elements whose files hold them split."""
        return sum(s.segments[0].numel for s in self._swap.values() if s.split)

    def nbytes(self) -> int:
        """Bytes of every swap file."""
        return sum(s.footprint for s in self._swap.values())

    def adopt(self, group, master, state, split: bool = False):
        """Lay out ``group``'s file and write the initial ``master`` (the state starts as zeros), whole or,
        with ``split``, as its low half and tie bits; ``group.master`` and ``group.optim_state`` are then
        empty until the group steps."""
        numel = master.numel()
        segments, offset = [], 0
        masters = (("master_low", torch.int16, (numel,)), ("master_ties", torch.uint8, (tie_bytes(numel),))) if split \
            else (("master", torch.float32, (numel,)),)
        for name, dtype, shape in (*masters, *((s.name, s.dtype, s.shape) for s in state)):
            segment = _Segment(name, offset, dtype, tuple(shape))
            segments.append(segment)
            offset += aligned(segment.nbytes)
        extent_bytes = self.nvme_options.sub_group_size * 4
        file = SwapFile(
            self.run_dir.file(f"optimizer-{group.index:05d}.swap"),
            offset,
            extents_of([(s.offset, s.nbytes) for s in segments], extent_bytes),
        )
        self._check_pool_fits(group, file.nbytes)
        file.preallocate(f"the optimizer state of group {group.name!r}")
        slot = _SwapSlot(weakref.ref(group), group.name, file, segments, split=split)
        self._swap[group.index] = slot
        if split:
            self.split.expect(numel)
        self._write_master(slot, master)
        self._layout.advance(file.nbytes)
        group.master = None  # in memory only while the group steps
        group.optim_state = {}

    def _check_pool_fits(self, group, nbytes: int) -> None:
        limit = self.nvme_options.buffer_bytes
        if limit is not None and nbytes > limit:
            raise ConfigError(
                f"offload.optimizer_options.buffer_bytes = {limit} cannot hold group {group.name!r}: its master "
                f"and optimizer state take {nbytes} bytes; raise buffer_bytes to at least {nbytes} (two or more "
                "groups' worth lets reads, the step and writes overlap), or make groups smaller "
                "(partitioner_options.bucket_size, or zero3)"
            )

    def _write_master(self, slot: _SwapSlot, master: torch.Tensor) -> None:
        """Write the initial master into the file (the state extents stay unwritten: zeros)."""
        masters = slot.segments[:2] if slot.split else slot.segments[:1]
        end = masters[-1].offset + masters[-1].nbytes
        image = aligned_empty(aligned(end), torch.uint8, pin=False)
        image.zero_()
        if slot.split:
            group = slot.group()
            self.split.write(group, master, self._halves(slot, image))  # (and rounds it into the shard)
        else:
            image[: masters[0].nbytes].view(torch.float32).copy_(master.detach().reshape(-1))
        try:
            slot.file.write_now(self.io, image, kind=SpanKind.NVME_WRITE, label=slot.name, only=(0, image.numel()))
        except OSError as error:
            error.add_note(f"writing the initial master of group {slot.name!r} to its swap file")
            raise

    @staticmethod
    def _halves(slot: _SwapSlot, image: torch.Tensor) -> Halves:
        """The split master's parts as views of ``image`` (a block's data or a file image)."""
        low, ties = slot.segments[0], slot.segments[1]
        return Halves(image[low.offset : low.offset + low.nbytes].view(torch.int16),
                      image[ties.offset : ties.offset + ties.nbytes], low.numel)

    def _pool(self) -> PinnedArena:
        if self._arena is None:
            footprints = [s.footprint for s in self._swap.values()]
            size = self.nvme_options.buffer_bytes or min(
                sum(footprints), max(DEFAULT_BUFFER_BYTES, 2 * max(footprints, default=0))
            )
            self._arena = PinnedArena(size, pin=self._pin(), name="optimizer")
        return self._arena

    # -- the step: prepare (main/autograd thread), acquire and release (host worker) -------------

    def finish_layout(self) -> None:
        """Every file is laid out (ends the progress bar); idempotent."""
        self._layout.finish()

    def prepare(self, group):
        """Queue ``group`` for a block and start its reads as soon as the pool has room."""
        with self._cv:
            self._pool()  # pinned here, on a thread bound to the device, not on the I/O reaper
            self._want(self._swap[group.index])
            self._pump()

    def _want(self, slot: _SwapSlot) -> None:
        """Mark ``slot`` wanted for the step being taken and queue it, behind the groups wanted before it
        and ahead of every read-ahead, unless it has (or is getting) a block ([Note: read-ahead]; ``_cv`` held)."""
        if slot.state is _State.STEPPING:
            return
        if slot.wanted and (slot in self._queue or slot.state in (_State.READING, _State.RESIDENT)):
            return
        slot.wanted = True
        if slot.state in (_State.READING, _State.RESIDENT):
            return
        if slot in self._queue:
            self._queue.remove(slot)
        position = next((i for i, s in enumerate(self._queue) if not s.wanted), len(self._queue))
        self._queue.insert(position, slot)
        if slot.state is _State.ON_DISK:
            slot.state = _State.QUEUED

    def _read_ahead(self, slot: _SwapSlot) -> None:
        """Queue ``slot`` (just released, or evicted) for its next step's read, at the queue's end
        ([Note: read-ahead]; ``_cv`` held)."""
        slot.wanted = False
        if self._closing or slot in self._queue:
            return
        self._queue.append(slot)
        if slot.state is _State.ON_DISK:
            slot.state = _State.QUEUED

    def _pump(self) -> None:
        """Give queued groups room in the pool, in queue order, and start their reads (``_cv`` held)."""
        while self._queue:
            slot = self._queue[0]
            if slot.state is _State.WRITING:
                return  # its previous writes are not done: its file is not current yet
            if slot.block is not None:  # written back, its block kept: the newest image already in memory
                self._queue.popleft()
                self._resident_again(slot)
                continue
            block = self._pool().allocate(slot.footprint)
            if block is None:
                if self._make_room(slot):
                    continue
                return
            self._queue.popleft()
            self._start_read(slot, block)

    def _resident_again(self, slot: _SwapSlot) -> None:
        """``slot``'s written-back block (still the newest file image) serves as its next read (``_cv`` held)."""
        slot.state, slot.error, slot.zeros = _State.RESIDENT, None, []
        self._reads_started += 1
        slot.read_seq = self._reads_started
        self._cv.notify_all()

    def _make_room(self, head: _SwapSlot) -> bool:
        """Free one block for ``head``, the queue's head, when the pool has no room for it
        ([Note: read-ahead]; ``_cv`` held): the block kept by the group queued last behind it (needed
        after it), else, for a wanted head, the newest read-ahead read. False when there is none."""
        for slot in reversed(self._queue):
            if slot is not head and slot.state is _State.QUEUED and slot.block is not None and slot.fenced:
                self._free_block(slot)
                return True
        if not head.wanted:
            return False
        ahead = [s for s in self._swap.values()
                 if s.state is _State.RESIDENT and not s.wanted and s.block is not None and s.fenced]
        if not ahead:
            return False
        slot = max(ahead, key=lambda s: s.read_seq)
        self.evictions += 1
        self._free_block(slot)
        slot.state = _State.ON_DISK
        self._read_ahead(slot)
        return True

    def _start_read(self, slot: _SwapSlot, block: Block) -> None:
        slot.block, slot.state, slot.error = block, _State.READING, None
        self._reads_started += 1
        slot.read_seq = self._reads_started
        if slot.rescue is not None:  # [Note: write failures]: the newest state is in memory
            slot.zeros = []
            block.data[: slot.footprint].copy_(slot.rescue)
            self._read_done(slot)
            return
        indices, slot.zeros = slot.file.plan_read()
        slot.pending = len(indices)
        if not indices:
            self._read_done(slot)
            return
        for i in indices:
            slot.file.read(self.io, i, block.data, kind=SpanKind.NVME_READ, label=slot.name,
                           done=lambda f, slot=slot: self._on_read(slot, f))

    def _on_read(self, slot: _SwapSlot, future: Future) -> None:
        with self._cv:
            error = future.exception()
            if error is not None and slot.error is None:
                error.add_note(f"reading the optimizer state of group {slot.name!r} from its swap file")
                slot.error = error
            slot.pending -= 1
            if slot.pending == 0:
                self._read_done(slot)
                self._pump()  # a wanted group may wait for this read-ahead's room ([Note: read-ahead])

    def _read_done(self, slot: _SwapSlot) -> None:
        slot.state = _State.RESIDENT
        self._cv.notify_all()

    def acquire(self, group):
        """Wait for ``group``'s reads and point ``group.master`` and ``group.optim_state`` at its block."""
        with self._cv:
            slot = self._swap[group.index]
            if slot.state is _State.STEPPING:  # acquired again before its release (a step not taken)
                return
            self._fence()
            self._want(slot)
            self._pump()
            while slot.state is not _State.RESIDENT:  # (a rescue copy is resident as `_pump` returns)
                self._cv.wait()
                self._pump()
            if slot.error is not None:
                error, slot.error = slot.error, None
                self._free_block(slot)
                slot.state, slot.wanted = _State.ON_DISK, False
                self._pump()
                raise error
            slot.state = _State.STEPPING
            block, zeros = slot.block, slot.zeros
            slot.zeros = []
        for extent in zeros:  # a state never written yet: its zeros are made here, not read
            block.data[extent.offset : extent.offset + extent.nbytes].zero_()
        states = slot.segments[2:] if slot.split else slot.segments[1:]
        if slot.split:
            self.split.lend(group, self._halves(slot, block.data))
        else:
            group.master = block.view(torch.float32, 0, slot.segments[0].numel)
        group.optim_state = {s.name: block.view(s.dtype, s.offset, s.numel).view(s.shape) for s in states}

    def release(self, group):
        """Start writing ``group``'s block back (before the tier takes back the update's buffer)."""
        slot = self._swap[group.index]
        if slot.split:
            self.split.take_back(group, self._halves(slot, slot.block.data))
        with self._cv:
            slot.state = _State.WRITING
            # Without a low-precision copy the params tier's commit reads the master from the block.
            slot.fenced = group.copy_out is not None
            slot.write_error = None
            slot.pending = len(slot.file.extents)
            for i in range(len(slot.file.extents)):
                slot.file.write(self.io, i, slot.block.data, kind=SpanKind.NVME_WRITE, label=slot.name,
                                done=lambda f, slot=slot: self._on_write(slot, f))
            self._read_ahead(slot)  # read once its writes are done and it has room

    def _on_write(self, slot: _SwapSlot, future: Future) -> None:
        with self._cv:
            error = future.exception()
            if error is not None and slot.write_error is None:
                slot.write_error = error
            slot.pending -= 1
            if slot.pending:
                return
            if slot.write_error is not None:
                slot.rescue = slot.block.data[: slot.footprint].clone()  # [Note: write failures]
                self.traffic.write_failed(
                    slot.write_error, slot.name, slot.file.path,
                    f"writing the optimizer state of group {slot.name!r} to its swap file; the newest state is "
                    "kept in host memory and written again at the group's next step",
                )
            else:
                slot.rescue = None
            if slot in self._queue:
                slot.state = _State.QUEUED  # its block kept as its next read until the room is needed
            else:
                slot.state = _State.ON_DISK
                if slot.fenced:
                    self._free_block(slot)
            self._pump()
            self._cv.notify_all()

    def _fence(self) -> None:
        """Called where every `commit` so far has returned (the host worker's next `acquire`, or once the
        worker is idle): blocks that a commit may have read go back to the pool once their writes are
        done ([Note: block reuse]; ``_cv`` held)."""
        waiting = [s for s in self._swap.values() if not s.fenced]
        if not waiting:
            return
        if self.cuda:
            for stream in (self.streams.h2d, self.streams.d2h):
                if stream is not None:
                    event = torch.cuda.Event()
                    event.record(stream)
                    event.synchronize()
        for slot in waiting:
            slot.fenced = True
            if slot.state is _State.ON_DISK:  # (a queued or resident block is its next read: [Note: read-ahead])
                self._free_block(slot)
        self._pump()
        self._cv.notify_all()

    def _free_block(self, slot: _SwapSlot) -> None:
        if slot.block is not None:
            self._arena.free(slot.block)
            slot.block = None
        group = slot.group()
        if group is not None:
            if slot.split:
                self.split.forget(group)  # a lent master of a step not taken
            group.master = None
            group.optim_state = {}

    def end_window(self, group):
        with self._cv:
            slot = self._swap.get(group.index)
            if slot is None:
                return
            if not slot.wanted:
                return  # released (or never prepared): a read-ahead for the next step stays
            # Prepared but not stepped (a skipped step): what is read, or being read, is the file's
            # state still and stays as a read-ahead; an acquired block may have been written to.
            if slot.state is _State.STEPPING:
                self._free_block(slot)
                slot.state = _State.ON_DISK
                self._read_ahead(slot)
            elif slot in self._queue:  # (QUEUED, or its writes not done): behind the wanted groups again
                self._queue.remove(slot)
                self._read_ahead(slot)
            slot.wanted = False
            self._pump()

    # -- reading and replacing state outside a step (close, state dicts, checkpoints) -------------

    def _current_image(self, slot: _SwapSlot, nbytes: int) -> torch.Tensor:
        """A copy of the first ``nbytes`` of ``slot``'s newest file image: from its block while it has
        one (resident, or written back and not returned yet), its rescue copy, or the file."""
        image = aligned_empty(aligned(nbytes), torch.uint8, pin=False)
        with self._cv:
            while slot.state is _State.READING:
                self._cv.wait()
            if slot.block is not None:
                image[:nbytes].copy_(slot.block.data[:nbytes])
                return image
            if slot.rescue is not None:
                image[:nbytes].copy_(slot.rescue[:nbytes])
                return image
        try:
            slot.file.read_now(self.io, image, kind=SpanKind.NVME_READ, label=slot.name, only=(0, image.numel()))
        except (OSError, EOFError) as error:
            error.add_note(f"reading the optimizer state of group {slot.name!r} from its swap file")
            raise
        return image

    def read_master(self, group):
        slot = self._swap[group.index]
        if slot.split:
            ties = slot.segments[1]
            return self.split.read(group, self._halves(slot, self._current_image(slot, ties.offset + ties.nbytes)))
        master = slot.segments[0]
        return self._current_image(slot, master.nbytes)[: master.nbytes].view(torch.float32)

    def read_state(self, group):
        slot = self._swap[group.index]
        image = self._current_image(slot, slot.footprint)
        views = {s.name: image[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape) for s in slot.segments}
        if slot.split:
            del views["master_low"], views["master_ties"]
            return ShardState(master=self.split.read(group, self._halves(slot, image)), state=views)
        master = views.pop("master")
        return ShardState(master=master, state=views)

    def write_state(self, group, state):
        slot = self._swap[group.index]
        declared = [s.name for s in (slot.segments[2:] if slot.split else slot.segments[1:])]
        missing = sorted(set(declared) - set(state.state))
        unknown = sorted(set(state.state) - set(declared))
        if missing or unknown:
            raise ValueError(
                f"optimizer state of group {slot.name!r}: the nvme tier keeps exactly the declared state "
                f"{declared}; missing {missing}, undeclared {unknown}"
            )
        with self._cv:
            if slot in self._queue:  # (a read-ahead, or prepared for a step that was not taken)
                self._queue.remove(slot)
            while slot.state in (_State.READING, _State.WRITING):  # no read or write of the old state in flight
                self._cv.wait()
            self._fence()
            self._free_block(slot)  # a read-ahead holds the old state
            slot.state, slot.wanted = _State.ON_DISK, False
            self._pump()
        image = aligned_empty(slot.footprint, torch.uint8, pin=False)
        image.zero_()
        if slot.split:
            self.split.write(group, state.master, self._halves(slot, image))  # (and rounds it into the shard)
        for segment in slot.segments:
            if segment.name in ("master_low", "master_ties"):
                continue
            source = state.master if segment.name == "master" else state.state[segment.name]
            image[segment.offset : segment.offset + segment.nbytes].view(segment.dtype).copy_(source.reshape(-1))
        try:
            slot.file.write_now(self.io, image, kind=SpanKind.NVME_WRITE, label=slot.name)
        except OSError as error:
            slot.rescue = image  # [Note: write failures]: the loaded state stays in memory
            error.add_note(f"writing the loaded optimizer state of group {slot.name!r} to its swap file")
            raise
        slot.rescue = None

    def evict(self, group) -> ShardState:
        """``group``'s newest master and state, read into host memory, and the group off the disk from
        now on (its file stays until `close`). Main thread, between steps, once every write of the
        last step is done (`NvmeTier.rebalance`, which moves it to the GPU share)."""
        self.io.wait_idle()
        with self._cv:
            self._fence()
        state = self.read_state(group)  # a copy of the newest image, not a pool block
        with self._cv:
            slot = self._swap.pop(group.index)
            if slot in self._queue:
                self._queue.remove(slot)
            if slot.block is not None:
                self._arena.free(slot.block)
                slot.block = None
            slot.rescue = None
            self._pump()
        return state

    # -- shutdown and accounting -----------------------------------------------------------------

    def close(self):
        """Wait for the I/O in flight, give every block back, then end the traffic (`SwapTraffic.close`)."""
        try:
            with self._cv:
                self._closing = True  # no read starts from here on
                for slot in self._queue:
                    if slot.state is _State.QUEUED:
                        slot.state = _State.ON_DISK
                self._queue.clear()
            self.io.wait_idle()
            with self._cv:
                self._fence()
                for slot in self._swap.values():
                    self._free_block(slot)
                    group = slot.group()
                    if group is not None:
                        group.copy_out = None
                        group.grad = None
                self._queue.clear()
        finally:
            self.traffic.close(self._arena)

    def read_ahead_bytes(self) -> int:
        """Bytes of file images read ahead for the next step and resident now ([Note: read-ahead])."""
        with self._cv:
            return sum(s.footprint for s in self._swap.values() if s.state is _State.RESIDENT and not s.wanted)

    def tensors(self, group) -> dict[str, list]:
        """The master and state of ``group`` on disk, under `zkernel_memory_tensors`'s categories."""
        slot = self._swap[group.index]
        path = str(slot.file.path)
        stored = {s.name: StoredBytes("nvme", (path, s.name), s.nbytes) for s in slot.segments}
        masters = ("master_low", "master_ties") if slot.split else ("master",)
        working = self.split.working() if slot.split else []  # the host buffers it is rebuilt in
        return {
            "master_weights": [*(stored[name] for name in masters), *working],
            "optimizer_state": [stored[s.name] for s in slot.segments if s.name not in masters],
        }
