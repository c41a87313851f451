"""`zkernel.consolidate`: the full fp32 state dict of a checkpoint, without a process group.

One tensor at a time: each is assembled from the fragments of every rank file
that holds part of it (only those bytes are read, each checksum block
verified) and is then final. `consolidate` keeps the results (peak memory: the
output plus one tensor's staging); `consolidate_to_file` streams each one into
a safetensors file as soon as it is assembled (peak memory: about the largest
tensor), which is what ``zkernel consolidate DIR OUT.safetensors`` runs.

Trainable parameters come from their fp32 masters; frozen parameters and
buffers are floating-point values widened to fp32 (integer and boolean
buffers keep their dtype). Keys are the plain model's state-dict keys (less
the frozen parameters a save left out), tied parameters under each of their
names, and modules' extra state
(``get_extra_state``) as the module gave it; a safetensors file holds only
tensors, so there an extra state must be one.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from zkernel.checkpoint import extra_state
from zkernel.checkpoint.format import FORMAT, CheckpointError
from zkernel.checkpoint.model import BUFFER, EXTRA, PARAM
from zkernel.checkpoint.reader import CheckpointIndex, ReadBatch, open_checkpoint
from zkernel.checkpoint.range_reader import RangeReader
from zkernel.checkpoint.stream_writer import Entry, write_file
from zkernel.params.param_map import ParamMap


def _output_dtype(index: CheckpointIndex, kind: str, name: str) -> torch.dtype:
    dtype = index.dtype(name, kind)
    return torch.float32 if dtype.is_floating_point else dtype


def _keys(index: CheckpointIndex) -> list[tuple[str, str, str]]:
    """The state-dict keys with what holds each (frozen parameters left out of the checkpoint are not
    among them: [Note: frozen parameters left out] in `zkernel.checkpoint.save`)."""
    keys = [tuple(k) for k in index.manifest["state_dict"] if not (k[1] == PARAM and k[2] in index.excluded)]
    for key, kind, _ in keys:
        if kind == EXTRA and key not in index.extra_state:
            raise CheckpointError(f"checkpoint {index.dir}: state-dict key {key!r} is not stored")
    return keys


def _composition(index: CheckpointIndex) -> ParamMap:
    """The user's parameters a transform held as pieces ([Note: composed parameters] in `zkernel.params.param_map`)."""
    return ParamMap.from_json(index.manifest.get("composed", []))


def _read(index: CheckpointIndex, reader: RangeReader, kind: str, name: str) -> torch.Tensor:
    shape = index.shape(name, kind)
    out = torch.empty(shape, dtype=_output_dtype(index, kind, name))
    batch = ReadBatch(index)
    batch.add(name, "buffer" if kind == BUFFER else index.value_kind(name), 0, out.view(-1))
    batch.run(reader)
    return out


def _bar(total: int, enabled: bool | None, desc: str):
    from zkernel.telemetry.progress import progress

    return progress(total, desc, enabled=enabled)


def _nbytes(index: CheckpointIndex, kind: str, name: str) -> int:
    if kind == EXTRA:
        return index.extra_state[name]["bytes"]
    numel = 1
    for d in index.shape(name, kind):
        numel *= d
    return numel * torch.empty((), dtype=_output_dtype(index, kind, name)).element_size()


def consolidate(
    directory: str | os.PathLike, tag: str | None = None, *, progress: bool | None = None
) -> dict[str, torch.Tensor]:
    """The full state dict of checkpoint ``tag`` (default: the latest) in ``directory``, as CPU tensors.

    ``progress``: show a bar (None: on a terminal, see `zkernel.telemetry.progress`).
    """
    index = open_checkpoint(directory, tag)
    keys = _keys(index)
    unique = list(dict.fromkeys((kind, name) for _, kind, name in keys))
    made: dict[tuple[str, str], torch.Tensor] = {}
    with RangeReader() as reader, _bar(sum(_nbytes(index, *u) for u in unique), progress, "consolidate") as bar:
        for kind, name in unique:
            made[(kind, name)] = extra_state.read(index, reader, name) if kind == EXTRA else _read(index, reader, kind, name)
            bar.update(_nbytes(index, kind, name))
    return _composition(index).assemble({key: made[(kind, name)] for key, kind, name in keys})


def consolidate_to_file(
    directory: str | os.PathLike, out: str | os.PathLike, tag: str | None = None, *, progress: bool | None = None
) -> Path:
    """Write the full state dict of checkpoint ``tag`` to the safetensors file ``out``, one tensor at a time."""
    index = open_checkpoint(directory, tag)
    keys = _keys(index)
    path = Path(out)
    with RangeReader() as reader, _bar(sum(_nbytes(index, k, n) for _, k, n in keys), progress, "consolidate") as bar:
        extras = {key: extra_state.read(index, reader, key) for key, kind, _ in keys if kind == EXTRA}
        refused = sorted(key for key, value in extras.items() if not isinstance(value, torch.Tensor))
        if refused:
            raise CheckpointError(
                f"checkpoint {index.dir}: the extra state {refused[:3]} is not a tensor, and a safetensors file "
                "holds only tensors; zkernel.consolidate(directory) returns it with the rest"
            )
        keys = [(key, kind, name) for key, kind, name in keys if kind != EXTRA]
        composition = _composition(index)
        stored = {key: (kind, name) for key, kind, name in keys}
        entries, composed = [], set()
        for key, kind, name in keys:
            user, _ = composition.user_name(key)
            if user == key:
                entries.append(Entry(key, _output_dtype(index, kind, name), index.shape(name, kind),
                                     lambda kind=kind, name=name: _read(index, reader, kind, name)))  # fmt: skip
            elif user not in composed:  # the user's tensor, assembled from its pieces when written
                composed.add(user)
                param = composition.composed[user]
                pieces = [(p.name, stored[p.name]) for p in param.pieces]
                entries.append(Entry(user, _output_dtype(index, *pieces[0][1]), param.shape,
                                     lambda pieces=pieces, user=user: composition.assemble(
                                         {h: _read(index, reader, k, n) for h, (k, n) in pieces})[user]))  # fmt: skip
        entries += [Entry(key, value.dtype, tuple(value.shape), lambda v=value: v.contiguous()) for key, value in extras.items()]
        metadata = {"format": "pt", "source": FORMAT, "tag": index.tag}
        write_file(path, entries, metadata, on_bytes=bar.update)
    return path
