"""Validated configuration: frozen attrs values loaded from a dict, .json/.toml file or `Config`.

`Config` is the kernel's own keys (`CoreConfig`) plus one section per family
that declares one ([Note: family sections] in `zkernel.spec.sections`): the
sections are not listed here but taken from `zkernel.spec.registry.Family`, so a
new family's table needs no edit of this module.

Structure errors (unknown keys, wrong types, values out of range, incompatible
combinations of the kernel's own keys) are raised here as `ConfigError` naming
the key and what is valid. Whether a component *name* is installed, its own
options, and rules that involve a component are checked later, against the
plugins actually found (`zkernel.spec.registry.ComponentRegistry.select`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from zkernel.errors import ConfigError
from zkernel.spec import fields
from zkernel.spec.fields import str_tuple
from zkernel.spec.registry import AUTO, Family, config_value
from zkernel.spec.sections import (  # noqa: F401 - the families' sections, importable from here as before
    ACTIVATION_OFFLOADS,
    ActivationCheckpointingConfig,
    LRScheduleConfig,
    OffloadConfig,
    OptimizerConfig,
    ParamGroupConfig,
    PlannerConfig,
    TilingConfig,
    build_section,
    own_keys,
)

__all__ = ["AUTO", "AUTO_KEYS", "Config", "ConfigError", "CoreConfig", "auto_keys", "config_from_dict", "config_value", "section_keys", "str_tuple"]

PRECISIONS = ("fp32", "bf16", "fp16")
# The value of a slot declared ``auto`` (`zkernel.spec.registry.Slot`) that asks the planner to choose,
# and the keys of those slots.
AUTO_KEYS = tuple(slot.key for family in Family for slot in family.slots if slot.auto)
LOG_FORMATS = ("console", "json")


@attrs.frozen(kw_only=True)
class CoreConfig:
    """The kernel's own keys (the top level of the config); `Config` adds the families' sections."""

    # Who owns which slice of the model state: none (plain data parallel), zero1, zero2, zero3,
    # "auto" (the planner chooses) or a third-party partitioner's name.
    partitioner: str = attrs.field(default="none", validator=fields.component_name("partitioner"))
    # Compute dtype of parameters and activations: fp32, bf16 or fp16 (dynamic loss scaling);
    # masters stay fp32.
    precision: str = attrs.field(default="fp32", validator=fields.one_of("precision", PRECISIONS))
    # Micro-batches (engine.step() calls) per optimizer step.
    gradient_accumulation_steps: int = attrs.field(
        default=1, validator=fields.positive_int("gradient_accumulation_steps")
    )
    # Clip to this global gradient norm, taken across all shards; 0 = off.
    gradient_clipping: float = attrs.field(
        default=0.0, validator=fields.non_negative_number("gradient_clipping")
    )
    # Options of the selected partitioner (its own attrs class validates them).
    partitioner_options: Mapping[str, Any] = attrs.field(factory=dict, converter=fields.options_table)
    # Bytes of parameters the prefetcher keeps in flight ahead of the running module (ZeRO-3).
    prefetch_bytes: int = attrs.field(default=256 * 2**20, validator=fields.non_negative_number("prefetch_bytes"))
    # Initial loss scale of fp16 dynamic loss scaling.
    initial_loss_scale: float = attrs.field(
        default=2.0**16, validator=fields.non_negative_number("initial_loss_scale")
    )
    # Clean steps between growths of the fp16 loss scale (the first growth after an overflow, or
    # the start, at the window + 1-th clean step, as DeepSpeed's).
    loss_scale_window: int = attrs.field(default=1000, validator=fields.positive_int("loss_scale_window"))
    # Overflows the fp16 scale takes before it halves ([Note: loss-scale hysteresis] in
    # `zkernel.kernel.loss_scale`).
    loss_scale_hysteresis: int = attrs.field(default=1, validator=fields.positive_int("loss_scale_hysteresis"))
    # Refill the hysteresis allowance after every step without an overflow (DeepSpeed's
    # consecutive_hysteresis).
    loss_scale_consecutive_hysteresis: bool = attrs.field(
        default=False, validator=fields.true_or_false("loss_scale_consecutive_hysteresis")
    )
    # The fp16 scale's floor ([Note: overflow at the minimum scale] in `zkernel.kernel.loss_scale`).
    min_loss_scale: float = attrs.field(default=1.0, validator=fields.positive_number("min_loss_scale"))
    # True: an overflow at min_loss_scale raises zkernel.LossScaleError from engine.step() after
    # recording the skipped step; false: skip and go on.
    loss_scale_error_at_min: bool = attrs.field(default=True, validator=fields.true_or_false("loss_scale_error_at_min"))
    # Extra plugin modules by dotted path ("pkg.module" or "pkg.module:object").
    plugins: tuple[str, ...] = attrs.field(default=(), converter=fields.str_tuple("plugins"))
    # Plugin names (as `zkernel plugins` lists them) never to load.
    blocked_plugins: tuple[str, ...] = attrs.field(
        default=(), converter=fields.str_tuple("blocked_plugins")
    )
    # Log every hook call as zkernel.hook.trace debug events (as ZKERNEL_TRACE_HOOKS=1 does).
    trace_hooks: bool = attrs.field(default=False, validator=fields.true_or_false("trace_hooks"))
    # console or json: a hint for front-ends (the CLI's --log-json); the library never configures logging.
    log_format: str = attrs.field(default="console", validator=fields.one_of("log_format", LOG_FORMATS))
    # When set, torch.manual_seed(seed) on every rank in initialize.
    seed: int | None = None
    # Seconds a collective may take before the process group gives up (when zkernel creates it).
    collective_timeout: float = attrs.field(default=600.0, validator=fields.non_negative_number("collective_timeout"))
    # Per-step timeline of compute and transfers, logged as `zkernel.step.timeline` (INFO).
    timeline: bool = attrs.field(default=False, validator=fields.true_or_false("timeline"))
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



def _with_sections(core: type) -> type:
    """`CoreConfig` plus a field per family section, in the families' declaration order."""
    sections = {
        family.section: attrs.field(factory=family.schema, type=family.schema)
        for family in Family
        if family.section
    }
    cls = attrs.make_class("Config", sections, bases=(core,), frozen=True, kw_only=True, slots=True)
    cls.__module__ = __name__
    cls.__qualname__ = "Config"
    cls.__doc__ = (
        "The whole configuration of one engine (see docs/guide/configuration.md): the kernel's own keys\n"
        "(`CoreConfig`) and one section per family that declares one (`zkernel.spec.registry.Family`)."
    )
    return cls


Config = _with_sections(CoreConfig)


def auto_keys(config: Config) -> tuple[str, ...]:
    """The keys of `AUTO_KEYS` whose value is ``"auto"`` (the planner resolves them at `initialize`)."""
    return tuple(key for key in AUTO_KEYS if config_value(config, key) == AUTO)


def section_keys(section: str) -> tuple[str, ...]:
    """The keys a family's section takes itself, before any component's options."""
    return Family.of_section(section).section_keys()


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
    for family in Family:
        if family.section in kwargs:
            kwargs[family.section] = build_section(family.section, family.schema, kwargs[family.section])
        for slot in family.slots:  # a family without a section keeps its options at the top level
            if "." not in slot.options and slot.options in kwargs and not isinstance(kwargs[slot.options], Mapping):
                raise ConfigError(f"{slot.options} must be a table (mapping)")
    try:
        return Config(**kwargs)
    except TypeError as exc:  # attrs raises TypeError for wrong argument shapes
        raise ConfigError(str(exc)) from exc
