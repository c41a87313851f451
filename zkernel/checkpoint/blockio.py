"""Large sequential file I/O for checkpoints: staging buffers, the native engine or pread/pwrite.

Data moves in pieces of up to `PIECE_BYTES`, `DEPTH` of them in flight, through
page-aligned staging buffers (page-locked when CUDA is available, so device
copies into and out of them run at full speed) or straight from or into the
caller's memory: while one piece is filled or drained, the others are being
written or read. With the
native extension built, pieces go through `zkernel.platform.aio.AioHandle`: O_DIRECT, split
over many I/O threads, which is what gets a single file near the disk's bandwidth
(buffered writes plus fsync reached a third of it on the development VM). Without
it, plain ``pwrite``/``preadv`` run synchronously.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from zkernel.platform import native

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
        from zkernel.platform.aio import aligned_empty

        return aligned_empty(nbytes, torch.uint8)
    return torch.empty(nbytes, dtype=torch.uint8)


class BlockIO:
    """Submit piece-sized reads and writes at file offsets; collect them in any order."""

    def __init__(self) -> None:
        self._aio = None
        if native.available():
            from zkernel.platform.aio import AioHandle

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


class StagingPool:
    """Up to ``count`` staging buffers of ``size`` bytes, allocated on first use, handed out in turn."""

    def __init__(self, size: int, count: int = DEPTH) -> None:
        self.size = max(1, size)
        self._free: list[torch.Tensor | None] = [None] * count

    @property
    def exhausted(self) -> bool:
        """Every buffer is out: the caller finishes some I/O and releases one before the next `acquire`."""
        return not self._free

    def acquire(self) -> torch.Tensor:
        buf = self._free.pop()
        return buf if buf is not None else host_buffer(self.size)

    def release(self, buf: torch.Tensor) -> None:
        self._free.append(buf)
