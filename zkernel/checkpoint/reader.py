"""Finding a checkpoint and reading any element range of any parameter from it.

`CheckpointIndex` answers "where are elements ``[a, b)`` of parameter ``p``
(its master, an optimizer state, its compute-dtype values, a buffer)" from the
manifest's fragments, whatever world size and partitioner wrote them. A
`ReadBatch` gathers such requests for one destination layout (a shard being
rebuilt, a parameter being consolidated) and reads them in one pass per file,
only the bytes needed, through `RangeReader`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from zkernel.checkpoint.checksum import checksum_function
from zkernel.checkpoint.format import (
    LATEST,
    MANIFEST,
    REPLACED,
    CheckpointError,
    INCOMPLETE,
    FileRecord,
    check_tag,
    entry_name,
    parse_dtype,
    rank_file,
)
from zkernel.checkpoint.range_reader import ByteRequest, RangeReader, VerifiedFile
from zkernel.checkpoint.sealed import read_latest, read_manifest
from zkernel.telemetry.log import get_logger

log = get_logger()


def resolve(root: Path, tag: str | None) -> Path:
    """The directory of checkpoint ``tag`` in ``root`` (``latest`` when None), or a `CheckpointError`."""
    named_by_latest = tag is None
    if named_by_latest:
        tag = read_latest(root, committed_tags(root))
    check_tag(tag)
    tag_dir = root / tag
    if (tag_dir / MANIFEST).exists():
        return tag_dir
    replaced = root / f"{tag}{REPLACED}"
    if (replaced / MANIFEST).exists():  # a save of the same tag died while committing
        log.warning("zkernel.checkpoint.replaced_used", path=str(replaced))
        return replaced
    if tag_dir.is_dir():
        return tag_dir  # read_manifest says what is missing
    unfinished = (root / f"{tag}{INCOMPLETE}").exists()
    raise CheckpointError(
        f"there is no checkpoint {tag!r} in {root}"
        + (f" (named by {root / LATEST})" if named_by_latest else "")
        + (" (a save of it did not complete)" if unfinished else "")
        + f"; committed checkpoints there: {committed_tags(root) or 'none'}"
    )


def committed_tags(root: Path) -> list[str]:
    """Tags with a manifest in ``root``; a ``<tag>.replaced`` whose ``<tag>`` is gone counts as ``<tag>``
    (a save of the same tag died while committing: `resolve` falls back to it, the next save renames it back)."""
    try:
        return sorted(
            {
                p.name.removesuffix(REPLACED)
                for p in root.iterdir()
                if not p.name.endswith(INCOMPLETE) and (p / MANIFEST).exists()
            }
        )
    except OSError:
        return []


def open_checkpoint(directory, tag: str | None) -> CheckpointIndex:
    tag_dir = resolve(Path(directory), tag)
    return CheckpointIndex(tag_dir, read_manifest(tag_dir))


class CheckpointIndex:
    """A committed checkpoint: its manifest, its files (opened and verified lazily)."""

    def __init__(self, tag_dir: Path, manifest: dict[str, Any]) -> None:
        self.dir = tag_dir
        self.manifest = manifest
        where = str(tag_dir / MANIFEST)
        self.records = {name: FileRecord.from_json(raw, f"{where}: file {name}") for name, raw in manifest["files"].items()}
        for record in self.records.values():
            checksum_function(record.algorithm)  # refuse an unknown algorithm up front
        self.params: dict[str, Any] = manifest["params"]
        self.buffers: dict[str, Any] = manifest["buffers"]
        self.extra_state: dict[str, Any] = manifest.get("extra_state", {})  # key -> {"bytes": n}
        # Frozen parameters save_checkpoint(exclude_frozen_parameters=True) left out: name -> {"shape", "dtype"}.
        self.excluded: dict[str, Any] = manifest.get("excluded_frozen", {})
        client = manifest.get("client_state")  # {"bytes": n}, or None where save_checkpoint was given none
        self.client_state_bytes: int | None = None if client is None else int(client["bytes"])
        self._files: dict[str, VerifiedFile] = {}

    @property
    def tag(self) -> str:
        return self.dir.name

    def file(self, rank: int) -> VerifiedFile:
        name = rank_file(rank)
        opened = self._files.get(name)
        if opened is None:
            record = self.records.get(name)
            if record is None:
                raise CheckpointError(f"checkpoint manifest {self.dir / MANIFEST} lists no file {name}")
            opened = self._files[name] = VerifiedFile(self.dir / name, record)
        return opened

    def shape(self, name: str, kind: str = "param") -> tuple[int, ...]:
        table = self.buffers if kind == "buffer" else self.params
        return tuple(table[name]["shape"])

    def dtype(self, name: str, kind: str = "param") -> torch.dtype:
        table = self.buffers if kind == "buffer" else self.params
        return parse_dtype(table[name]["dtype"], f"{self.dir / MANIFEST}: {name}")

    def value_kind(self, name: str) -> str:
        """Where a parameter's values are: its fp32 master ("master") or its stored values ("param")."""
        return self.params[name]["stored"]

    def fragments(self, name: str, kind: str) -> list[tuple[int, int, int]]:
        """(rank, start, numel) of each stored run of ``name``'s elements, in element order."""
        if kind == "extra":  # a module's serialised extra state, in rank 0's file
            return [(0, 0, self.extra_state[name]["bytes"])]
        if kind == "client":  # the user's client_state, in rank 0's file
            return [(0, 0, self.client_state_bytes or 0)]
        if kind == "buffer":
            shape = self.shape(name, "buffer")
            numel = 1
            for d in shape:
                numel *= d
            return [(0, 0, numel)]
        return [tuple(f) for f in self.params[name]["fragments"]]


class ReadBatch:
    """Requests for parameter element ranges into destination tensors, read together by `run`."""

    def __init__(self, index: CheckpointIndex) -> None:
        self.index = index
        self.requests: list[ByteRequest] = []
        self.after: list[Callable[[], None]] = []

    def add(self, name: str, kind: str, start: int, out: torch.Tensor) -> None:
        """Elements ``[start, start + out.numel())`` of ``kind`` of ``name`` into ``out`` (1-D, CPU).

        ``kind``: "master", "state.<name>", "param" or "buffer"; values are cast to ``out``'s dtype.
        """
        end, at = start + out.numel(), start
        for rank, f_start, f_numel in self.index.fragments(name, kind):
            lo, hi = max(start, f_start), min(end, f_start + f_numel)
            if lo >= hi:
                continue
            if lo != at:
                break
            info = self.index.file(rank).tensor(entry_name(kind, name, f_start))
            itemsize = torch.empty((), dtype=info.dtype).element_size()
            if info.end - info.begin != f_numel * itemsize:
                raise CheckpointError(
                    f"checkpoint file {self.index.file(rank).path}: tensor {entry_name(kind, name, f_start)} has "
                    f"{(info.end - info.begin) // itemsize} elements, the manifest says {f_numel}"
                )
            target = out[lo - start : hi - start]
            if target.dtype == info.dtype:
                dest = target.view(torch.uint8)
            else:
                landing = torch.empty(hi - lo, dtype=info.dtype)
                dest = landing.view(torch.uint8)
                self.after.append(lambda t=target, s=landing: t.copy_(s))
            self.requests.append(ByteRequest(self.index.file(rank), info.begin + (lo - f_start) * itemsize, dest))
            at = hi
        if at != end:
            raise CheckpointError(
                f"checkpoint {self.index.dir} has no {kind} for elements {at}-{end - 1} of {name!r}"
            )

    def run(self, reader: RangeReader) -> None:
        reader.read(self.requests)
        for finish in self.after:
            finish()
        self.requests, self.after = [], []
