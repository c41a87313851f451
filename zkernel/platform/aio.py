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

Checksums: ``submit_write(..., checksum=True)`` and ``submit_read(...,
checksum=True)`` have the I/O threads compute the CRC32C of each chunk they
move (right before pwrite, right after pread: in parallel, while the data is at
hand), and `wait` returns the CRC32C of the whole request, equal to
`zkernel.platform.native.crc32c` of its buffer. ``submit_read(..., expect_crc=crc)``
also compares: a read whose bytes do not match raises `ChecksumError` (an
`OSError` with errno EIO) naming the file and the byte range, so a swap file
altered on disk is never trained on. The caller keeps each region's CRC from
its write and passes it to the read.
"""

from __future__ import annotations

import errno as errno_mod
import os
import threading
from typing import Any, NamedTuple

import torch

from zkernel.platform import native
from zkernel.telemetry.log import get_logger

log = get_logger()

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_THREADS",
    "AioHandle",
    "ChecksumError",
    "aligned_empty",
    "live_aligned_buffers",
    "preallocate",
]

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
    last view of it goes away; until then it counts in `live_aligned_buffers`.
    """
    required = bool(pin)
    if pin is None:
        pin = torch.cuda.is_available()
    elif pin and not torch.cuda.is_available():
        raise RuntimeError("aligned_empty(pin=True) needs CUDA; pass pin=False or None")
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = int(numel) * itemsize
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    buf = native.load().AlignedBuffer(nbytes, alignment)
    unpin = None
    if pin:
        try:
            unpin = _page_lock(buf, nbytes)
        except RuntimeError as exc:
            if required:
                raise
            log.warning("zkernel.aio.pin_failed", nbytes=nbytes, error=str(exc))
    _count_live(+1, unpin is not None)
    buf.on_free = lambda: _on_free(unpin)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype)


# Buffers from `aligned_empty` not freed yet (all, and the page-locked ones among them).
_live_lock = threading.Lock()
_live = [0, 0]


def _count_live(delta: int, pinned: bool) -> None:
    with _live_lock:
        _live[0] += delta
        if pinned:
            _live[1] += delta


def _on_free(unpin) -> None:
    """Called by the native buffer just before its memory is freed (any thread, GIL held)."""
    try:
        if unpin is not None:
            unpin()
    finally:
        _count_live(-1, unpin is not None)


def live_aligned_buffers() -> tuple[int, int]:
    """(buffers, page-locked buffers) from `aligned_empty` that are not freed yet, in this process.

    A buffer is freed when the last tensor viewing it goes away, so after a
    component released its memory both counts drop back to what they were.
    """
    with _live_lock:
        return _live[0], _live[1]


def _page_lock(buf, nbytes: int):
    """cudaHostRegister ``buf``; return the call that unregisters it (made just before it is freed)."""
    cudart = torch.cuda.cudart()
    register = getattr(cudart, "cudaHostRegister", None)
    unregister = getattr(cudart, "cudaHostUnregister", None)
    if register is None or unregister is None:
        raise RuntimeError("this torch build does not expose cudaHostRegister")
    address = buf.address
    rc = register(address, nbytes, 0)
    if int(rc) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(rc)}")
    return lambda: unregister(address)


def preallocate(path: str | os.PathLike, nbytes: int) -> None:
    """Create ``path`` (mode 0600) if missing and reserve ``nbytes`` of disk for it."""
    err = native.load().preallocate_file(os.fspath(path), int(nbytes))
    if err:
        raise OSError(err, f"{os.strerror(err)} (preallocating {nbytes} bytes)", os.fspath(path))


class ChecksumError(OSError):
    """A read's bytes do not have the CRC32C they were written with (errno EIO).

    ``filename`` is the file; ``offset`` and ``nbytes`` the byte range read;
    ``expected`` and ``actual`` the CRC32C values.
    """

    def __init__(self, path: str, offset: int, nbytes: int, expected: int, actual: int) -> None:
        where = f"offsets {offset}..{offset + nbytes - 1}" if nbytes else f"offset {offset}"
        super().__init__(
            errno_mod.EIO,
            f"CRC32C mismatch reading {nbytes} bytes at {where}: expected {expected:#010x}, "
            f"read {actual:#010x} (the file changed on disk since it was written)",
            path,
        )
        self.offset = offset
        self.nbytes = nbytes
        self.expected = expected
        self.actual = actual

    def __reduce__(self):  # pickles across processes (OSError's default passes the wrong arguments)
        return type(self), (self.filename, self.offset, self.nbytes, self.expected, self.actual)


def _address_and_size(buffer: Any, writable: bool) -> tuple[int, int]:
    return native.buffer_address(buffer, writable=writable, what="aio buffers")


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
    if result.checksum_mismatch:
        raise ChecksumError(result.path, result.offset, result.nbytes, result.expected_crc, result.crc32c)


class _Completed(NamedTuple):
    """A collected request: its id and, when it was checksummed, its CRC32C."""

    request: int
    crc32c: int | None


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

    def submit_read(
        self,
        buffer: Any,
        path: str | os.PathLike,
        offset: int = 0,
        *,
        checksum: bool = False,
        expect_crc: int | None = None,
    ) -> int:
        """Start reading ``len(buffer)`` bytes of ``path`` at ``offset`` into ``buffer``; return its id.

        ``checksum``: compute the CRC32C of the bytes read (`wait` returns it).
        ``expect_crc``: the CRC32C these bytes were written with (implies
        ``checksum``); collecting the request raises `ChecksumError` if they differ.
        """
        expected = -1
        if expect_crc is not None:
            expected = int(expect_crc)
            if not 0 <= expected <= 0xFFFFFFFF:
                raise ValueError(f"expect_crc must be a CRC32C value in 0..2**32-1, got {expect_crc}")
        return self._submit(native.load().AioOp.READ, buffer, path, offset, checksum, expected)

    def submit_write(self, buffer: Any, path: str | os.PathLike, offset: int = 0, *, checksum: bool = False) -> int:
        """Start writing ``buffer`` to ``path`` at ``offset`` (created 0600 if missing); return its id.

        ``checksum``: compute the CRC32C of the bytes written (`wait` returns it);
        keep it to pass as ``expect_crc`` when reading them back.
        """
        return self._submit(native.load().AioOp.WRITE, buffer, path, offset, checksum, -1)

    def _submit(
        self, op: Any, buffer: Any, path: str | os.PathLike, offset: int, checksum: bool, expected_crc: int
    ) -> int:
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        address, nbytes = _address_and_size(buffer, writable=op == native.load().AioOp.READ)
        request = self._engine.submit(
            op, address, nbytes, os.fspath(path), int(offset), checksum=bool(checksum), expected_crc=expected_crc
        )
        self._buffers[request] = buffer
        return request

    # -- completion --------------------------------------------------------

    def wait(self, request: int) -> int | None:
        """Block until ``request`` completes; raise its error if it failed.

        Returns the CRC32C of the request's bytes when it was submitted with
        ``checksum`` or ``expect_crc``, else None.
        """
        return self._collect(self._engine.wait(request)).crc32c

    def wait_any(self) -> int:
        """Block until any uncollected request completes; return its id (or raise its error)."""
        return self._collect(self._engine.wait_any()).request

    def wait_any_with_crc(self) -> tuple[int, int | None]:
        """`wait_any`, also returning the request's CRC32C (None when it was not checksummed)."""
        completed = self._collect(self._engine.wait_any())
        return completed.request, completed.crc32c

    def wait_any_outcome(self) -> tuple[int, int | None, BaseException | None]:
        """`wait_any` that returns a failure instead of raising it: (id, CRC32C or None, error or None).

        For a caller that completes requests on behalf of others (one thread collecting every
        request and routing each outcome to whoever submitted it).
        """
        result = self._engine.wait_any()
        try:
            completed = self._collect(result)
        except (OSError, EOFError) as exc:
            return result.id, None, exc
        return completed.request, completed.crc32c, None

    def wait_all(self) -> dict[int, int]:
        """Block until every outstanding request completes; raise the first failure, if any.

        All requests are collected either way; further failures are attached to
        the raised exception as notes. Returns the CRC32C of each checksummed
        request collected, by id (empty when none asked for one).
        """
        failures: list[BaseException] = []
        crcs: dict[int, int] = {}
        for result in self._engine.wait_all():
            try:
                completed = self._collect(result)
            except (OSError, EOFError) as exc:
                failures.append(exc)
            else:
                if completed.crc32c is not None:
                    crcs[completed.request] = completed.crc32c
        if failures:
            first = failures[0]
            for other in failures[1:]:
                first.add_note(f"also failed: {other}")
            raise first
        return crcs

    def done(self, request: int) -> bool:
        """Whether ``request`` has completed (poll; it stays uncollected until waited for)."""
        return self._engine.done(request)

    @property
    def pending(self) -> int:
        """Requests submitted and not yet collected."""
        return self._engine.pending()

    def _collect(self, result: Any) -> _Completed:
        self._buffers.pop(result.id, None)
        if result.error or result.eof:
            log.debug("zkernel.aio.failed", path=result.path, offset=result.offset, errno=result.error)
        elif result.checksum_mismatch:
            log.warning(
                "zkernel.aio.checksum_mismatch", path=result.path, offset=result.offset, nbytes=result.nbytes,
                expected=result.expected_crc, actual=result.crc32c,
            )
        _raise_for(result)
        return _Completed(result.id, result.crc32c if result.checksummed else None)

    # -- synchronous helpers ------------------------------------------------

    def read(
        self,
        buffer: Any,
        path: str | os.PathLike,
        offset: int = 0,
        *,
        checksum: bool = False,
        expect_crc: int | None = None,
    ) -> int | None:
        """Read into ``buffer`` and wait; the CRC32C when asked for (see `submit_read`)."""
        return self.wait(self.submit_read(buffer, path, offset, checksum=checksum, expect_crc=expect_crc))

    def write(self, buffer: Any, path: str | os.PathLike, offset: int = 0, *, checksum: bool = False) -> int | None:
        """Write ``buffer`` and wait; the CRC32C when asked for (see `submit_write`)."""
        return self.wait(self.submit_write(buffer, path, offset, checksum=checksum))

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
