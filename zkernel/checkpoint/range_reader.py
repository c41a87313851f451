"""Reading byte ranges of checkpoint files, every byte verified against the manifest's checksums.

A rank that re-shards on load, or `zkernel.consolidate` assembling one
parameter, reads only the ranges it needs: `RangeReader` rounds them out to
checksum blocks, reads those (see [Note: direct reads]) and verifies each block
before any byte is used. `VerifiedFile` checks a file's size and header first.
"""

from __future__ import annotations

import json
import struct
from collections import deque
from collections.abc import Iterable
from pathlib import Path

import attrs
import torch

from zkernel.checkpoint.blockio import DEPTH, PIECE_BYTES, BlockIO, StagingPool, checksum_pool
from zkernel.checkpoint.checksum import checksum_function
from zkernel.checkpoint.format import ALIGNMENT, TORCH_DTYPES, CheckpointError, FileRecord


@attrs.frozen
class TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # byte offsets within the data region
    end: int


class VerifiedFile:
    """One file of a checkpoint: size checked against the manifest, header read and verified."""

    def __init__(self, path: Path, record: FileRecord) -> None:
        self.path = path
        self.record = record
        self.checksum = checksum_function(record.algorithm)
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
        if 8 + n != len(head):
            raise ValueError(f"header length {n} does not end where the manifest says the data starts")
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
        self._pool: StagingPool | None = None  # kept across reads: page-locking buffers is slow

    def close(self) -> None:
        self.io.close()
        self._pool = None

    def _staging(self, largest: int) -> StagingPool:
        if self._pool is None or self._pool.size < largest:
            self._pool = StagingPool(PIECE_BYTES if largest > PIECE_BYTES // 4 else largest)
        return self._pool

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
        pool = self._staging(largest)
        # (piece, the tensor read into, its staging buffer or None, I/O token)
        in_flight: deque[tuple[_Piece, torch.Tensor, torch.Tensor | None, int]] = deque()

        def finish_oldest() -> None:
            piece, target, staging, token = in_flight.popleft()
            try:
                self.io.wait(token)
                self._verify_and_copy(file, piece, target)
            finally:
                if staging is not None:
                    pool.release(staging)

        try:
            for piece in pieces:
                if len(in_flight) >= DEPTH or (piece.direct is None and pool.exhausted):
                    finish_oldest()
                    while piece.direct is None and pool.exhausted:
                        finish_oldest()
                lo, hi = piece.first * block, min(piece.last * block, data_len)
                staging = None if piece.direct is not None else pool.acquire()
                target = piece.direct if staging is None else staging[: hi - lo]
                token = self.io.submit_read(target, file.path, file.record.data_offset + lo)
                in_flight.append((piece, target, staging, token))
            while in_flight:
                finish_oldest()
        except BaseException:
            for _, _, staging, token in in_flight:
                try:
                    self.io.wait(token)
                except Exception:  # noqa: BLE001 - the first error is already being raised
                    pass
                if staging is not None:
                    pool.release(staging)
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
