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
  gather. The comparison runs on the device instead and records the first
  disagreeing statement; a watchdog thread polls that record (a copy into
  page-locked memory, every ``poll_s``), and on a disagreement logs the same
  error and ends the process (the mismatched collective behind it would hang
  until NCCL's own watchdog kills the job after ``collective_timeout``, with
  a message that names no module). Cost: one 24-byte all-gather per gather or
  reduction, queued on the collective stream.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Sequence

import torch
import torch.distributed as dist

from zkernel.groups import ParamGroup
from zkernel.log import get_logger

log = get_logger()

# torch 2.13 renamed the flat all-gather (the old name warns); torch 2.11 has only the old one.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_KINDS = ("forward", "backward", "reduce", "user")
_HISTORY = 4096  # statements remembered for the watchdog's message


class RankDivergenceError(RuntimeError):
    """Ranks were about to move different groups in the same collective."""


class PathCheck:
    """Every rank states the group of its next collective; disagreement is an error (see the Note)."""

    def __init__(self, groups: Sequence[ParamGroup], device: torch.device, enabled: bool, poll_s: float = 0.5) -> None:
        self.enabled = enabled and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self._names = {g.index: g.name for g in groups}
        self.count = 0
        self.micro_step = 0
        if not self.enabled:
            return
        self.world = dist.get_world_size()
        self.nccl = dist.get_backend() == "nccl"
        self._device = device if self.nccl else torch.device("cpu")
        self._history: list[tuple[int, str, int] | None] = [None] * _HISTORY
        if self.nccl:
            # first disagreeing statement number + 1 (0: none), and its statements, on the device
            self._first = torch.zeros(1, dtype=torch.int64, device=device)
            self._seen = torch.zeros(self.world * 3, dtype=torch.int64, device=device)
            self._host = torch.zeros(1 + self.world * 3, dtype=torch.int64).pin_memory()
            self._stream = torch.cuda.Stream(device)
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
        statement = [number, group.index, _KINDS.index(kind)]
        if not self.nccl:
            gathered = torch.empty(self.world * 3, dtype=torch.int64)
            _all_gather(gathered, torch.tensor(statement, dtype=torch.int64))
            rows = gathered.view(self.world, 3).tolist()
            if any(r != rows[0] for r in rows):
                raise RankDivergenceError(self._message(rows, micro_step))
            return
        self._history[number % _HISTORY] = (group.index, kind, micro_step)
        mine = torch.tensor(statement, dtype=torch.int64).to(self._device, non_blocking=True)
        gathered = torch.empty(self.world * 3, dtype=torch.int64, device=self._device)
        _all_gather(gathered, mine)
        rows = gathered.view(self.world, 3)
        differs = (rows != rows[0]).any()
        first_time = differs & (self._first == 0)
        self._first.copy_(torch.where(first_time, number + 1, self._first))
        self._seen.copy_(torch.where(first_time, gathered, self._seen))

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
        while not self._stop.wait(poll_s):
            with torch.cuda.stream(self._stream):
                self._host[:1].copy_(self._first, non_blocking=True)
                self._host[1:].copy_(self._seen, non_blocking=True)
                self._stream.synchronize()
            first = int(self._host[0])
            if first:
                rows = self._host[1:].view(self.world, 3).tolist()
                entry = self._history[(first - 1) % _HISTORY]
                step = entry[2] if entry is not None else self.micro_step
                message = self._message(rows, step)
                log.error("zkernel.ranks.diverged", message=message)
                print(f"zkernel: RankDivergenceError: {message}", file=sys.stderr, flush=True)
                os._exit(1)

    def close(self) -> None:
        if self.enabled and self.nccl:
            self._stop.set()


def _verb(kind: str) -> str:
    return {"forward": "gather for forward", "backward": "gather for backward", "reduce": "reduce", "user": "gather"}[kind]
