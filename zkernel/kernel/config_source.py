"""Where a `Config` comes from: a `Config`, a dict, a .json or .toml file, or a DeepSpeed config."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from zkernel.compat.deepspeed.config import from_deepspeed_config, is_deepspeed_config
from zkernel.errors import ConfigError
from zkernel.spec.config import Config, config_from_dict


def _from_mapping(raw: Any) -> Config:
    return from_deepspeed_config(raw) if is_deepspeed_config(raw) else config_from_dict(raw)


def load_config(source: Config | Mapping[str, Any] | str | os.PathLike | None) -> Config:
    """Load a `Config` from a `Config`, a dict, or a path to a .json or .toml file.

    A DeepSpeed config (dict or .json) is recognised and mapped by
    `zkernel.compat.deepspeed.config.from_deepspeed_config`.
    """
    if source is None:
        return Config()
    if isinstance(source, Config):
        return source
    if isinstance(source, Mapping):
        return _from_mapping(source)
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        suffix = path.suffix.lower()
        if suffix == ".json":
            try:
                raw = json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                raise ConfigError(f"config file {str(path)!r} is not valid JSON: {exc}") from exc
            return _from_mapping(raw)
        if suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError as exc:  # Python 3.10
                raise ConfigError(
                    "reading .toml configs needs Python 3.11+ (tomllib); use .json or a dict"
                ) from exc
            return config_from_dict(tomllib.loads(path.read_text()))
        raise ConfigError(f"config file {str(path)!r} must end in .json or .toml")
    raise ConfigError(
        f"config must be a zkernel.Config, a dict or a path to .json/.toml (zkernel's or DeepSpeed's), got {type(source).__name__}"
    )


