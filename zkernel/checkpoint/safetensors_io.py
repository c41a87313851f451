"""safetensors files written as a stream and read by verified byte ranges.

The files are plain safetensors (an 8-byte little-endian header length, a JSON
header, then the tensors' bytes back to back), readable by
``safetensors.safe_open`` and ``safetensors.torch.load_file``. They are written
here rather than with ``safetensors.torch.save_file`` because that serialises
every tensor to a Python ``bytes`` object first: a rank's whole shard (or a
whole consolidated model) in memory twice, and no overlap with the disk.
`write_file` knows every tensor's size up front, so it writes the header first
and then streams each tensor, produced only when its turn comes, through the
staging buffers of `zkernel.checkpoint.blockio`. The header is padded with
spaces (allowed by the format) so the data starts on a page boundary.

`RangeReader` reads byte ranges of a file's data instead of the whole file,
rounding them out to checksum blocks and verifying each block it read, so a
rank that re-shards on load reads only what it needs and still never trusts an
unchecked byte.
"""

from __future__ import annotations

import errno
import json
import os
import struct
from collections import deque
from concurrent.futures import Future
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from zkernel.checkpoint.blockio import DEPTH, PIECE_BYTES, BlockIO, StagingRing, checksum_pool, host_buffer
from zkernel.checkpoint.checksum import ALGORITHM, BLOCK_BYTES, checksum_function
from zkernel.checkpoint.format import ALIGNMENT, SAFETENSORS_DTYPES, TORCH_DTYPES, CheckpointError, fsync_dir


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


@attrs.frozen
class FileRecord:
    """What the manifest keeps about one file: its size and checksums."""

    bytes: int
    data_offset: int  # where the tensor data starts (the header before it is checksummed alone)
    header_checksum: int
    block_bytes: int
    blocks: tuple[int, ...]  # checksums of the data region, block by block

    def to_json(self) -> dict[str, Any]:
        return {
            "bytes": self.bytes,
            "data_offset": self.data_offset,
            "header_checksum": self.header_checksum,
            "block_bytes": self.block_bytes,
            "blocks": list(self.blocks),
        }

    @classmethod
    def from_json(cls, raw: Any, where: str) -> FileRecord:
        try:
            record = cls(
                bytes=int(raw["bytes"]),
                data_offset=int(raw["data_offset"]),
                header_checksum=int(raw["header_checksum"]),
                block_bytes=int(raw["block_bytes"]),
                blocks=tuple(int(b) for b in raw["blocks"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{where}: damaged file record ({exc!r})") from None
        data = record.bytes - record.data_offset
        if record.block_bytes <= 0 or data < 0 or len(record.blocks) != -(-data // record.block_bytes):
            raise CheckpointError(f"{where}: damaged file record (sizes and block count disagree)")
        return record


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
            blocks = _stream_data(tmp, len(head), entries, data_len, on_bytes)
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
    checksum = checksum_function(ALGORITHM)
    return FileRecord(
        bytes=total,
        data_offset=len(head),
        header_checksum=checksum(head),
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

    def __init__(self, path: Path, data_offset: int, data_len: int, on_bytes) -> None:
        self.path = path
        self.data_offset = data_offset
        self.io = BlockIO()
        self.size = max(1, min(PIECE_BYTES, data_len))
        self.free: list[torch.Tensor | None] = [None] * DEPTH  # staging buffers, allocated on first use
        # writes in flight, in file order: (staging buffer or None, I/O token, checksum jobs, bytes, keepalive)
        self.in_flight: deque[tuple[torch.Tensor | None, int, list[Future], int, object]] = deque()
        self.checksum = checksum_function(ALGORITHM)
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
        while not self.free:
            self._collect_oldest()
        buf = self.free.pop()
        return buf if buf is not None else host_buffer(self.size)

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
                self.free.append(staging)
        if self.on_bytes is not None:
            self.on_bytes(nbytes)


def _stream_data(path: Path, data_offset: int, entries: Sequence[Entry], data_len: int, on_bytes) -> list[int]:
    stream = _DataStream(path, data_offset, data_len, on_bytes)
    try:
        for entry in entries:
            stream.put(_as_bytes(entry.source(), entry))
        return stream.finish()
    finally:
        stream.close()


# -- reading -----------------------------------------------------------------------------------


@attrs.frozen
class TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # byte offsets within the data region
    end: int


class VerifiedFile:
    """One file of a checkpoint: size checked against the manifest, header read and verified."""

    def __init__(self, path: Path, record: FileRecord, algorithm: str) -> None:
        self.path = path
        self.record = record
        self.checksum = checksum_function(algorithm)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint file {path} is missing") from None
        if size != record.bytes:
            raise CheckpointError(
                f"checkpoint file {path} is {size} bytes but the manifest says {record.bytes}: it was "
                "truncated or replaced"
            )
        with open(path, "rb") as f:
            head = f.read(record.data_offset)
        if len(head) != record.data_offset or self.checksum(head) != record.header_checksum:
            raise CheckpointError(f"checksum mismatch in the header of checkpoint file {path}: the file is damaged")
        self.tensors = _parse_header(head, path)

    @property
    def data_len(self) -> int:
        return self.record.bytes - self.record.data_offset

    def tensor(self, name: str) -> TensorInfo:
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"checkpoint file {self.path} has no tensor {name!r}, which the manifest lists")
        return info


def _parse_header(head: bytes, path: Path) -> dict[str, TensorInfo]:
    try:
        (n,) = struct.unpack("<Q", head[:8])
        header = json.loads(head[8 : 8 + n])
        tensors = {}
        for name, spec in header.items():
            if name == "__metadata__":
                continue
            begin, end = (int(x) for x in spec["data_offsets"])
            tensors[name] = TensorInfo(TORCH_DTYPES[spec["dtype"]], tuple(int(d) for d in spec["shape"]), begin, end)
        return tensors
    except (ValueError, KeyError, TypeError, struct.error) as exc:
        raise CheckpointError(f"checkpoint file {path} has a damaged header ({exc!r})") from None


@attrs.frozen
class ByteRequest:
    """Bytes ``[begin, begin + dest.numel())`` of a file's data region, into ``dest`` (uint8, CPU, contiguous)."""

    file: VerifiedFile
    begin: int
    dest: torch.Tensor

    @property
    def end(self) -> int:
        return self.begin + self.dest.numel()


@attrs.frozen
class _Piece:
    """Blocks ``[first, last)`` of a file read in one I/O: into ``direct`` (a slice of one request's
    destination, page-aligned) or into a staging buffer shared out to ``requests``."""

    first: int
    last: int
    direct: torch.Tensor | None
    requests: tuple[ByteRequest, ...]


class RangeReader:
    """Reads byte ranges of checkpoint files, verifying every checksum block it reads.

    [Note: direct reads] A block that lies wholly inside one request whose
    destination is page-aligned at that block is read straight into the
    destination (O_DIRECT with the native engine) and checksummed there; only
    blocks shared between requests or cut by a request's ends go through a
    staging buffer and a copy. Files are written with each run of a group's
    tensors starting on a page boundary and loads read into page-aligned
    buffers, so when the layout did not change almost every byte lands
    directly; after re-sharding, whatever is misaligned is staged.
    """

    def __init__(self) -> None:
        self.io = BlockIO()

    def close(self) -> None:
        self.io.close()

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read(self, requests: Iterable[ByteRequest]) -> None:
        by_file: dict[Path, list[ByteRequest]] = {}
        for request in requests:
            if request.dest.numel():
                by_file.setdefault(request.file.path, []).append(request)
        for reqs in by_file.values():
            self._read_file(reqs[0].file, sorted(reqs, key=lambda r: r.begin))

    def _pieces(self, file: VerifiedFile, reqs: list[ByteRequest]) -> list[_Piece]:
        block, data_len = file.record.block_bytes, file.data_len
        per_piece = max(1, PIECE_BYTES // block)
        touching: dict[int, list[ByteRequest]] = {}
        for request in reqs:
            if request.begin < 0 or request.end > data_len:
                raise CheckpointError(f"checkpoint file {file.path}: a tensor lies outside the file's data")
            for b in range(request.begin // block, -(-request.end // block)):
                touching.setdefault(b, []).append(request)
        aligned_file = file.record.data_offset % ALIGNMENT == 0

        def direct_for(b: int) -> ByteRequest | None:
            (request, *others) = touching[b]
            lo, hi = b * block, min((b + 1) * block, data_len)
            if others or lo < request.begin or hi > request.end or not aligned_file:
                return None
            return request if (request.dest.data_ptr() + lo - request.begin) % ALIGNMENT == 0 else None

        pieces: list[_Piece] = []
        run: list[int] = []
        run_owner: ByteRequest | None = None

        def flush() -> None:
            if not run:
                return
            first, last = run[0], run[-1] + 1
            if run_owner is not None:
                lo, hi = first * block, min(last * block, data_len)
                dest = run_owner.dest[lo - run_owner.begin : hi - run_owner.begin]
                pieces.append(_Piece(first, last, dest, (run_owner,)))
            else:
                owners = {id(r): r for b in run for r in touching[b]}
                pieces.append(_Piece(first, last, None, tuple(owners.values())))
            run.clear()

        for b in sorted(touching):
            owner = direct_for(b)
            contiguous = run and run[-1] + 1 == b
            if not contiguous or owner is not run_owner or len(run) == per_piece:
                flush()
                run_owner = owner
            run.append(b)
        flush()
        return pieces

    def _read_file(self, file: VerifiedFile, reqs: list[ByteRequest]) -> None:
        block, data_len = file.record.block_bytes, file.data_len
        pieces = self._pieces(file, reqs)
        largest = max((min(p.last * block, data_len) - p.first * block for p in pieces if p.direct is None), default=0)
        ring = StagingRing(self.io, largest)
        # (piece, the tensor read into, its staging buffer or None, I/O token)
        in_flight: deque[tuple[_Piece, torch.Tensor, torch.Tensor | None, int]] = deque()

        def finish_oldest() -> None:
            piece, target, staging, token = in_flight.popleft()
            self.io.wait(token)
            self._verify_and_copy(file, piece, target)
            if staging is not None:
                ring.release(staging)

        try:
            for piece in pieces:
                if len(in_flight) >= DEPTH or (piece.direct is None and ring.full):
                    finish_oldest()
                    while piece.direct is None and ring.full:
                        finish_oldest()
                lo, hi = piece.first * block, min(piece.last * block, data_len)
                staging = None if piece.direct is not None else ring.acquire()
                target = piece.direct if staging is None else staging[: hi - lo]
                token = self.io.submit_read(target, file.path, file.record.data_offset + lo)
                in_flight.append((piece, target, staging, token))
            while in_flight:
                finish_oldest()
        except BaseException:
            for _, _, _, token in in_flight:
                try:
                    self.io.wait(token)
                except Exception:  # noqa: BLE001 - the first error is already being raised
                    pass
            raise

    @staticmethod
    def _verify_and_copy(file: VerifiedFile, piece: _Piece, buf: torch.Tensor) -> None:
        block = file.record.block_bytes
        lo = piece.first * block
        view = memoryview(buf.numpy())
        starts = range(0, len(view), block)
        sums = list(checksum_pool().map(file.checksum, [view[s : s + block] for s in starts]))
        for i, (s, got) in enumerate(zip(starts, sums)):
            expected = file.record.blocks[piece.first + i]
            if got != expected:
                a = lo + s
                raise CheckpointError(
                    f"checksum mismatch in checkpoint file {file.path}: data bytes {a}-{a + min(block, len(view) - s) - 1} "
                    f"(block {piece.first + i}) checksum to {got:#010x}, the manifest says {expected:#010x}; the "
                    "file is damaged"
                )
        if piece.direct is not None:
            return
        hi = lo + len(view)
        for request in piece.requests:
            a, b = max(request.begin, lo), min(request.end, hi)
            if a < b:
                request.dest[a - request.begin : b - request.begin].copy_(buf[a - lo : b - lo])
