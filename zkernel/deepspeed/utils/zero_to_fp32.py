"""DeepSpeed's ``zero_to_fp32`` over zkernel checkpoints: a whole fp32 state dict, offline, on the CPU.

A checkpoint ``engine.save_checkpoint(checkpoint_dir)`` wrote (any world size,
partitioner or offload tier) is read by `zkernel.consolidate`, which needs no
process group and no GPU: each tensor is assembled from the fragments of the
rank files that hold it. ``tag`` is a checkpoint's directory name in
``checkpoint_dir`` (``global_step<N>`` as `DeepSpeedEngine.save_checkpoint`
names them); without it, the one the ``latest`` file names. Trainable
parameters come from their fp32 masters; frozen parameters and floating-point
buffers are widened to fp32 (integer buffers keep their dtype); keys are the
plain model's, tied parameters under each name.

    python -m zkernel.deepspeed.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT [-t TAG] [--safe_serialization]
        [--max_shard_size 5GB] [--exclude_frozen_parameters]

OUTPUT is a directory (``pytorch_model.bin``, or ``model.safetensors`` with
``--safe_serialization``, sharded with an index beyond ``--max_shard_size``, as
DeepSpeed's converter writes) or a file name ending in ``.bin``, ``.pt``,
``.pth`` or ``.safetensors`` (one file, as DeepSpeed's older converter took).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from torch import nn

from zkernel.checkpoint import consolidate
from zkernel.checkpoint.model import PARAM
from zkernel.checkpoint.reader import open_checkpoint
from zkernel.deepspeed.model_file import SAFETENSORS, parse_size, write_sharded, write_state_dict
from zkernel.telemetry.log import get_logger

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
]

log = get_logger()

_FILE_SUFFIXES = (".bin", ".pt", ".pth", SAFETENSORS)


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike, tag: str | None = None, exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> dict[str, torch.Tensor]:
    """The whole fp32 state dict of checkpoint ``tag`` (default: the one ``latest`` names) in
    ``checkpoint_dir``, CPU tensors with the plain model's keys, for ``model.load_state_dict``.
    ``exclude_frozen_parameters`` leaves out parameters that did not require grad. ``lazy_mode`` is
    accepted for DeepSpeed's signature; the tensors are read at once either way."""
    del lazy_mode  # DeepSpeed's lazy tensors are a memory saving; consolidate holds one tensor's staging at a time
    state = consolidate(checkpoint_dir, tag, progress=False)
    if exclude_frozen_parameters:
        frozen = _frozen_keys(checkpoint_dir, tag)
        state = {k: v for k, v in state.items() if k not in frozen}
    return state


def load_state_dict_from_zero_checkpoint(
    model: nn.Module, checkpoint_dir: str | os.PathLike, tag: str | None = None
) -> nn.Module:
    """Move ``model`` to the CPU and load the checkpoint's fp32 state dict into it (``strict=False``, as
    DeepSpeed's); returns the model. A model an engine still holds is refused: close the engine first."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    log.info("zkernel.deepspeed.zero_to_fp32.load", tensors=len(state), checkpoint=str(checkpoint_dir), tag=tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | os.PathLike, output_dir_or_file: str | os.PathLike, max_shard_size: int | str | None = "5GB",
    safe_serialization: bool = False, tag: str | None = None, exclude_frozen_parameters: bool = False,
) -> list[Path]:
    """Write the checkpoint's whole fp32 state dict for ``torch.load`` + ``load_state_dict`` (or
    safetensors' ``load_file``). ``output_dir_or_file``: a directory, given ``pytorch_model.bin`` (or
    ``model.safetensors`` with ``safe_serialization``), split into shards of at most ``max_shard_size``
    (None: one file) with an index, as DeepSpeed's converter writes; or a file name ending in
    ``.bin``/``.pt``/``.pth``/``.safetensors``, written whole in the format its suffix names. Returns
    the files written."""
    out = Path(output_dir_or_file)
    limit = parse_size(max_shard_size) if max_shard_size is not None else None
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    if out.suffix in _FILE_SUFFIXES and not out.is_dir():
        written = [write_state_dict(state, out)]
    else:
        name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
        written = write_sharded(state, out, name, limit)
    log.info("zkernel.deepspeed.zero_to_fp32.written", files=[str(p) for p in written], tensors=len(state))
    return written


def _frozen_keys(checkpoint_dir, tag: str | None) -> set[str]:
    """State-dict keys of parameters the checkpoint holds as frozen values (no fp32 master)."""
    index = open_checkpoint(checkpoint_dir, tag)
    return {key for key, kind, name in index.manifest["state_dict"]
            if kind == PARAM and name not in index.excluded and index.value_kind(name) != "master"}  # fmt: skip


def main(argv: list[str] | None = None) -> list[Path]:
    """The command line, as DeepSpeed's ``zero_to_fp32.py``; returns the files written."""
    parser = argparse.ArgumentParser(
        prog="python -m zkernel.deepspeed.utils.zero_to_fp32",
        description="Write the whole fp32 state dict of a zkernel checkpoint (engine.save_checkpoint) for "
        "torch.load + load_state_dict, on the CPU, without a process group.",
    )
    add = parser.add_argument
    add("checkpoint_dir", help="the directory save_checkpoint wrote (holding 'latest' and the tags)")
    add("output_dir", help="a directory, or a file name ending in .bin, .pt, .pth or .safetensors")
    add("--max_shard_size", default="5GB", help="largest shard in a directory output (default 5GB)")
    add("--safe_serialization", action="store_true", help="write model.safetensors in a directory output")
    add("-t", "--tag", default=None, help="the checkpoint to read, e.g. global_step14 (default: latest)")
    add("--exclude_frozen_parameters", action="store_true", help="leave out parameters that did not train")
    add("-d", "--debug", action="store_true", help="accepted for DeepSpeed's command line; no effect")
    args = parser.parse_args(argv)
    return convert_zero_checkpoint_to_fp32_state_dict(
        args.checkpoint_dir, args.output_dir, max_shard_size=args.max_shard_size,
        safe_serialization=args.safe_serialization, tag=args.tag,
        exclude_frozen_parameters=args.exclude_frozen_parameters,
    )  # fmt: skip


if __name__ == "__main__":
    main()
