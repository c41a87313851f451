"""Validated configuration: frozen attrs values loaded from a dict, .json/.toml file or `Config`.

Structure errors (unknown keys, wrong types, values out of range, incompatible
combinations) are raised here as `ConfigError` naming the key and what is
valid. Whether a component *name* is installed is checked later, against the
plugins actually found (`zkernel.plugin_manager.resolve_components`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

PRECISIONS = ("fp32", "bf16", "fp16")
LOG_FORMATS = ("console", "json")
ACTIVATION_OFFLOADS = ("none", "cpu")


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the key and what is valid."""


def _positive_int(key: str):
    def check(_inst, _attr, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key} must be an integer >= 1, got {value!r}")

    return check


def _non_negative_number(key: str):
    def check(_inst, _attr, value):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ConfigError(f"{key} must be a number >= 0, got {value!r}")
        if math.isinf(value):
            raise ConfigError(f"{key} must be finite, got {value!r}")

    return check


def _non_negative_int(key: str):
    def check(_inst, _attr, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{key} must be an integer >= 0, got {value!r}")

    return check


def _name(key: str):
    def check(_inst, _attr, value):
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{key} must be a non-empty string naming a component, got {value!r}")

    return check


def _one_of(key: str, choices: tuple[str, ...]):
    def check(_inst, _attr, value):
        if value not in choices:
            raise ConfigError(f"{key} {value!r} is not valid; valid: {', '.join(choices)}")

    return check


def _betas(value: Any) -> tuple[float, float]:
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in value)
    ):
        raise ConfigError(f"optimizer.betas must be two numbers in [0, 1), got {value!r}")
    b1, b2 = float(value[0]), float(value[1])
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ConfigError(f"optimizer.betas must be two numbers in [0, 1), got {value!r}")
    return (b1, b2)


def _str_tuple(key: str):
    def convert(value: Any) -> tuple[str, ...]:
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list of strings, got {value!r}")
        if not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{key} must be a list of strings, got {value!r}")
        return tuple(value)

    return convert


def _options(value: Any) -> Mapping[str, Any]:
    return dict(value)


def _mapping(key: str):
    def convert(value: Any) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key} must be a table (mapping), got {type(value).__name__}")
        return dict(value)

    return convert


@attrs.frozen(kw_only=True)
class OptimizerConfig:
    """``[optimizer]``: which optimizer and its hyperparameters.

    Keys other than the common ones go to ``options`` and are validated against
    the selected optimizer's own options class.
    """

    name: str = attrs.field(default="adamw", validator=_name("optimizer.name"))
    lr: float = attrs.field(default=1e-3, validator=_non_negative_number("optimizer.lr"))
    betas: tuple[float, float] = attrs.field(default=(0.9, 0.999), converter=_betas)
    eps: float = attrs.field(default=1e-8, validator=_non_negative_number("optimizer.eps"))
    weight_decay: float = attrs.field(
        default=0.0, validator=_non_negative_number("optimizer.weight_decay")
    )
    options: Mapping[str, Any] = attrs.field(factory=dict, converter=_options)


@attrs.frozen(kw_only=True)
class OffloadConfig:
    """``[offload]``: the storage tier of optimizer state and of parameters, each with its own options."""

    optimizer: str = attrs.field(default="none", validator=_name("offload.optimizer"))
    params: str = attrs.field(default="none", validator=_name("offload.params"))
    nvme_path: Path | None = attrs.field(
        default=None, converter=attrs.converters.optional(Path)
    )
    # Options of the tier selected for each role, validated against that tier's own class.
    optimizer_options: Mapping[str, Any] = attrs.field(factory=dict, converter=_mapping("offload.optimizer_options"))
    params_options: Mapping[str, Any] = attrs.field(factory=dict, converter=_mapping("offload.params_options"))


@attrs.frozen(kw_only=True)
class TilingConfig:
    """``[tiling]``: which ``nn.Linear`` layers are split into tiles, and by which component.

    Keys other than these go to ``options`` (the selected component's own).
    """

    name: str = attrs.field(default="linear", validator=_name("tiling.name"))
    # fnmatch patterns of module names (``"blocks.*.fc"``) of the layers to tile.
    modules: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple("tiling.modules"))
    # Also tile every layer whose weight has at least this many elements; 0 = off.
    min_numel: int = attrs.field(default=0, validator=_non_negative_int("tiling.min_numel"))
    tiles: int = attrs.field(default=4, validator=_positive_int("tiling.tiles"))
    options: Mapping[str, Any] = attrs.field(factory=dict, converter=_options)


@attrs.frozen(kw_only=True)
class ActivationCheckpointingConfig:
    """``[activation_checkpointing]``: which modules recompute their activations in backward.

    Keys other than these go to ``options`` (the selected component's own).
    """

    name: str = attrs.field(default="recompute", validator=_name("activation_checkpointing.name"))
    # Class names (``"Block"``) or fnmatch patterns of module names (``"blocks.*"``).
    modules: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple("activation_checkpointing.modules"))
    # Where the saved inputs of each checkpointed module wait for backward.
    offload: str = attrs.field(
        default="none", validator=_one_of("activation_checkpointing.offload", ACTIVATION_OFFLOADS)
    )
    options: Mapping[str, Any] = attrs.field(factory=dict, converter=_options)


@attrs.frozen(kw_only=True)
class Config:
    """The whole configuration of one engine. See README's config reference."""

    partitioner: str = attrs.field(default="none", validator=_name("partitioner"))
    precision: str = attrs.field(default="fp32", validator=_one_of("precision", PRECISIONS))
    gradient_accumulation_steps: int = attrs.field(
        default=1, validator=_positive_int("gradient_accumulation_steps")
    )
    gradient_clipping: float = attrs.field(
        default=0.0, validator=_non_negative_number("gradient_clipping")
    )
    optimizer: OptimizerConfig = attrs.field(factory=OptimizerConfig)
    offload: OffloadConfig = attrs.field(factory=OffloadConfig)
    tiling: TilingConfig = attrs.field(factory=TilingConfig)
    activation_checkpointing: ActivationCheckpointingConfig = attrs.field(factory=ActivationCheckpointingConfig)
    # Options of the selected partitioner (its own attrs class validates them).
    partitioner_options: Mapping[str, Any] = attrs.field(factory=dict, converter=_options)
    # Bytes of parameters the prefetcher keeps in flight ahead of the running module (ZeRO-3).
    prefetch_bytes: int = attrs.field(default=256 * 2**20, validator=_non_negative_number("prefetch_bytes"))
    # Initial loss scale and growth interval for fp16 dynamic loss scaling.
    initial_loss_scale: float = attrs.field(
        default=2.0**16, validator=_non_negative_number("initial_loss_scale")
    )
    loss_scale_window: int = attrs.field(default=1000, validator=_positive_int("loss_scale_window"))
    # Extra plugins by dotted module path, and installed plugins to ignore.
    plugins: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple("plugins"))
    blocked_plugins: tuple[str, ...] = attrs.field(
        default=(), converter=_str_tuple("blocked_plugins")
    )
    trace_hooks: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    log_format: str = attrs.field(default="console", validator=_one_of("log_format", LOG_FORMATS))
    seed: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.offload.params != "none" and self.partitioner != "zero3":
            raise ConfigError(
                f"offload.params {self.offload.params!r} needs partitioner 'zero3' "
                f"(parameters are whole on every rank with {self.partitioner!r}); "
                "valid: offload.params = 'none', or partitioner = 'zero3'"
            )
        if "nvme" in (self.offload.optimizer, self.offload.params) and self.offload.nvme_path is None:
            raise ConfigError(
                "offload.nvme_path is required when offload.optimizer or offload.params is 'nvme'"
            )


_SECTIONS = {
    "optimizer": OptimizerConfig,
    "offload": OffloadConfig,
    "tiling": TilingConfig,
    "activation_checkpointing": ActivationCheckpointingConfig,
}


def config_value(config: Config, dotted: str) -> Any:
    """The value at a dotted path of ``config`` (``"offload.optimizer"``)."""
    value: Any = config
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def section_keys(section: str) -> tuple[str, ...]:
    """The keys a section takes itself, before any component's options."""
    return tuple(_field_names(_SECTIONS[section]))


def _field_names(cls: type) -> list[str]:
    return [a.name for a in attrs.fields(cls) if a.name != "options"]


def _build_section(key: str, cls: type, raw: Any) -> Any:
    """A section from a mapping; keys it does not know are its component's options where it has
    ``options`` (``[optimizer]``), else errors."""
    if isinstance(raw, cls):
        return raw
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{key} must be a table (mapping), got {type(raw).__name__}")
    known = set(_field_names(cls))
    kwargs = {k: v for k, v in raw.items() if k in known}
    extra = {k: v for k, v in raw.items() if k not in known}
    if "options" not in {a.name for a in attrs.fields(cls)}:
        if extra:
            raise ConfigError(
                f"unknown config key {key}.{sorted(extra)[0]}; valid: {', '.join(_field_names(cls))}"
            )
        return cls(**kwargs)
    if "options" in extra:
        extra.update(extra.pop("options"))
    return cls(**kwargs, options=extra)


def config_from_dict(raw: Mapping[str, Any]) -> Config:
    """Build a `Config` from plain values; every unknown top-level key is an error."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config must be a mapping, got {type(raw).__name__}")
    valid = [a.name for a in attrs.fields(Config)]
    unknown = sorted(set(raw) - set(valid))
    if unknown:
        raise ConfigError(
            f"unknown config key {unknown[0]!r}; valid keys: {', '.join(sorted(valid))}"
        )
    kwargs = dict(raw)
    for key, cls in _SECTIONS.items():
        if key in kwargs:
            kwargs[key] = _build_section(key, cls, kwargs[key])
    if "partitioner_options" in kwargs and not isinstance(kwargs["partitioner_options"], Mapping):
        raise ConfigError("partitioner_options must be a table (mapping)")
    try:
        return Config(**kwargs)
    except TypeError as exc:  # attrs raises TypeError for wrong argument shapes
        raise ConfigError(str(exc)) from exc


def load_config(source: Config | Mapping[str, Any] | str | os.PathLike | None) -> Config:
    """Load a `Config` from a `Config`, a dict, or a path to a .json or .toml file."""
    if source is None:
        return Config()
    if isinstance(source, Config):
        return source
    if isinstance(source, Mapping):
        return config_from_dict(source)
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        suffix = path.suffix.lower()
        if suffix == ".json":
            return config_from_dict(json.loads(path.read_text()))
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
        f"config must be a zkernel.Config, a dict or a path to .json/.toml, got {type(source).__name__}"
    )


def build_options(
    owner: str, options_cls: type | None, options: Mapping[str, Any], common: tuple[str, ...] = ()
) -> Any:
    """Validate a component's own options against its attrs class (None if it takes none).

    ``common`` are the section's own keys, listed in the error beside the component's.
    """
    if options_cls is None:
        if options:
            key = sorted(options)[0]
            valid = ", ".join(common) or "(none)"
            raise ConfigError(f"unknown config key {owner}.{key}; valid: {valid} (the selected component takes no extra options)")
        return None
    valid = [*common, *(a.name for a in attrs.fields(options_cls))]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ConfigError(
            f"unknown config key {owner}.{unknown[0]}; valid: {', '.join(valid) or '(none)'}"
        )
    try:
        return options_cls(**options)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{owner}: {exc}") from exc
