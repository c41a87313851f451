"""Asynchronous file I/O for the NVMe tier (the DeepNVMe role), over `zkernel._native`.

`AioHandle` submits reads and writes of (buffer, path, offset) without
blocking and collects them with `wait` (one request), `wait_any`, `wait_all`
or polls them with `done`. The native engine splits each request into
``block_size`` chunks served by ``threads`` I/O threads with pread/pwrite (so
``threads`` I/Os are in flight at the device); the aligned bulk of a request
goes through O_DIRECT and a tail that is not a multiple of the alignment, or a
misaligned buffer, through the page cache. At most ``queue_depth`` requests are
outstanding; a submit beyond that blocks until one completes.

Buffers for O_DIRECT come from `aligned_empty`, which allocates memory aligned
to the block alignment and, when CUDA is available, page-locks it with
``cudaHostRegister`` so the same buffer feeds host-to-device copies at full
speed. Any C-contiguous CPU tensor or writable buffer-protocol object works
too (misaligned ones go through the page cache).

Errors are raised when a request is collected, as the `OSError` subclass of
its errno (``FileNotFoundError``, ``PermissionError``, ``OSError(ENOSPC)``...)
naming the file, the operation and the offsets; a read that hits the end of the
file raises `EOFError`. A failed request does not affect any other. Files are
created with mode 0600 and never truncated; `preallocate` reserves a file's
blocks ahead of time (faster first writes than a growing file).
"""

from __future__ import annotations

import errno as errno_mod
import os
from typing import Any

import torch

from zkernel import native
from zkernel.log import get_logger

log = get_logger()

__all__ = ["DEFAULT_BLOCK_SIZE", "DEFAULT_THREADS", "AioHandle", "aligned_empty", "preallocate"]

ALIGNMENT = 4096
# Measured on virtio ext4 (bench/aio.py): 8-32 threads and 1-4 MiB blocks all sit at fio's
# best; 16 x 2 MiB keeps 32 MiB in flight and still splits a 32 MiB request 16 ways.
DEFAULT_BLOCK_SIZE = 2 << 20
DEFAULT_THREADS = 16
DEFAULT_QUEUE_DEPTH = 128


def aligned_empty(
    numel: int,
    dtype: torch.dtype = torch.uint8,
    *,
    alignment: int = ALIGNMENT,
    pin: bool | None = None,
) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor whose data starts on an ``alignment`` boundary.

    ``pin`` page-locks it for fast GPU copies (default: when CUDA is available;
    True without CUDA is an error). The memory is unpinned and freed when the
    last view of it goes away.
    """
    required = bool(pin)
    if pin is None:
        pin = torch.cuda.is_available()
    elif pin and not torch.cuda.is_available():
        raise RuntimeError("aligned_empty(pin=True) needs CUDA; pass pin=False or None")
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = int(numel) * itemsize
    buf = native.load().AlignedBuffer(nbytes, alignment)
    if pin and nbytes > 0:
        try:
            _page_lock(buf, nbytes)
        except RuntimeError as exc:
            if required:
                raise
            log.warning("zkernel.aio.pin_failed", nbytes=nbytes, error=str(exc))
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype)


def _page_lock(buf, nbytes: int) -> None:
    """cudaHostRegister ``buf`` and arrange cudaHostUnregister just before it is freed."""
    cudart = torch.cuda.cudart()
    register = getattr(cudart, "cudaHostRegister", None)
    unregister = getattr(cudart, "cudaHostUnregister", None)
    if register is None or unregister is None:
        raise RuntimeError("this torch build does not expose cudaHostRegister")
    address = buf.address
    rc = register(address, nbytes, 0)
    if int(rc) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(rc)}")
    buf.on_free = lambda: unregister(address)


def preallocate(path: str | os.PathLike, nbytes: int) -> None:
    """Create ``path`` (mode 0600) if missing and reserve ``nbytes`` of disk for it."""
    err = native.load().preallocate_file(os.fspath(path), int(nbytes))
    if err:
        raise OSError(err, f"{os.strerror(err)} (preallocating {nbytes} bytes)", os.fspath(path))


def _address_and_size(buffer: Any, writable: bool) -> tuple[int, int]:
    if isinstance(buffer, torch.Tensor):
        if buffer.device.type != "cpu":
            raise ValueError(f"aio buffers must be on CPU, got a tensor on {buffer.device}")
        if not buffer.is_contiguous():
            raise ValueError("aio buffers must be contiguous")
        return buffer.data_ptr(), buffer.numel() * buffer.element_size()
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise ValueError("aio buffers must be C-contiguous")
    if writable and view.readonly:
        raise ValueError("cannot read into a read-only buffer")
    import numpy as np

    array = np.frombuffer(view.cast("B"), dtype=np.uint8)
    return array.__array_interface__["data"][0], view.nbytes


def _raise_for(result: Any) -> None:
    op = "read" if result.op == native.load().AioOp.READ else "write"
    what = f"{op} of {result.nbytes} bytes at offset {result.offset}"
    if result.eof:
        raise EOFError(
            f"{result.path}: {what} reached the end of the file at offset {result.error_offset}"
        )
    if result.error:
        err = result.error
        raise OSError(
            err,
            f"{os.strerror(err)} [{errno_mod.errorcode.get(err, err)}] "
            f"({what}, failing at offset {result.error_offset})",
            result.path,
        )


class AioHandle:
    """Submits file reads and writes that run in the background; see the module docstring."""

    def __init__(
        self,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        threads: int = DEFAULT_THREADS,
        queue_depth: int = DEFAULT_QUEUE_DEPTH,
        direct: bool = True,
        alignment: int = ALIGNMENT,
    ) -> None:
        self._engine = native.load().AioEngine(
            block_size=int(block_size),
            threads=int(threads),
            queue_depth=int(queue_depth),
            direct=bool(direct),
            alignment=int(alignment),
        )
        # Buffers of outstanding requests, kept alive until collected.
        self._buffers: dict[int, Any] = {}

    @property
    def block_size(self) -> int:
        return self._engine.block_size

    @property
    def threads(self) -> int:
        return self._engine.threads

    @property
    def queue_depth(self) -> int:
        return self._engine.queue_depth

    @property
    def direct(self) -> bool:
        return self._engine.direct

    # -- submission --------------------------------------------------------

    def submit_read(self, buffer: Any, path: str | os.PathLike, offset: int = 0) -> int:
        """Start reading ``len(buffer)`` bytes of ``path`` at ``offset`` into ``buffer``; return its id."""
        return self._submit(native.load().AioOp.READ, buffer, path, offset)

    def submit_write(self, buffer: Any, path: str | os.PathLike, offset: int = 0) -> int:
        """Start writing ``buffer`` to ``path`` at ``offset`` (created 0600 if missing); return its id."""
        return self._submit(native.load().AioOp.WRITE, buffer, path, offset)

    def _submit(self, op: Any, buffer: Any, path: str | os.PathLike, offset: int) -> int:
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        address, nbytes = _address_and_size(buffer, writable=op == native.load().AioOp.READ)
        request = self._engine.submit(op, address, nbytes, os.fspath(path), int(offset))
        self._buffers[request] = buffer
        return request

    # -- completion --------------------------------------------------------

    def wait(self, request: int) -> None:
        """Block until ``request`` completes; raise its error if it failed."""
        self._collect(self._engine.wait(request))

    def wait_any(self) -> int:
        """Block until any uncollected request completes; return its id (or raise its error)."""
        return self._collect(self._engine.wait_any())

    def wait_all(self) -> None:
        """Block until every outstanding request completes; raise the first failure, if any.

        All requests are collected either way; further failures are attached to
        the raised exception as notes.
        """
        failures: list[BaseException] = []
        for result in self._engine.wait_all():
            try:
                self._collect(result)
            except (OSError, EOFError) as exc:
                failures.append(exc)
        if failures:
            first = failures[0]
            for other in failures[1:]:
                first.add_note(f"also failed: {other}")
            raise first

    def done(self, request: int) -> bool:
        """Whether ``request`` has completed (poll; it stays uncollected until waited for)."""
        return self._engine.done(request)

    @property
    def pending(self) -> int:
        """Requests submitted and not yet collected."""
        return self._engine.pending()

    def _collect(self, result: Any) -> int:
        self._buffers.pop(result.id, None)
        if result.error or result.eof:
            log.debug("zkernel.aio.failed", path=result.path, offset=result.offset, errno=result.error)
        _raise_for(result)
        return result.id

    # -- synchronous helpers ------------------------------------------------

    def read(self, buffer: Any, path: str | os.PathLike, offset: int = 0) -> None:
        """Read into ``buffer`` and wait."""
        self.wait(self.submit_read(buffer, path, offset))

    def write(self, buffer: Any, path: str | os.PathLike, offset: int = 0) -> None:
        """Write ``buffer`` and wait."""
        self.wait(self.submit_write(buffer, path, offset))

    def close(self) -> None:
        """Wait for outstanding requests (errors are discarded) and release the I/O threads."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.wait_all()
            self._buffers.clear()
            del engine

    def __enter__(self) -> AioHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
