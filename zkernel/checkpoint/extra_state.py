"""Modules' extra state (``get_extra_state``) in a checkpoint: serialised by rank 0, restored on every rank.

[Note: extra state] A module that overrides ``get_extra_state`` puts a value that is neither a
parameter nor a buffer into the state dict under ``<module>._extra_state``
(an FP8 recipe's scaling history, a tokenizer's vocabulary, a step counter).
Rank 0 serialises each with ``torch.save`` into a byte tensor that its rank
file stores like any other entry (``extra/<key>/0``: checksummed, committed
with the rest), and the manifest lists the keys and sizes (``extra_state``).
Every rank reads them back whatever the world size, before it changes
anything else, and hands each to its module's ``set_extra_state`` once the
tensors are in. Values are loaded with ``weights_only=True``: tensors,
containers and primitive values load as they are; any other class must be
allowed first with ``torch.serialization.add_safe_globals``, since loading it
would run code from the file.
"""

from __future__ import annotations

import io
import pickle
import re
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _EXTRA_STATE_KEY_SUFFIX

from zkernel.checkpoint.format import CheckpointError
from zkernel.checkpoint.reader import ReadBatch

KIND = "extra"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # torch's message makes a phrase bold for a terminal


def serialize(key: str, value: Any, what: str | None = None) -> torch.Tensor:
    """``value`` as a byte tensor (what ``torch.save`` writes); ``what`` names it in an error (default:
    the extra state under ``key``)."""
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
    except Exception as exc:  # noqa: BLE001 - name the key, whatever failed
        what = what or f"the extra state {key!r} (get_extra_state of its module)"
        raise CheckpointError(f"{what} cannot be serialised with torch.save: {exc}") from exc
    return torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)


def deserialize(
    key: str, data: torch.Tensor, where: str, device: torch.device | None = None, what: str | None = None
) -> Any:
    """The value `serialize` stored (``data``: its bytes), loaded with ``weights_only=True``; tensors
    rank 0 kept on a GPU land on ``device`` (this rank's), or in host memory where it is None."""

    def place(storage, location: str):
        if location.startswith("cuda"):
            return storage.to(device=device) if device is not None and device.type == "cuda" else storage
        return None  # where it was saved

    try:
        return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True, map_location=place)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"checkpoint {where}: {what or f'the extra state {key!r}'} holds an object that weights_only loading refuses, "
            "since loading it would run code from the file. If you trust the checkpoint, allow its classes with "
            f"torch.serialization.add_safe_globals([...]) before loading. torch: {_first_line(exc)}"
        ) from exc


def _first_line(exc: BaseException) -> str:
    return _ANSI.sub("", str(exc).splitlines()[0])


def read(index, reader, key: str, device: torch.device | None = None) -> Any:
    """The extra state stored under ``key`` in checkpoint ``index`` (a `CheckpointIndex`), read through
    ``reader`` (a `RangeReader`; its checksums verified) and deserialised as `deserialize` does."""
    data = torch.empty(index.extra_state[key]["bytes"], dtype=torch.uint8)
    batch = ReadBatch(index)
    batch.add(key, KIND, 0, data)
    batch.run(reader)
    return deserialize(key, data, str(index.dir), device)


def owner(root: nn.Module, key: str) -> nn.Module:
    """The module whose ``set_extra_state`` takes the value stored under state-dict ``key``."""
    if not key.endswith(_EXTRA_STATE_KEY_SUFFIX):
        raise CheckpointError(f"state-dict key {key!r} is neither a parameter, a buffer, nor a module's extra state")
    path = key[: -len(_EXTRA_STATE_KEY_SUFFIX)].rstrip(".")
    return root.get_submodule(path) if path else root


def restore(root: nn.Module, values: dict[str, Any]) -> None:
    for key, value in values.items():
        owner(root, key).set_extra_state(value)
