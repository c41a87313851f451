"""Writing safetensors files as a stream: header first, then each tensor when its turn comes.

The files are plain safetensors (an 8-byte little-endian header length, a JSON
header, then the tensors' bytes back to back), readable by
``safetensors.safe_open`` and ``safetensors.torch.load_file``. They are written
here rather than with ``safetensors.torch.save_file`` because that serialises
every tensor to a Python ``bytes`` object first: a rank's whole shard (or a
whole consolidated model) in memory twice, and no overlap with the disk.
`write_file` knows every tensor's size up front, so it writes the header first
and then streams each tensor, produced only when its turn comes, to the disk
(see [Note: direct writes]). The header is padded with spaces (allowed by the
format) so the data starts on a page boundary; a tensor marked ``aligned``
starts on one too, behind a zero-filled ``__pad__/<i>`` tensor when needed.
"""

from __future__ import annotations

import errno
import json
import os
import struct
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import attrs
import torch

from zkernel.checkpoint.blockio import DEPTH, PIECE_BYTES, BlockIO, StagingPool, checksum_pool
from zkernel.checkpoint.checksum import BLOCK_BYTES, checksum_function, default_algorithm
from zkernel.checkpoint.format import ALIGNMENT, SAFETENSORS_DTYPES, CheckpointError, FileRecord, fsync_dir


@attrs.frozen
class Entry:
    """One tensor of a file being written; ``source()`` is called once, in file order, to produce it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    source: Callable[[], torch.Tensor]
    # Start on an ALIGNMENT boundary of the file (a padding tensor goes before it when needed), so
    # a reader can read it straight into page-aligned memory (see `RangeReader`).
    aligned: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


PAD = "__pad__"


def _with_padding(entries: Sequence[Entry]) -> list[Entry]:
    """``entries`` with a zero-filled uint8 tensor named ``__pad__/<i>`` before each aligned one that needs it."""
    out, offset = [], 0
    for entry in entries:
        gap = -offset % ALIGNMENT if entry.aligned else 0
        if gap:
            out.append(Entry(f"{PAD}/{len(out)}", torch.uint8, (gap,), lambda n=gap: torch.zeros(n, dtype=torch.uint8)))
            offset += gap
        out.append(entry)
        offset += entry.nbytes
    return out


def _header(entries: Sequence[Entry], metadata: Mapping[str, str]) -> tuple[bytes, int]:
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for entry in entries:
        if entry.name in header:
            raise ValueError(f"two tensors named {entry.name!r} in one file")
        if entry.dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"tensor {entry.name!r} has dtype {entry.dtype}, which safetensors cannot store")
        header[entry.name] = {
            "dtype": SAFETENSORS_DTYPES[entry.dtype],
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % ALIGNMENT)
    return struct.pack("<Q", len(raw)) + raw, offset


def _preallocate(fd: int, nbytes: int) -> None:
    """Reserve the file's blocks: a full disk fails here, before any data is written."""
    if nbytes <= 0 or not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise


def write_file(path: Path, entries: Sequence[Entry], metadata: Mapping[str, str] | None = None,
               on_bytes: Callable[[int], None] | None = None) -> FileRecord:  # fmt: skip
    """Write ``entries`` as the safetensors file ``path``: temporary name, data, fsync, rename.

    Returns the file's size and checksums. On any failure the temporary file is
    removed and ``path`` is untouched; an `OSError` names the file.
    ``on_bytes(n)`` is called as data is handed to the disk (progress bars).
    """
    algorithm = default_algorithm()
    entries = _with_padding(entries)
    head, data_len = _header(entries, metadata or {})
    total = len(head) + data_len
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            _preallocate(fd, total)
            view = memoryview(head)
            while view:
                view = view[os.pwrite(fd, view, len(head) - len(view)) :]
            blocks = _stream_data(tmp, len(head), entries, data_len, algorithm, on_bytes)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.filename is None:  # posix_fallocate, fsync: say which file
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return FileRecord(
        bytes=total,
        data_offset=len(head),
        algorithm=algorithm,
        header_checksum=checksum_function(algorithm)(head),
        block_bytes=BLOCK_BYTES,
        blocks=tuple(blocks),
    )


def _as_bytes(tensor: torch.Tensor, entry: Entry) -> torch.Tensor:
    if tensor.dtype != entry.dtype or tensor.numel() != entry.numel:
        raise CheckpointError(
            f"tensor {entry.name!r} was announced as {entry.dtype} with {entry.numel} elements but its "
            f"source gave {tensor.dtype} with {tensor.numel()}"
        )
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8)


class _DataStream:
    """Writes the entries' bytes in file order: staged through buffers, or straight from host memory.

    [Note: direct writes] A host tensor whose address is congruent to its file
    offset modulo the page size (page-aligned shards written where a run starts
    on a page) is written from its own memory for all its whole checksum
    blocks; the bytes before its first block boundary and after its last go
    through a staging buffer, which is written out at that boundary. So every
    write starts on a block boundary, every block lies within one write, and
    each block is checksummed in the memory it is written from. Device tensors
    always go through the (page-locked) staging buffers: one download each.
    """

    def __init__(self, path: Path, data_offset: int, data_len: int, algorithm: str, on_bytes) -> None:
        self.path = path
        self.data_offset = data_offset
        self.io = BlockIO()
        self.pool = StagingPool(min(PIECE_BYTES, data_len))
        # writes in flight, in file order: (staging buffer or None, I/O token, checksum jobs, bytes, keepalive)
        self.in_flight: deque[tuple[torch.Tensor | None, int, list[Future], int, object]] = deque()
        self.checksum = checksum_function(algorithm)
        self.on_bytes = on_bytes
        self.sums: list[int] = []
        self.written = 0  # data bytes submitted so far
        self.buf: torch.Tensor | None = None
        self.fill = 0

    def put(self, src: torch.Tensor) -> None:
        total, pos = src.numel(), 0
        if src.device.type == "cpu" and total >= 2 * BLOCK_BYTES:
            at = self.written + self.fill
            head = -at % BLOCK_BYTES
            if (src.data_ptr() - self.data_offset - at) % ALIGNMENT == 0:
                self._stage(src[:head])
                if self.fill:
                    self._submit_staged()
                whole = (total - head) // BLOCK_BYTES * BLOCK_BYTES
                for lo in range(head, head + whole, PIECE_BYTES):
                    self._submit_direct(src[lo : min(lo + PIECE_BYTES, head + whole)])
                pos = head + whole
        self._stage(src[pos:])

    def _stage(self, src: torch.Tensor) -> None:
        pos, total = 0, src.numel()
        host = src.device.type == "cpu"
        while pos < total:
            if self.buf is None:
                self.buf, self.fill = self._acquire(), 0
            n = min(total - pos, self.buf.numel() - self.fill)
            if host:  # a plain memcpy; torch's copy_ is slower for bytes
                self.buf[self.fill : self.fill + n].numpy()[:] = src[pos : pos + n].numpy()
            else:
                self.buf[self.fill : self.fill + n].copy_(src[pos : pos + n])  # a download
            pos += n
            self.fill += n
            if self.fill == self.buf.numel():
                self._submit_staged()

    def finish(self) -> list[int]:
        if self.buf is not None and self.fill:
            self._submit_staged()
        while self.in_flight:
            self._collect_oldest()
        return self.sums

    def close(self) -> None:
        while self.in_flight:
            try:
                self._collect_oldest()
            except Exception:  # noqa: BLE001 - the first error is already being raised
                pass
        self.io.close()

    def _acquire(self) -> torch.Tensor:
        while self.pool.exhausted:
            self._collect_oldest()
        return self.pool.acquire()

    def _submit(self, data: torch.Tensor, staging: torch.Tensor | None) -> None:
        while len(self.in_flight) >= 2 * DEPTH:
            self._collect_oldest()
        nbytes = data.numel()
        view = memoryview(data.numpy())
        jobs = [checksum_pool().submit(self.checksum, view[i : i + BLOCK_BYTES]) for i in range(0, nbytes, BLOCK_BYTES)]
        token = self.io.submit_write(data, self.path, self.data_offset + self.written)
        self.in_flight.append((staging, token, jobs, nbytes, data))
        self.written += nbytes

    def _submit_staged(self) -> None:
        buf, fill = self.buf, self.fill
        self.buf, self.fill = None, 0
        self._submit(buf[:fill], buf)

    def _submit_direct(self, data: torch.Tensor) -> None:
        self._submit(data, None)

    def _collect_oldest(self) -> None:
        staging, token, jobs, nbytes, _ = self.in_flight.popleft()
        try:
            self.io.wait(token)
            self.sums.extend(job.result() for job in jobs)
        finally:
            if staging is not None:
                self.pool.release(staging)
        if self.on_bytes is not None:
            self.on_bytes(nbytes)


def _stream_data(path: Path, data_offset: int, entries: Sequence[Entry], data_len: int, algorithm: str,
                 on_bytes) -> list[int]:  # fmt: skip
    stream = _DataStream(path, data_offset, data_len, algorithm, on_bytes)
    try:
        for entry in entries:
            stream.put(_as_bytes(entry.source(), entry))
        return stream.finish()
    finally:
        stream.close()
