"""A swap file: fixed layout, pre-allocated, written and read in extents, each checked against its CRC32C.

[Note: swap-file integrity] A swap file is cut into extents (the unit of a
read or write request: at most ``sub_group_size`` elements of one tensor, on
O_DIRECT alignment). Every write has the I/O threads compute the CRC32C of
the bytes they write, and the tier keeps it, per extent, in memory; every
read passes it back as the expected value, so the I/O threads compare what
they read (a hardware CRC keeps up with the disk). A file changed on disk
since it was written, even one flipped byte, fails that read with
`ChecksumError` naming the file and the byte range; the bytes read are never
used. An extent never written holds zeros by construction (the tier fills
memory instead of reading it); an extent whose write failed is marked
`INVALID` and is never read (its newest bytes stay in memory, see the tiers'
[Note: write failures]).

The file is pre-allocated at `initialize` (`zkernel.platform.aio.preallocate`), so a
disk too small fails there, and every later write overwrites reserved blocks.
"""

from __future__ import annotations

import errno
import os
import shutil
from concurrent.futures import Future
from pathlib import Path
from typing import Callable

import attrs
import torch

from zkernel.platform.aio import ALIGNMENT, preallocate
from zkernel.spec.config import ConfigError
from zkernel.telemetry.timeline import SpanKind

from ._arena import aligned
from ._io_queue import IoQueue

UNWRITTEN = -1  # never written: logically zeros
INVALID = -2  # its last write failed: contents unknown, never read


@attrs.frozen
class Extent:
    offset: int  # in the file, and in the block the file is read into
    nbytes: int  # a multiple of the alignment


def extents_of(segments: list[tuple[int, int]], max_bytes: int) -> list[Extent]:
    """Extents covering each ``(offset, nbytes)`` segment in pieces of at most ``max_bytes``."""
    step = max(ALIGNMENT, max_bytes // ALIGNMENT * ALIGNMENT)
    out = []
    for offset, nbytes in segments:
        padded = aligned(nbytes)
        for start in range(0, padded, step):
            out.append(Extent(offset + start, min(step, padded - start)))
    return out


class SwapFile:
    """One file of a run directory, its extents and the CRC32C each holds."""

    def __init__(self, path: Path, nbytes: int, extents: list[Extent]) -> None:
        self.path = path
        self.nbytes = nbytes
        self.extents = extents
        self.crcs = [UNWRITTEN] * len(extents)

    def preallocate(self, what: str) -> None:
        """Create the file and reserve its blocks; a full disk is a `ConfigError` with the numbers."""
        try:
            preallocate(self.path, self.nbytes)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                raise
            free = shutil.disk_usage(self.path.parent).free
            raise ConfigError(
                f"offload.nvme_path: cannot reserve {self.nbytes} bytes for {what} in {str(self.path)!r} "
                f"({exc.strerror}; {free} bytes free on that disk): free disk space, use a larger disk, or more ranks"
            ) from exc

    def readable(self) -> bool:
        return INVALID not in self.crcs

    def plan_read(self, only: tuple[int, int] | None = None) -> tuple[list[int], list[Extent]]:
        """The extents to read (indices; within the byte range ``only`` when given) and the unwritten
        ones among them, which hold zeros and are filled in memory instead."""
        if not self.readable():
            raise RuntimeError(f"{self.path}: a write to this swap file failed; its contents are not read back")
        reads, zeros = [], []
        for i, extent in enumerate(self.extents):
            if only is not None and not (only[0] <= extent.offset < only[1]):
                continue
            if self.crcs[i] == UNWRITTEN:
                zeros.append(extent)
            else:
                reads.append(i)
        return reads, zeros

    def read(
        self, io: IoQueue, i: int, data: torch.Tensor, *, kind: SpanKind, label: str, done: Callable[[Future], None]
    ) -> None:
        """Start reading extent ``i`` into its place in ``data`` (the file's image), checked against its
        CRC32C; ``done(future)`` runs on completion (on the reaper, or here if it failed at once)."""
        extent = self.extents[i]
        future = io.read(
            data[extent.offset : extent.offset + extent.nbytes], self.path, extent.offset,
            expect_crc=self.crcs[i], kind=kind, label=label,
        )
        future.add_done_callback(done)

    def write(
        self, io: IoQueue, i: int, data: torch.Tensor, *, kind: SpanKind, label: str, done: Callable[[Future], None]
    ) -> None:
        """Start writing extent ``i`` from its place in ``data``; on completion its CRC32C is recorded (or
        the extent marked `INVALID`), then ``done(future)`` runs."""
        extent = self.extents[i]
        future = io.write(data[extent.offset : extent.offset + extent.nbytes], self.path, extent.offset, kind=kind, label=label)

        def written(f: Future) -> None:
            self.crcs[i] = INVALID if f.exception() is not None else f.result()
            done(f)

        future.add_done_callback(written)

    def write_now(self, io: IoQueue, data: torch.Tensor, *, kind: SpanKind, label: str, only: tuple[int, int] | None = None) -> None:
        """Write every extent (within the byte range ``only`` when given) from its place in ``data``
        and wait for them; raise the first failure (its extents are then `INVALID`)."""
        futures = []
        for i, extent in enumerate(self.extents):
            if only is None or only[0] <= extent.offset < only[1]:
                futures.append(Future())
                self.write(io, i, data, kind=kind, label=label, done=futures[-1].set_result)
        _raise_first(futures)

    def read_now(self, io: IoQueue, data: torch.Tensor, *, kind: SpanKind, label: str, only: tuple[int, int] | None = None) -> None:
        """Read the file's image (within the byte range ``only`` when given) into ``data`` and wait,
        each extent checked against its CRC32C; unwritten extents are zeros."""
        indices, zeros = self.plan_read(only)
        futures = []
        for i in indices:
            futures.append(Future())
            self.read(io, i, data, kind=kind, label=label, done=futures[-1].set_result)
        for extent in zeros:
            data[extent.offset : extent.offset + extent.nbytes].zero_()
        _raise_first(futures)

    def remove(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _raise_first(futures: list[Future]) -> None:
    """Wait for every request (each future resolves to the I/O's own future); raise the first failure."""
    errors = [e for e in (f.result().exception() for f in futures) if e is not None]
    if errors:
        raise errors[0]
