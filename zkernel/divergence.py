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
  (one asynchronous copy) and is all-gathered into a second device ring; no
  comparison runs on the device and the host never waits. A watchdog thread
  copies the gathered ring to the host every ``poll_s`` and compares it there:
  a statement that every rank has written (equal statement numbers) naming
  different groups, seen in two polls in a row (a poll may read a row that
  NCCL is still writing), is logged with the same message and the process
  ends (the mismatched collective behind it would hang until NCCL's own
  watchdog kills the job after ``collective_timeout``, with a message that
  names no module). Cost per gather or reduction: one 24-byte copy and one
  24-byte all-gather, queued on the stream that issues the collective.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from zkernel.groups import ParamGroup
from zkernel.log import get_logger

log = get_logger()

# torch 2.13 renamed the flat all-gather (the old name warns); torch 2.11 has only the old one.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_KINDS = ("forward", "backward", "reduce", "user")


class RankDivergenceError(RuntimeError):
    """Ranks were about to move different groups in the same collective."""


class PathCheck:
    """Every rank states the group of its next collective; disagreement is an error (see the Note).

    ``deferred`` (default: on NCCL) selects the ring-and-watchdog check; ``on_divergence``
    (default: end the process) receives the watchdog's message.
    """

    def __init__(
        self,
        groups: Sequence[ParamGroup],
        device: torch.device,
        enabled: bool,
        poll_s: float = 0.5,
        deferred: bool | None = None,
        on_divergence: Callable[[str], None] | None = None,
    ) -> None:
        self.enabled = enabled and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self._names = {g.index: g.name for g in groups}
        self.count = 0
        self.micro_step = 0
        if not self.enabled:
            return
        self.world = dist.get_world_size()
        self.deferred = dist.get_backend() == "nccl" if deferred is None else deferred
        if self.deferred:
            self._ring = _StatementRing(self.world, device if dist.get_backend() == "nccl" else torch.device("cpu"))
            self._on_divergence = on_divergence or _end_process
            self._reported = False
            self._stop = threading.Event()
            self._watchdog = threading.Thread(target=self._watch, args=(poll_s,), name="zkernel-paths", daemon=True)
            self._watchdog.start()

    def before(self, group: ParamGroup, kind: str, micro_step: int) -> None:
        """Called by every rank right before it issues a collective for ``group`` (``kind``)."""
        if not self.enabled:
            return
        self.micro_step = micro_step
        number = self.count
        self.count += 1
        statement = (number, group.index, _KINDS.index(kind))
        if self.deferred:
            self._ring.state(statement, micro_step)
            return
        gathered = torch.empty(self.world * 3, dtype=torch.int64)
        _all_gather(gathered, torch.tensor(statement, dtype=torch.int64))
        rows = gathered.view(self.world, 3).tolist()
        if any(r != rows[0] for r in rows):
            raise RankDivergenceError(self._message(rows, micro_step))

    def _message(self, rows: list[list[int]], micro_step: int) -> str:
        said = ", ".join(
            f"rank {r} was about to {_verb(_KINDS[kind])} {self._names.get(index, f'group {index}')!r}"
            for r, (_, index, kind) in enumerate(rows)
        )
        return (
            f"ranks took different module paths in micro-step {micro_step}: {said}. Every rank must run the "
            "same modules in the same order (a data-dependent branch must take the same path on every rank)"
        )

    def _watch(self, poll_s: float) -> None:
        suspects: set[int] = set()
        while not self._stop.wait(poll_s):
            found = self._ring.disagreements()
            confirmed = sorted(n for n in found if n in suspects)
            suspects = set(found)
            if confirmed:
                self._report(found[confirmed[0]])
                return

    def _report(self, found: tuple[list[list[int]], int]) -> None:
        if self._reported:
            return
        self._reported = True
        message = self._message(*found)
        log.error("zkernel.ranks.diverged", message=message)
        self._on_divergence(message)

    def close(self) -> None:
        """Stop the watchdog after a last look at the ring: ranks that diverged into units of equal
        sizes get through their collectives, and a job that ends soon after must not end quietly."""
        if not (self.enabled and self.deferred) or self._stop.is_set():
            return
        self._stop.set()
        if self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=5)
        if not self._reported and self._ring.settle(timeout_s=10.0):
            found = self._ring.disagreements()
            if found:
                self._report(found[min(found)])


_RING = 1024  # statements the watchdog can see


class _StatementRing:
    """Statements as issued (page-locked), on the device, and as gathered from every rank.

    ``state`` is called by the training thread, ``disagreements`` by the watchdog.
    """

    def __init__(self, world: int, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.cuda = cuda
        self.mine = torch.zeros(_RING, 3, dtype=torch.int64, device=device)
        self.gathered = torch.full((_RING, world, 3), -1, dtype=torch.int64, device=device)
        self._read = torch.empty(_RING, world, 3, dtype=torch.int64, pin_memory=cuda)
        self._micro_steps = [0] * _RING
        self._stream = torch.cuda.Stream(device) if cuda else None

    def state(self, statement: tuple[int, int, int], micro_step: int) -> None:
        slot = statement[0] % _RING
        self._micro_steps[slot] = micro_step
        # A page-locked source from torch's caching host allocator, which keeps the block until
        # the copy has run on whichever stream issued it. A device slot is rewritten _RING
        # statements later, long after the all-gather that read it (later gathers of the same
        # collective stream have been waited on by then).
        source = torch.tensor(statement, dtype=torch.int64, pin_memory=self.cuda)
        self.mine[slot].copy_(source, non_blocking=True)
        _all_gather(self.gathered[slot].view(-1), self.mine[slot])

    def settle(self, timeout_s: float) -> bool:
        """Wait (bounded: a hung collective must not hang the exit) until what was issued so far ran."""
        if not self.cuda:
            return True
        done = torch.cuda.Event()
        done.record()
        deadline = time.monotonic() + timeout_s
        while not done.query():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def disagreements(self) -> dict[int, tuple[list[list[int]], int]]:
        """Statement number -> (every rank's statement, micro-step) where complete rows disagree."""
        if self.cuda:
            with torch.cuda.stream(self._stream):
                self._read.copy_(self.gathered, non_blocking=True)
                self._stream.synchronize()
        else:
            self._read.copy_(self.gathered)
        rows = self._read.numpy()
        numbers = rows[:, :, 0]
        complete = (numbers[:, 0] >= 0) & (numbers == numbers[:, :1]).all(axis=1)
        differs = (rows[:, :, 1:] != rows[:, :1, 1:]).any(axis=(1, 2))
        return {
            int(rows[slot, 0, 0]): (rows[slot].tolist(), self._micro_steps[slot])
            for slot in (complete & differs).nonzero()[0]
        }


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
