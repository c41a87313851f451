"""One ordinary Lightning checkpoint file from a checkpoint directory `ZKernelStrategy` wrote.

``trainer.save_checkpoint(path)`` under ZKernelStrategy writes a zkernel checkpoint
directory: each rank's shards, and Lightning's own state (epoch, global step,
loops, callbacks, lr schedulers, hyperparameters, the optimizer's groups) as its
client state; the LightningModule's weights are only in the shards.
`convert_checkpoint` reads both on one process, on the CPU, with no process
group and no engine, and writes what ``strategy="ddp"`` would have saved: a
``torch.save`` dict with a ``state_dict`` entry (the LightningModule's keys, full
fp32 weights assembled from every rank's shards by `zkernel.consolidate`) beside
Lightning's state. So ``MyModule.load_from_checkpoint(file)`` and
``torch.load(file)["state_dict"]`` work without zkernel, and
``Trainer(strategy="ddp").fit(ckpt_path=file)`` resumes (with fresh optimizer
moments: [Note: what the converted file keeps of the optimizer]).

    python -m zkernel.integrations.lightning.convert CHECKPOINT_DIR OUTPUT_FILE [-t TAG]

[Note: what the converted file keeps of the optimizer] The engine's Adam
moments are stored per parameter name and element range, while a torch
optimizer's state dict numbers parameters by their position in
``configure_optimizers``' groups, which only the LightningModule knows. The
converter works without the module, so it keeps what the strategy saved of the
optimizer: torch's state-dict layout with every group's hyperparameters and
parameter numbers and no per-parameter state (`ZKernelStrategy.optimizer_state`).
A torch optimizer loads that as a fresh one with the saved hyperparameters; the
lr schedulers and loops resume as saved. DeepSpeed's converter for Lightning
drops the optimizer state too. The conversion says so in a warning.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from zkernel.checkpoint import client_state
from zkernel.checkpoint.consolidate import consolidate
from zkernel.checkpoint.format import CheckpointError
from zkernel.checkpoint.range_reader import RangeReader
from zkernel.checkpoint.reader import open_checkpoint
from zkernel.telemetry.log import get_logger

__all__ = ["convert_checkpoint", "main"]

log = get_logger()

# The key Lightning's Trainer writes into every checkpoint it saves (its version), one per package.
_VERSION_KEYS = ("pytorch-lightning_version", "lightning_version")


def read_lightning_state(checkpoint_dir: str | os.PathLike, tag: str | None = None) -> tuple[dict[str, Any], str]:
    """Lightning's state saved in the zkernel checkpoint ``tag`` (default: the latest) of ``checkpoint_dir``,
    and that checkpoint's tag; called by `convert_checkpoint`. A `CheckpointError` says what is wrong when
    the directory is no checkpoint ZKernelStrategy wrote."""
    path = Path(checkpoint_dir)
    if not path.exists():
        raise FileNotFoundError(f"{str(path)!r} does not exist: give the directory trainer.save_checkpoint wrote")
    if not path.is_dir():
        raise CheckpointError(
            f"{str(path)!r} is a file, not a checkpoint directory written by trainer.save_checkpoint under "
            "ZKernelStrategy: a single-file checkpoint needs no conversion (torch.load or load_from_checkpoint "
            "reads it)"
        )
    try:
        index = open_checkpoint(path, tag)
    except CheckpointError as error:
        raise CheckpointError(
            f"{str(path)!r} is not a checkpoint directory written by trainer.save_checkpoint under "
            f"ZKernelStrategy: {error}"
        ) from None
    with RangeReader() as reader:
        state = client_state.read(index, reader)
    if not any(key in state for key in _VERSION_KEYS):
        raise CheckpointError(
            f"{str(path)!r} holds a zkernel checkpoint ({index.tag!r}) without Lightning's state (no "
            f"{' or '.join(map(repr, _VERSION_KEYS))} in its client state): it was not written by "
            "trainer.save_checkpoint under ZKernelStrategy; zkernel.consolidate(path) gives its weights"
        )
    return state, index.tag


def _optimizer_states(states: Any, path: Path) -> list[Any] | None:
    """The optimizer states to write, or None where the strategy saved no torch layout (an older save)."""
    usable = []
    for state in states:
        groups = state.get("param_groups") if isinstance(state, Mapping) else None
        if not isinstance(groups, list) or not all(isinstance(g, Mapping) and "params" in g for g in groups):
            log.warning(
                "zkernel.lightning.convert.optimizer_dropped",
                path=str(path),
                reason="the checkpoint's optimizer state has no parameter numbers (saved by an older zkernel): "
                "the file has no 'optimizer_states', so it loads weights (load_from_checkpoint, "
                "validate/test(ckpt_path=...)) but fit(ckpt_path=...) cannot resume from it",
            )
            return None
        usable.append({"state": {}, "param_groups": [dict(g) for g in groups]})
    return usable


def convert_checkpoint(
    checkpoint_dir: str | os.PathLike,
    output_file: str | os.PathLike,
    tag: str | None = None,
    *,
    progress: bool | None = None,
) -> Path:
    """Write the checkpoint directory ``checkpoint_dir`` (``trainer.save_checkpoint`` under ZKernelStrategy)
    as one Lightning checkpoint file ``output_file``; returns its path. Called by the user (or `main`) on one
    process, CPU only.

    The file holds Lightning's saved state and a ``state_dict`` of the LightningModule's full fp32 weights;
    the optimizer's moments are not kept ([Note: what the converted file keeps of the optimizer]). ``tag``:
    the engine checkpoint to read (default: the latest). ``progress``: a progress bar while the shards are
    read (None: on a terminal). The file is written beside its final name and renamed into place, so an
    interrupted conversion leaves no partial file under that name. Peak memory: the full fp32 state dict
    (as DeepSpeed's converter), plus Lightning's state.
    """
    source = Path(checkpoint_dir)
    out = Path(output_file)
    if out.is_dir():
        raise IsADirectoryError(f"the output {str(out)!r} is a directory: give a file name (e.g. model.ckpt)")
    state, tag = read_lightning_state(source, tag)
    weights = consolidate(source, tag, progress=progress)
    checkpoint = {key: value for key, value in state.items() if key != "state_dict"}
    checkpoint["state_dict"] = weights
    if "optimizer_states" in checkpoint:
        optimizers = _optimizer_states(checkpoint["optimizer_states"], source)
        if optimizers is None:
            del checkpoint["optimizer_states"]
        else:
            checkpoint["optimizer_states"] = optimizers
            log.warning(
                "zkernel.lightning.convert.moments_not_kept",
                path=str(out),
                note="the optimizer's moments stay in the zkernel checkpoint: a fit resumed from this file "
                "starts them fresh (its hyperparameters, lr schedulers and loops resume as saved)",
            )
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial")
    try:
        torch.save(checkpoint, partial)
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    log.info("zkernel.lightning.converted", source=str(source), tag=tag, output=str(out), tensors=len(weights))
    return out


def main(argv: list[str] | None = None) -> Path:
    """The command line (``python -m zkernel.integrations.lightning.convert``); returns the file written."""
    parser = argparse.ArgumentParser(
        prog="python -m zkernel.integrations.lightning.convert",
        description="Write a checkpoint directory saved by trainer.save_checkpoint under ZKernelStrategy as one "
        "Lightning checkpoint file (full fp32 state_dict and Lightning's state), on the CPU, without a process "
        "group. The optimizer's moments are not kept.",
    )
    parser.add_argument("checkpoint_dir", help="the directory trainer.save_checkpoint wrote")
    parser.add_argument("output_file", help="the checkpoint file to write, e.g. model.ckpt")
    parser.add_argument("-t", "--tag", default=None, help="the engine checkpoint to read (default: latest)")
    args = parser.parse_args(argv)
    return convert_checkpoint(args.checkpoint_dir, args.output_file, args.tag)


if __name__ == "__main__":
    try:
        main()
    except (OSError, CheckpointError) as error:  # what was wrong with the paths given, without a traceback
        raise SystemExit(f"python -m zkernel.integrations.lightning.convert: error: {error}") from None
