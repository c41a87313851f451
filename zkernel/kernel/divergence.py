"""Ranks that run different modules: an error naming the module and the step, not a hang.

[Note: divergent ranks] Under ZeRO-3 every gather, and under every
partitioner every reduction, is a collective: every rank must issue them for
the same groups in the same order. A rank that takes another path (a
data-dependent branch that differs between ranks) issues another collective
at some point; two mismatched collectives hang (NCCL), abort the process from
a background thread (gloo: "Received data size doesn't match") or, with equal
sizes, "succeed" with another module's values. The scheduler cannot tell a
legitimate change of path (the same on every rank) from a divergent one
without asking the other ranks, so before each of these collectives every
rank states which group it is about to move, and what for, in a small
all-gather of its own (the same size on every rank, so it never mismatches
itself):

* gloo (CPU): the statement is read at once; at the first disagreement every
  rank raises `RankDivergenceError` naming, per rank, the module it was
  about to move, for what, and the micro-step, before any mismatched
  collective is issued.
* NCCL: reading it at once would synchronise the host with the GPU at every
  gather. Each statement goes instead from page-locked memory to a device ring
  (one asynchronous copy), is all-gathered into a second device ring, and the
  gathered row is copied back into a page-locked mirror, all on a stream of
  the check's own; no comparison runs on the device and the host never waits.
  [Note: statements off the compute stream] On the stream that issues the
  collective, each statement's all-gather made that stream wait for the
  process group's stream, and so for the reduce-scatter queued there just
  before: in backward the compute stream stalled for the previous unit's
  reduction at every prefetch, and the compute stream sat idle more than twice
  as long per step as FSDP2's. There the statement waits for nothing the model computes, and the process
  group still sees it before the collective it announces (one communicator
  runs its collectives in the order they are issued). A native thread (``zkernel._native.RingWatch``) reads
  the mirror every ``poll_s``: a statement that every rank has written (equal
  statement numbers) naming different groups, seen in two polls in a row (a
  poll may read a row that is still being written), is handed to a Python
  thread that logs it and ends the process (the mismatched collective behind
  it would hang until NCCL's own watchdog kills the job after
  ``collective_timeout``, with a message that names no module). The watcher
  needs neither the interpreter lock nor the CUDA driver: a rank hung in a
  collective may be holding the lock inside a blocking call (a Python watchdog
  that copied the ring itself never ran again once a rank hung), so if
  no Python thread has reported within ``grace_s`` the native thread writes the
  same message to stderr and ends the process itself. Cost per gather or
  reduction: two 32-byte copies and one 32-byte all-gather on the check's
  stream.

[Note: ranks a step apart] A rank that catches an exception from its forward
and goes on with the next batch runs one step fewer than the others: every
collective still pairs with one of the same group, a batch apart, until
`Engine.close`, whose gathers met the other rank's last reductions (gloo
aborted the process: "Received data size doesn't match"). So on gloo close
begins with a statement of its own (`PathCheck.before_close`): the rank still
training states its next reduction instead, both raise `RankDivergenceError`
naming what each was about to do, and neither engine issues another
collective; close then frees what its rank holds without one (see
`Engine.close`).

[Note: statements in shared memory] When every rank runs on one host, the
statements need no collective at all: rank 0 creates a file in ``/dev/shm``
that every rank maps (the ring's host rows, shared), each rank writes its own
column of the ring from the host as it issues a collective, and the same
native watcher reads every rank's statements from it. The file is unlinked
as soon as every rank has mapped it, so a job that dies leaves nothing
behind. The device ring cost each gather and reduction an NCCL call and
three CUDA operations from Python, a large share of the host's time in a
forward of small units, which the GPU then waited for. Where any rank cannot map the file (ranks on several hosts, no
``/dev/shm``: a file elsewhere could sit on a network file system, mapped on
several hosts whose writes never reach each other), every rank uses the
device ring.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from zkernel.platform import native
from zkernel.platform.distributed import every_rank
from zkernel.spec.groups import ParamGroup
from zkernel.telemetry.log import get_logger

log = get_logger()

# torch 2.13 renamed the flat all-gather (the old name warns); torch 2.11 has only the old one.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_KINDS = ("forward", "backward", "reduce", "user")


class RankDivergenceError(RuntimeError):
    """Ranks were about to move different groups in the same collective."""


class PathCheck:
    """Every rank states the group of its next collective; disagreement is an error (see the Note).

    ``deferred`` (default: on NCCL) selects the ring-and-watcher check; ``on_divergence``
    (default: end the process) receives the watcher's message. ``transport`` of a deferred
    check: "shared" (host shared memory, every rank on one host), "ring" (the device ring),
    "auto" (shared where every rank can map it, else the ring).
    """

    def __init__(
        self,
        groups: Sequence[ParamGroup],
        device: torch.device,
        enabled: bool,
        poll_s: float = 0.5,
        deferred: bool | None = None,
        on_divergence: Callable[[str], None] | None = None,
        grace_s: float = 2.0,
        transport: str = "auto",
    ) -> None:
        self.enabled = enabled and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self._names = {g.index: g.name for g in groups}
        self.count = 0
        self.micro_step = 0
        # The disagreement the synchronous check found (its message), or None: later collectives
        # of this engine would pair with other ranks' different ones, so `Engine.close` issues none.
        self.diverged: str | None = None
        if not self.enabled:
            return
        self.world = dist.get_world_size()
        self.deferred = dist.get_backend() == "nccl" if deferred is None else deferred
        if self.deferred:
            self._statements = _open_statements(self.world, device if dist.get_backend() == "nccl" else torch.device("cpu"), transport)
            self._on_divergence = on_divergence or _end_process
            self._report_lock = threading.Lock()
            self._reported = False
            self._closed = False
            count = max(self._names, default=-1) + 1
            self._watch = native.load().RingWatch(
                self._statements.host.data_ptr(), self._statements.host, _RING, self.world, poll_s=poll_s, grace_s=grace_s,
                clauses=[self._clause(index, kind) for index in range(count) for kind in range(len(_KINDS))],
                kinds=len(_KINDS), head=_HEAD, middle=_MIDDLE, tail=_TAIL,
            )
            self._reporter = threading.Thread(target=self._report_when_found, name="zkernel-paths", daemon=True)
            self._reporter.start()

    def before(self, group: ParamGroup, kind: str, micro_step: int) -> None:
        """Called by every rank right before it issues a collective for ``group`` (``kind``)."""
        if not self.enabled:
            return
        self.micro_step = micro_step
        statement = (self.count, group.index, _KINDS.index(kind), micro_step)
        self.count += 1
        if self.deferred:
            self._statements.state(statement)
            return
        self._compare(statement, micro_step)

    def before_close(self, micro_step: int) -> None:
        """Called by every rank as `Engine.close` begins, before its collectives ([Note: ranks a step apart]).

        On gloo every rank states that it closes; a rank still training (one step behind or ahead)
        states its next reduction or gather instead, and both raise `RankDivergenceError`. (With the
        deferred check, NCCL, nothing is stated: the watcher compares group statements only.)"""
        if not self.enabled or self.deferred or not dist.is_initialized():  # a group the script destroyed
            return
        statement = (self.count, _CLOSE, _CLOSE, micro_step)
        self.count += 1
        self._compare(statement, micro_step)

    def _compare(self, statement: tuple[int, int, int, int], micro_step: int) -> None:
        gathered = torch.empty(self.world * _COLS, dtype=torch.int64)
        _all_gather(gathered, torch.tensor(statement, dtype=torch.int64))
        rows = gathered.view(self.world, _COLS).tolist()
        if any(r[1:3] != rows[0][1:3] for r in rows):
            self.diverged = self._message(rows, micro_step)
            raise RankDivergenceError(self.diverged)

    def _clause(self, index: int, kind: int) -> str:
        if index == _CLOSE:
            return "close the engine (engine.close())"
        if index not in self._names or not 0 <= kind < len(_KINDS):
            return f"move group {index}"
        return f"{_verb(_KINDS[kind])} {self._names[index]!r}"

    def _message(self, rows: list[list[int]], micro_step: int) -> str:
        said = ", ".join(f"rank {r} was about to {self._clause(row[1], row[2])}" for r, row in enumerate(rows))
        return f"{_HEAD}{micro_step}{_MIDDLE}{said}{_TAIL}"

    def _report_when_found(self) -> None:
        found = self._watch.wait()
        if found is not None:
            self._report(found)

    def _report(self, found: tuple[int, int, list[list[int]]]) -> None:
        with self._report_lock:
            if self._reported:
                return
            self._reported = True
        _, micro_step, rows = found
        message = self._message(rows, micro_step)
        log.error("zkernel.ranks.diverged", message=message)
        self._watch.acknowledge()
        self._on_divergence(message)

    def close(self) -> None:
        """Stop the watcher after a last look at the ring: ranks that diverged into units of equal
        sizes get through their collectives, and a job that ends soon after must not end quietly."""
        if not (self.enabled and self.deferred) or self._closed:
            return
        self._closed = True
        if self._statements.settle(timeout_s=10.0, issued=self.count):
            found = self._watch.scan()
            if found is not None:
                self._report(found)
        self._watch.stop()
        if self._reporter is not threading.current_thread():
            self._reporter.join(timeout=5)


_RING = 1024  # statements the watcher can see
_CLOSE = -1  # group index and kind of the statement `before_close` makes
_COLS = 4  # statement number, group index, kind, micro-step (compared: group index and kind)
_HEAD = "ranks took different module paths in micro-step "
_MIDDLE = ": "
_TAIL = (
    ". Every rank must run the same modules in the same order (a data-dependent branch must take the same path "
    "on every rank; under a partitioner that gathers per module, modules only some ranks run, such as experts "
    "skipped when no token chose them, belong inside a unit every rank runs: make their parent one unit through "
    "partitioner_options; Hugging "
    "Face's generate needs synced_gpus=True where ranks may stop at different lengths)"
)


TRANSPORTS = ("auto", "shared", "ring")
_SHARED_FOLDER = "/dev/shm"


def _open_statements(world: int, device: torch.device, transport: str) -> _StatementRing | _SharedStatements:
    """The statements' transport (collective: every rank picks the same)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    if transport != "ring":
        shared = _SharedStatements.open(world, device)
        if shared is not None:
            return shared
        if transport == "shared":
            raise RuntimeError("the path check's statements cannot be shared in host memory: not every rank could map the file")
    return _StatementRing(world, device)


class _SharedStatements:
    """Every rank's statements in one file of host shared memory (see [Note: ranks a step apart] A rank that catches an exception from its forward
and goes on with the next batch runs one step fewer than the others: every
collective still pairs with one of the same group, a batch apart, until
`Engine.close`, whose gathers met the other rank's last reductions (gloo
aborted the process: "Received data size doesn't match"). So on gloo close
begins with a statement of its own (`PathCheck.before_close`): the rank still
training states its next reduction instead, both raise `RankDivergenceError`
naming what each was about to do, and neither engine issues another
collective; close then frees what its rank holds without one (see
`Engine.close`).

[Note: statements in shared memory])."""

    def __init__(self, rows: np.ndarray, rank: int) -> None:
        self.host = torch.from_numpy(rows)  # keeps the mapping alive; the watcher reads it
        self._mine = rows[:, rank, :]

    @classmethod
    def open(cls, world: int, device: torch.device) -> _SharedStatements | None:
        """Map one file on every rank (collective); None on every rank where any rank could not."""
        rank = dist.get_rank()
        shape = (_RING, world, _COLS)
        created = None
        rows = None
        try:
            # tmpfs only: a file on a network file system would map on several hosts without
            # their writes reaching each other.
            if rank == 0 and os.path.isdir(_SHARED_FOLDER):
                created = os.path.join(_SHARED_FOLDER, f"zkernel-paths-{os.getpid()}-{uuid.uuid4().hex}")
                try:
                    rows = np.memmap(created, dtype=np.int64, mode="w+", shape=shape)
                    rows[:] = -1
                    rows.flush()
                except (OSError, ValueError) as exc:  # every rank must reach the broadcast below
                    log.debug("zkernel.paths.shared_unavailable", reason=str(exc))
                    rows = None
            names = [created if rows is not None else None]
            dist.broadcast_object_list(names, src=0)
            if rank != 0 and names[0] is not None:
                try:
                    rows = np.memmap(names[0], dtype=np.int64, mode="r+", shape=shape)
                except (OSError, ValueError) as exc:  # another host, or another file system
                    log.debug("zkernel.paths.shared_unavailable", reason=str(exc))
            ok = every_rank(rows is not None, device)  # every rank has mapped it, or failed, by now
        finally:
            if created is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(created)  # the mappings stay; nothing is left behind
        return cls(rows, rank) if ok else None

    def state(self, statement: tuple[int, int, int, int]) -> None:
        self._mine[statement[0] % _RING] = statement

    def settle(self, timeout_s: float, issued: int) -> bool:
        """Wait (bounded) until every rank has written as many statements as this one: a rank
        that closes first still compares the last ones. Reading host memory never hangs, so the
        rows can always be scanned after."""
        deadline = time.monotonic() + timeout_s
        while int(self.host[:, :, 0].max(dim=0).values.min()) < issued - 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        return True


class _StatementRing:
    """Statements as issued (page-locked), on the device, as gathered from every rank, and the host
    rows the watcher reads (the gathered ring itself on the CPU, its page-locked mirror with CUDA).

    ``state`` is called by the training thread only.
    """

    def __init__(self, world: int, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.mine = torch.zeros(_RING, _COLS, dtype=torch.int64, device=device)
        self.gathered = torch.full((_RING, world, _COLS), -1, dtype=torch.int64, device=device)
        self.host = (
            torch.full((_RING, world, _COLS), -1, dtype=torch.int64, pin_memory=True) if self.cuda else self.gathered
        )
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def state(self, statement: tuple[int, int, int, int]) -> None:
        slot = statement[0] % _RING
        if not self.cuda:
            self.mine[slot] = torch.tensor(statement, dtype=torch.int64)
            _all_gather(self.gathered[slot].view(-1), self.mine[slot])
            return
        # A page-locked source from torch's caching host allocator, which keeps the block until
        # the copy has run on the stream that issued it. Every use of a slot is on this stream or
        # ordered after it (the all-gather, on the process group's stream, waits for this one),
        # and a slot is rewritten _RING statements later. The mirror's copy waits for this
        # statement's all-gather only, so it runs even when the next collective never finishes.
        source = torch.tensor(statement, dtype=torch.int64, pin_memory=True)
        with torch.cuda.stream(self.stream):
            self.mine[slot].copy_(source, non_blocking=True)
            _all_gather(self.gathered[slot].view(-1), self.mine[slot], async_op=True).wait()
            self.host[slot].copy_(self.gathered[slot], non_blocking=True)

    def settle(self, timeout_s: float, issued: int) -> bool:
        """Wait (bounded: a hung collective must not hang the exit) until what was issued so far ran."""
        if not self.cuda:
            return True
        done = torch.cuda.Event()
        done.record(self.stream)
        deadline = time.monotonic() + timeout_s
        while not done.query():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True


def _end_process(message: str) -> None:
    """The error was logged (ERROR reaches stderr even where logging is unconfigured); the
    mismatched collective behind it cannot be cancelled, so the process ends without unwinding."""
    for handler in (*logging.getLogger("zkernel").handlers, *logging.getLogger().handlers, logging.lastResort):
        if handler is not None:
            handler.flush()
    sys.stderr.flush()
    os._exit(1)


def _verb(kind: str) -> str:
    return {"forward": "gather for forward", "backward": "gather for backward", "reduce": "reduce", "user": "gather"}[kind]
