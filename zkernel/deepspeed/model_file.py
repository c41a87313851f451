"""A whole model's state dict as one file (or shards of one), written the way DeepSpeed's tools write it.

Used by `DeepSpeedEngine.save_16bit_model` (the compute-dtype weights of a live
engine) and `zkernel.deepspeed.utils.zero_to_fp32` (the fp32 weights of a
checkpoint). A file is a ``torch.save`` pickle (``pytorch_model.bin``) or, where
its name ends in ``.safetensors``, a safetensors file (tensors that share
storage, as tied weights do, are written as copies: the format refuses
shared tensors). Sharded output follows the Hugging Face layout DeepSpeed's
converter writes: ``<stem>-00001-of-0000N<suffix>`` files and an index
``<name>.index.json`` mapping each key to its file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

SAFETENSORS = ".safetensors"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def sixteen_bit_state_dict(engine, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
    """Collective: on rank 0, the engine's full state dict with floating-point tensors in its compute
    dtype (what the model computes with; `Engine.state_dict` gives the dtypes the model had); ``{}`` on
    the other ranks. ``exclude_frozen_parameters`` leaves out parameters that do not require grad."""
    state = engine.state_dict(rank0_only=True, exclude_frozen_parameters=exclude_frozen_parameters)
    dtype = engine.compute_dtype
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in state.items()}


def parse_size(size: int | str) -> int:
    """Bytes of ``size``: an int, or digits with a unit as DeepSpeed's converter takes them (``"5GB"``,
    ``"500MB"``, ``"1GiB"``); anything else is a `ValueError` saying what is valid."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(size).upper())
    if match is None or match.group(2) not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"max_shard_size {size!r} is not a size; valid: a positive number of bytes or digits "
                         "with a unit, e.g. 5GB, 500MB, 2GiB")  # fmt: skip
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def write_state_dict(state: dict[str, Any], path: Path) -> Path:
    """Write ``state`` to the file ``path`` (safetensors by its suffix, else ``torch.save``); returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == SAFETENSORS:
        from safetensors.torch import save_file

        save_file(_unshared(state), str(path), metadata={"format": "pt"})
    else:
        torch.save(state, path)
    return path


def write_sharded(
    state: dict[str, torch.Tensor], directory: Path, name: str, max_shard_bytes: int | None
) -> list[Path]:
    """Write ``state`` into ``directory`` as ``name`` (one file), or, where it holds more than
    ``max_shard_bytes``, as shards of at most that size (a larger tensor alone in its shard) with the
    index file; returns the files written (the index last)."""
    directory = Path(directory)
    groups = _split(state, max_shard_bytes) if max_shard_bytes else [list(state)]
    if len(groups) <= 1:
        return [write_state_dict(state, directory / name)]
    stem, suffix = name[: -len(Path(name).suffix)], Path(name).suffix
    written, weight_map = [], {}
    for i, keys in enumerate(groups, 1):
        file = f"{stem}-{i:05d}-of-{len(groups):05d}{suffix}"
        written.append(write_state_dict({k: state[k] for k in keys}, directory / file))
        weight_map.update(dict.fromkeys(keys, file))
    total = sum(_nbytes(v) for v in state.values())
    index = directory / f"{name}.index.json"
    content = {"metadata": {"total_size": total}, "weight_map": weight_map}
    index.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
    return [*written, index]


def on_rank0(info, write: Callable[[], None], what: str) -> None:
    """Collective: run ``write`` on rank 0 and tell every rank how it went, so a failure raises on all
    of them (a `RuntimeError` naming ``what`` and rank 0's error) instead of leaving them waiting."""
    error = None
    if info.rank == 0:
        try:
            write()
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it
            error = exc
    if info.distributed:
        box = [None if error is None else f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(box, src=0, device=info.device if dist.get_backend() == "nccl" else None)
        if box[0] is not None and error is None:
            raise RuntimeError(f"{what} on rank 0: {box[0]}")
    if error is not None:
        raise error


def _nbytes(value) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _split(state: dict[str, torch.Tensor], limit: int) -> list[list[str]]:
    groups: list[list[str]] = [[]]
    size = 0
    for key, value in state.items():
        nbytes = _nbytes(value)
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += nbytes
    return groups


def _unshared(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``state``'s tensors, contiguous, a copy of each one whose storage an earlier one already uses."""
    seen: set[int] = set()
    out = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{key!r} is a {type(value).__name__}: a safetensors file holds only tensors")
        value = value.detach().contiguous()
        ptr = value.untyped_storage().data_ptr()
        if ptr in seen and value.numel():
            value = value.clone()
        seen.add(value.untyped_storage().data_ptr())
        out[key] = value
    return out
