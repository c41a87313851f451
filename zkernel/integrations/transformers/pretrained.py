"""A ``save_pretrained`` directory's weights loaded into an engine, one safetensors file at a time.

For a model built on the meta device ([Note: meta-device construction] in
`zkernel.integrations.transformers.trainer`): ``from_pretrained`` would materialise the whole model
on every rank, so the engine is built first (each rank holding its shards) and the checkpoint's
files are then written into it through ``engine.load_state_dict(..., strict=False)``, which keeps
each rank's part of every tensor. Every rank reads each file (a collective per file); a rank holds
at most one file's tensors at a time.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from zkernel.errors import ConfigError
from zkernel.telemetry.log import get_logger

log = get_logger()

_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"


def weight_files(directory: str | os.PathLike) -> list[Path]:
    """The safetensors files of a ``save_pretrained`` directory (one file, or the files its index names)."""
    root = Path(directory)
    if (root / _INDEX).is_file():
        weight_map = json.loads((root / _INDEX).read_text()).get("weight_map", {})
        return [root / name for name in sorted(set(weight_map.values()))]
    if (root / _SINGLE).is_file():
        return [root / _SINGLE]
    raise ConfigError(
        f"zkernel_pretrained={str(root)!r} has neither {_SINGLE} nor {_INDEX}; valid: a directory "
        "save_pretrained wrote with safetensors (a hub model: huggingface_hub.snapshot_download(repo_id) first)"
    )


def load_pretrained(engine, directory: str | os.PathLike) -> None:
    """Write every tensor of ``directory``'s safetensors files into ``engine`` (collective: every rank).

    A tensor the model does not have, or of another shape, is an error; parameters no file holds keep
    the values the engine built them with (logged as ``zkernel.trainer.pretrained_missing``).
    """
    from safetensors.torch import load_file

    missing: set[str] | None = None
    for path in weight_files(directory):
        result = engine.load_state_dict(load_file(str(path)), strict=False)
        if result.unexpected_keys:
            raise ConfigError(
                f"{path} holds tensors the model does not have: {sorted(result.unexpected_keys)[:5]}; valid: the "
                "checkpoint of this model's architecture and configuration"
            )
        missing = set(result.missing_keys) if missing is None else missing & set(result.missing_keys)
    missing = _untied(engine.module, missing or set())
    if missing:
        log.warning(
            "zkernel.trainer.pretrained_missing",
            directory=str(directory),
            keys=sorted(missing),
            note="these parameters and buffers keep the values the engine initialised them with",
        )
    log.info("zkernel.trainer.pretrained", directory=str(directory))


def _untied(model, missing: set[str]) -> set[str]:
    """``missing`` less the names of tied parameters loaded under another of their names (a tied
    ``lm_head.weight`` that ``save_pretrained`` stores once, as the input embedding)."""
    aliases: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), set()).add(name)
    names = {name: aliases[id(param)] for name, param in model.named_parameters(remove_duplicate=False)}
    return {key for key in missing if names.get(key, {key}) <= missing}
