"""Validated configuration: frozen attrs values loaded from a dict, .json/.toml file or `Config`.

Structure errors (unknown keys, wrong types, values out of range, incompatible
combinations) are raised here as `ConfigError` naming the key and what is
valid. Whether a component *name* is installed is checked later, against the
plugins actually found (`zkernel.kernel.plugin_manager.resolve_components`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from zkernel.errors import ConfigError
from zkernel.spec.registry import AUTO, Family, config_value

PRECISIONS = ("fp32", "bf16", "fp16")
# The value of a slot declared ``auto`` (`zkernel.spec.registry.Slot`) that asks the planner to choose,
# and the keys of those slots.
AUTO_KEYS = tuple(slot.key for family in Family for slot in family.slots if slot.auto)
LOG_FORMATS = ("console", "json")
ACTIVATION_OFFLOADS = ("none", "cpu")




def _positive_int(key: str):
    def check(_inst, _attr, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key} must be an integer >= 1, got {value!r}")

    return check


def _bool(key: str):
    def check(_inst, _attr, value):
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")

    return check


def _non_negative_number(key: str):
    def check(_inst, _attr, value):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ConfigError(f"{key} must be a number >= 0, got {value!r}")
        if math.isinf(value):
            raise ConfigError(f"{key} must be finite, got {value!r}")

    return check


def _positive_number(key: str):
    def check(_inst, _attr, value):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
            raise ConfigError(f"{key} must be a finite number > 0, got {value!r}")

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


def _betas(key: str):
    """An attrs converter to Adam's ``(beta1, beta2)``; anything else is a `ConfigError` naming ``key``."""

    def convert(value: Any) -> tuple[float, float]:
        if (
            not isinstance(value, (list, tuple))
            or len(value) != 2
            or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in value)
        ):
            raise ConfigError(f"{key} must be two numbers in [0, 1), got {value!r}")
        b1, b2 = float(value[0]), float(value[1])
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ConfigError(f"{key} must be two numbers in [0, 1), got {value!r}")
        return (b1, b2)

    return convert


def str_tuple(key: str):
    """An attrs converter to a tuple of strings; anything else is a `ConfigError` naming ``key``."""

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
class ParamGroupConfig:
    """One ``[[optimizer.param_groups]]`` entry: parameters stepped with their own hyperparameters."""

    # fnmatch patterns of parameter names or class names of owning modules.
    params: tuple[str, ...] = attrs.field(converter=str_tuple("optimizer.param_groups.params"))
    # Multiplies the step's learning rate (the schedule's, when one is set) for these parameters.
    lr_scale: float = attrs.field(default=1.0, validator=_non_negative_number("optimizer.param_groups.lr_scale"))
    # Their weight decay; None: [optimizer] weight_decay.
    weight_decay: float | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(_non_negative_number("optimizer.param_groups.weight_decay")),
    )
    # Their Adam betas; None: the step's ([optimizer] betas, or what the schedule sets).
    betas: tuple[float, float] | None = attrs.field(
        default=None, converter=attrs.converters.optional(_betas("optimizer.param_groups.betas"))
    )
    # Their Adam epsilon; None: [optimizer] eps.
    eps: float | None = attrs.field(
        default=None, validator=attrs.validators.optional(_non_negative_number("optimizer.param_groups.eps"))
    )

    def __attrs_post_init__(self) -> None:
        if not self.params:
            raise ConfigError("optimizer.param_groups.params must name at least one pattern")


def _param_groups(value: Any) -> tuple[ParamGroupConfig, ...]:
    if isinstance(value, (str, Mapping)) or not isinstance(value, (list, tuple)):
        raise ConfigError(f"optimizer.param_groups must be a list of tables, got {value!r}")
    out = []
    valid = [a.name for a in attrs.fields(ParamGroupConfig)]
    for entry in value:
        if isinstance(entry, ParamGroupConfig):
            out.append(entry)
            continue
        if not isinstance(entry, Mapping):
            raise ConfigError(f"optimizer.param_groups entries must be tables, got {entry!r}")
        unknown = sorted(set(entry) - set(valid))
        if unknown:
            raise ConfigError(f"unknown config key optimizer.param_groups.{unknown[0]}; valid: {', '.join(valid)}")
        if "params" not in entry:
            raise ConfigError("optimizer.param_groups entries need params (patterns of parameter or class names)")
        out.append(ParamGroupConfig(**entry))
    return tuple(out)


@attrs.frozen(kw_only=True)
class OptimizerConfig:
    """``[optimizer]``: which optimizer and its hyperparameters.

    Keys other than the common ones go to ``options`` and are validated against
    the selected optimizer's own options class.
    """

    name: str = attrs.field(default="adamw", validator=_name("optimizer.name"))
    lr: float = attrs.field(default=1e-3, validator=_non_negative_number("optimizer.lr"))
    betas: tuple[float, float] = attrs.field(default=(0.9, 0.999), converter=_betas("optimizer.betas"))
    eps: float = attrs.field(default=1e-8, validator=_non_negative_number("optimizer.eps"))
    weight_decay: float = attrs.field(
        default=0.0, validator=_non_negative_number("optimizer.weight_decay")
    )
    # fnmatch patterns of parameter names or class names of owning modules stepped without weight
    # decay ([Note: per-parameter hyperparameters] in `zkernel.kernel.param_hyper`).
    no_weight_decay: tuple[str, ...] = attrs.field(default=(), converter=str_tuple("optimizer.no_weight_decay"))
    # Parameters with a learning-rate scale, weight decay, betas or eps of their own, as a torch
    # optimizer's parameter groups (the first entry a parameter matches; see `zkernel.kernel.param_hyper`).
    param_groups: tuple[ParamGroupConfig, ...] = attrs.field(default=(), converter=_param_groups)
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
    modules: tuple[str, ...] = attrs.field(default=(), converter=str_tuple("tiling.modules"))
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
    modules: tuple[str, ...] = attrs.field(default=(), converter=str_tuple("activation_checkpointing.modules"))
    # Where the saved inputs of each checkpointed module wait for backward.
    offload: str = attrs.field(
        default="none", validator=_one_of("activation_checkpointing.offload", ACTIVATION_OFFLOADS)
    )
    options: Mapping[str, Any] = attrs.field(factory=dict, converter=_options)


@attrs.frozen(kw_only=True)
class LRScheduleConfig:
    """``[lr_schedule]``: which schedule sets the learning rate of each step (see `zkernel.spec.lr_schedule`).

    Keys other than ``name`` go to ``options`` (the selected schedule's own).
    """

    name: str = attrs.field(default="none", validator=_name("lr_schedule.name"))
    options: Mapping[str, Any] = attrs.field(factory=dict, converter=_options)


def _size(key: str):
    """Bytes from an integer or a string with a unit ("16GiB", "1.5TB"); None stays None."""

    def convert(value: Any) -> int | None:
        if value is None:
            return None
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        if isinstance(value, str):
            from zkernel.platform.sizes import parse_size

            try:
                return parse_size(value)
            except ValueError:
                pass
        raise ConfigError(
            f"{key} must be a size in bytes: an integer >= 0 or a string such as \"16GiB\" "
            f"(units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), got {value!r}"
        )

    return convert


def _optional_positive_int(key: str):
    def check(_inst, _attr, value):
        if value is not None:
            _positive_int(key)(_inst, _attr, value)

    return check


@attrs.frozen(kw_only=True)
class PlannerConfig:
    """``[planner]``: which planner resolves ``"auto"`` (see `zkernel.kernel.planning`), with hints and overrides.

    Keys other than these go to ``options`` (the selected planner's own).
    """

    name: str = attrs.field(default="default", validator=_name("planner.name"))
    # Activation hints: sequences per rank per micro-batch and tokens per sequence. Without them
    # the planner places model states only (and says so in its decision).
    micro_batch: int | None = attrs.field(default=None, validator=_optional_positive_int("planner.micro_batch"))
    sequence: int | None = attrs.field(default=None, validator=_optional_positive_int("planner.sequence"))
    # The model takes its loss with `zkernel.tiled_cross_entropy`: its head keeps no logits.
    tiled_loss: bool = attrs.field(default=False, validator=_bool("planner.tiled_loss"))
    # What the planner takes as this machine's capacities instead of what it detects (bytes, or
    # a string with a unit): free memory per GPU, available host memory, free disk at nvme_path.
    gpu_memory: int | None = attrs.field(default=None, converter=_size("planner.gpu_memory"))
    ram: int | None = attrs.field(default=None, converter=_size("planner.ram"))
    disk: int | None = attrs.field(default=None, converter=_size("planner.disk"))
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
    lr_schedule: LRScheduleConfig = attrs.field(factory=LRScheduleConfig)
    offload: OffloadConfig = attrs.field(factory=OffloadConfig)
    tiling: TilingConfig = attrs.field(factory=TilingConfig)
    activation_checkpointing: ActivationCheckpointingConfig = attrs.field(factory=ActivationCheckpointingConfig)
    planner: PlannerConfig = attrs.field(factory=PlannerConfig)
    # Options of the selected partitioner (its own attrs class validates them).
    partitioner_options: Mapping[str, Any] = attrs.field(factory=dict, converter=_options)
    # Bytes of parameters the prefetcher keeps in flight ahead of the running module (ZeRO-3).
    prefetch_bytes: int = attrs.field(default=256 * 2**20, validator=_non_negative_number("prefetch_bytes"))
    # Initial loss scale and growth interval for fp16 dynamic loss scaling.
    initial_loss_scale: float = attrs.field(
        default=2.0**16, validator=_non_negative_number("initial_loss_scale")
    )
    loss_scale_window: int = attrs.field(default=1000, validator=_positive_int("loss_scale_window"))
    # Overflows the fp16 scale takes before it halves, and whether a clean step restores them
    # ([Note: loss-scale hysteresis] in `zkernel.kernel.loss_scale`).
    loss_scale_hysteresis: int = attrs.field(default=1, validator=_positive_int("loss_scale_hysteresis"))
    loss_scale_consecutive_hysteresis: bool = attrs.field(
        default=False, validator=_bool("loss_scale_consecutive_hysteresis")
    )
    # The fp16 scale's floor, and whether an overflow there stops the run ([Note: overflow at the
    # minimum scale] in `zkernel.kernel.loss_scale`).
    min_loss_scale: float = attrs.field(default=1.0, validator=_positive_number("min_loss_scale"))
    loss_scale_error_at_min: bool = attrs.field(default=True, validator=_bool("loss_scale_error_at_min"))
    # Extra plugins by dotted module path, and installed plugins to ignore.
    plugins: tuple[str, ...] = attrs.field(default=(), converter=str_tuple("plugins"))
    blocked_plugins: tuple[str, ...] = attrs.field(
        default=(), converter=str_tuple("blocked_plugins")
    )
    trace_hooks: bool = attrs.field(default=False, validator=_bool("trace_hooks"))
    log_format: str = attrs.field(default="console", validator=_one_of("log_format", LOG_FORMATS))
    seed: int | None = None
    # Seconds a collective may take before the process group gives up (when zkernel creates it).
    collective_timeout: float = attrs.field(default=600.0, validator=_non_negative_number("collective_timeout"))
    # Per-step timeline of compute and transfers, logged as `zkernel.step.timeline` (INFO).
    timeline: bool = attrs.field(default=False, validator=_bool("timeline"))
    # Chrome-trace JSON of the timeline (Perfetto opens it); "{rank}" is replaced by the rank.
    timeline_path: str | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.instance_of(str)))

    def __attrs_post_init__(self) -> None:
        # Rules that involve a component are the component's: `offload.params` off the device needs a
        # partitioner that holds parameters on a tier (a `Need` of that slot), `offload.nvme_path` is the
        # nvme tier's ``check`` ([Note: capabilities] in `zkernel.spec.registry`).
        if self.initial_loss_scale < self.min_loss_scale:
            raise ConfigError(
                f"initial_loss_scale {self.initial_loss_scale!r} is below min_loss_scale {self.min_loss_scale!r}; "
                "valid: initial_loss_scale >= min_loss_scale"
            )
        if self.timeline_path is not None and not self.timeline:
            raise ConfigError("timeline_path is set but timeline is false; set timeline = true to record it")


_SECTIONS = {
    "optimizer": OptimizerConfig,
    "lr_schedule": LRScheduleConfig,
    "offload": OffloadConfig,
    "tiling": TilingConfig,
    "activation_checkpointing": ActivationCheckpointingConfig,
    "planner": PlannerConfig,
}


def auto_keys(config: Config) -> tuple[str, ...]:
    """The keys of `AUTO_KEYS` whose value is ``"auto"`` (the planner resolves them at `initialize`)."""
    return tuple(key for key in AUTO_KEYS if config_value(config, key) == AUTO)


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
