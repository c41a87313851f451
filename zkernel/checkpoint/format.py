"""The on-disk format: names, file records, atomic file replacement (the manifest is read in `sealed`).

Layout of a checkpoint directory (see the package docstring for what each file holds)::

    DIR/latest                         the tag of the newest committed checkpoint
    DIR/latest.checksum                the sealed list of tags ``latest`` may hold (`zkernel.checkpoint.sealed`)
    DIR/<tag>/manifest.json            written last: the commit point; its first line its own checksum
    DIR/<tag>/rank00000.safetensors    one file per saving rank
    DIR/<tag>.incomplete/              a save in progress (a leftover one: a save that died)
    DIR/<tag>.replaced/                the previous <tag> while a save of the same tag commits
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import attrs
import torch

FORMAT = "zkernel-checkpoint"
# 2: the manifest carries its own checksum ([Note: sealed JSON] in `zkernel.checkpoint.sealed`).
FORMAT_VERSION = 2
UNSEALED_VERSIONS = (1,)  # older versions still read, without that checksum
MANIFEST = "manifest.json"
LATEST = "latest"
LATEST_CHECKSUM = "latest.checksum"
INCOMPLETE = ".incomplete"
REPLACED = ".replaced"
# File offsets of tensor data are multiples of this, so reads and writes can bypass the page cache.
ALIGNMENT = 4096

TAG_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,199}")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message names the file and what is wrong."""


class NoCheckpoint(CheckpointError):
    """The directory holds no ``latest`` file (or is not there): nothing was saved to it yet.
    `Engine.load_checkpoint` warns and returns None for it, as DeepSpeed's; `zkernel.consolidate` raises."""


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def entry_name(kind: str, param: str, start: int) -> str:
    """Name of a tensor in a rank file: ``kind`` ("master", "state.<name>", "param", "buffer"),
    the parameter or buffer name, and the first element it holds."""
    return f"{kind}/{param}/{start}"


def check_tag(tag: str) -> str:
    if (
        not isinstance(tag, str)
        or not TAG_PATTERN.fullmatch(tag)
        or tag in (LATEST, LATEST_CHECKSUM)
        or tag.endswith((INCOMPLETE, REPLACED))
    ):
        raise CheckpointError(
            f"checkpoint tag {tag!r} is not valid: use letters, digits and _ . + - (not starting with . "
            f"or -, at most 200 characters), not {LATEST!r} or {LATEST_CHECKSUM!r}, and not ending in "
            f"{INCOMPLETE!r} or {REPLACED!r}"
        )
    return tag


# -- dtypes ------------------------------------------------------------------------------

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"),
                     ("uint32", "U32"), ("uint64", "U64")):  # fmt: skip
    if hasattr(torch, _name):
        SAFETENSORS_DTYPES[getattr(torch, _name)] = _code
TORCH_DTYPES = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: Any, where: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{where}: {name!r} is not a torch dtype")
    return dtype


# -- atomic replacement ----------------------------------------------------------------------


def fsync_dir(path: Path) -> None:
    """Make a rename or file creation in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``: temporary name, fsync, rename, directory fsync.

    Readers see the old file or the new one, never a mix; on failure the
    temporary file is removed and the old file is untouched.
    """
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@attrs.frozen
class FileRecord:
    """What the manifest keeps about one file: its size and checksums."""

    bytes: int
    data_offset: int  # where the tensor data starts (the header before it is checksummed alone)
    algorithm: str  # see `zkernel.checkpoint.checksum`
    header_checksum: int
    block_bytes: int
    blocks: tuple[int, ...]  # checksums of the data region, block by block

    def to_json(self) -> dict[str, Any]:
        return {
            "bytes": self.bytes,
            "algorithm": self.algorithm,
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
                algorithm=str(raw["algorithm"]),
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
