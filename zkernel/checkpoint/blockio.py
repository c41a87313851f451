"""Large sequential file I/O for checkpoints: staging buffers, the native engine or pread/pwrite.

Data moves through a few page-aligned staging buffers of `PIECE_BYTES` (page-locked
when CUDA is available, so device copies into and out of them run at full speed):
while one is filled or drained, the others are being written or read. With the
native extension built, pieces go through `zkernel.aio.AioHandle`: O_DIRECT, split
over many I/O threads, which is what gets a single file near the disk's bandwidth
(buffered writes plus fsync reached a third of it on the development VM). Without
it, plain ``pwrite``/``preadv`` run synchronously.
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from zkernel import native

PIECE_BYTES = 32 << 20
DEPTH = 4  # staging buffers per stream

_checksum_pool: ThreadPoolExecutor | None = None


def checksum_pool() -> ThreadPoolExecutor:
    """Threads that checksum blocks beside the I/O (shared by every stream of the process)."""
    global _checksum_pool
    if _checksum_pool is None:
        workers = max(1, min(8, os.cpu_count() or 1))
        _checksum_pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="zkernel-checksum")
    return _checksum_pool


def host_buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` of host memory: page-aligned (and page-locked with CUDA) when the native
    extension is built, else a plain tensor (the pread/pwrite fallback needs no alignment)."""
    if native.available():
        from zkernel.aio import aligned_empty

        return aligned_empty(nbytes, torch.uint8)
    return torch.empty(nbytes, dtype=torch.uint8)


class BlockIO:
    """Submit piece-sized reads and writes at file offsets; collect them in any order."""

    def __init__(self) -> None:
        self._aio = None
        if native.available():
            from zkernel.aio import AioHandle

            self._aio = AioHandle()
        self._next = 0

    def submit_write(self, buf: torch.Tensor, path: Path, offset: int) -> int:
        if self._aio is not None:
            return self._aio.submit_write(buf, path, offset)
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            view = memoryview(buf.numpy())
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], offset + done)
        finally:
            os.close(fd)
        return self._token()

    def submit_read(self, buf: torch.Tensor, path: Path, offset: int) -> int:
        if self._aio is not None:
            return self._aio.submit_read(buf, path, offset)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            view = memoryview(buf.numpy())
            done = 0
            while done < len(view):
                n = os.preadv(fd, [view[done:]], offset + done)
                if n == 0:
                    raise EOFError(f"{path}: read of {len(view)} bytes at offset {offset} reached the end of the file")
                done += n
        finally:
            os.close(fd)
        return self._token()

    def wait(self, token: int) -> None:
        if self._aio is not None:
            self._aio.wait(token)

    def _token(self) -> int:
        self._next += 1
        return self._next

    def close(self) -> None:
        if self._aio is not None:
            self._aio.close()
            self._aio = None


class StagingRing:
    """``depth`` staging buffers used in turn; a buffer is free again once its I/O finished."""

    def __init__(self, io: BlockIO, largest: int, depth: int = DEPTH) -> None:
        self.io = io
        self.size = max(1, largest)  # bytes per buffer: no more than the largest piece asks for
        self._free: list[torch.Tensor | None] = [None] * depth  # allocated on first use
        self._busy: deque[tuple[torch.Tensor, int, list[Future], object]] = deque()

    @property
    def full(self) -> bool:
        """Every buffer is in flight: `finish_oldest` before the next `acquire`."""
        return not self._free

    @property
    def in_flight(self) -> int:
        return len(self._busy)

    def acquire(self) -> torch.Tensor:
        buf = self._free.pop()
        return buf if buf is not None else host_buffer(self.size)

    def release(self, buf: torch.Tensor) -> None:
        """Give back a buffer whose I/O the caller tracks itself (the reader)."""
        self._free.append(buf)

    def busy(self, buf: torch.Tensor, token: int, checksums: list[Future], tag: object = None) -> None:
        """``buf`` has I/O ``token`` and checksum jobs in flight; ``tag`` comes back from `finish_oldest`."""
        self._busy.append((buf, token, checksums, tag))

    def finish_oldest(self) -> tuple[torch.Tensor, list[int], object]:
        """Wait for the oldest buffer in flight; return it (valid until the next `acquire`), its checksums, its tag."""
        buf, token, checksums, tag = self._busy.popleft()
        self._free.append(buf)
        self.io.wait(token)
        return buf, [f.result() for f in checksums], tag

    def drain(self) -> None:
        """Wait for everything in flight, ignoring failures (after an error elsewhere)."""
        while self._busy:
            try:
                self.finish_oldest()
            except Exception:  # noqa: BLE001 - the first error is already being raised
                pass
