"""The config sections of the families: one frozen attrs class per family's table.

[Note: family sections] A family that has a table of its own in the config
(``[optimizer]``, ``[offload]``, ``[tiling]``, ...) declares its schema here and
names it in its `zkernel.spec.registry.Family` member (``FamilySpec.section`` and
``schema``); `zkernel.spec.config.Config` gets one field per declared section,
`config_from_dict` builds it with `build_section`, and `section_keys` lists its
own keys, all from that declaration. A section's own keys apply to whichever
component is selected (an optimizer's ``lr``); keys it does not know go to its
``options`` field, where it has one, and are the selected component's own
(validated by `zkernel.spec.registry.ComponentRegistry.select`). Defaults that
name a builtin (``name = "adamw"``) are data: the component selected unless the
user names another.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from zkernel.errors import ConfigError
from zkernel.spec import fields
from zkernel.spec.fields import str_tuple

# Where ``[activation_checkpointing]`` keeps the saved inputs of checkpointed modules.
ACTIVATION_OFFLOADS = ("none", "cpu")


@attrs.frozen(kw_only=True)
class ParamGroupConfig:
    """One ``[[optimizer.param_groups]]`` entry: parameters stepped with their own hyperparameters."""

    # fnmatch patterns of parameter names or class names of owning modules.
    params: tuple[str, ...] = attrs.field(converter=fields.str_tuple("optimizer.param_groups.params"))
    # Multiplies the step's learning rate (the schedule's, when one is set) for these parameters.
    lr_scale: float = attrs.field(default=1.0, validator=fields.non_negative_number("optimizer.param_groups.lr_scale"))
    # Their weight decay; None: [optimizer] weight_decay.
    weight_decay: float | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(fields.non_negative_number("optimizer.param_groups.weight_decay")),
    )
    # Their Adam betas; None: the step's ([optimizer] betas, or what the schedule sets).
    betas: tuple[float, float] | None = attrs.field(
        default=None, converter=attrs.converters.optional(fields.betas("optimizer.param_groups.betas"))
    )
    # Their Adam epsilon; None: [optimizer] eps.
    eps: float | None = attrs.field(
        default=None, validator=attrs.validators.optional(fields.non_negative_number("optimizer.param_groups.eps"))
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

    # adamw (torch's AdamW where the shard lives), cpu_adam (native SIMD Adam on host shards), or a
    # third-party optimizer's name.
    name: str = attrs.field(default="adamw", validator=fields.component_name("optimizer.name"))
    # Learning rate; engine.lr changes it between steps, and [lr_schedule] sets it at every step.
    lr: float = attrs.field(default=1e-3, validator=fields.non_negative_number("optimizer.lr"))
    # Adam's betas, two numbers in [0, 1).
    betas: tuple[float, float] = attrs.field(default=(0.9, 0.999), converter=fields.betas("optimizer.betas"))
    # Adam's epsilon.
    eps: float = attrs.field(default=1e-8, validator=fields.non_negative_number("optimizer.eps"))
    # Weight decay (decoupled unless the optimizer's own option says otherwise).
    weight_decay: float = attrs.field(
        default=0.0, validator=fields.non_negative_number("optimizer.weight_decay")
    )
    # fnmatch patterns of parameter names or class names of owning modules stepped without weight
    # decay ([Note: per-parameter hyperparameters] in `zkernel.kernel.param_hyper`).
    no_weight_decay: tuple[str, ...] = attrs.field(default=(), converter=fields.str_tuple("optimizer.no_weight_decay"))
    # Parameters with a learning-rate scale, weight decay, betas or eps of their own, as a torch
    # optimizer's parameter groups (the first entry a parameter matches; see `zkernel.kernel.param_hyper`).
    param_groups: tuple[ParamGroupConfig, ...] = attrs.field(default=(), converter=_param_groups)
    options: Mapping[str, Any] = attrs.field(factory=dict, converter=fields.options_table)


@attrs.frozen(kw_only=True)
class OffloadConfig:
    """``[offload]``: the storage tier of optimizer state and of parameters, each with its own options."""

    # Tier of the fp32 masters, optimizer state and gradient landing buffers: none (the compute
    # device), cpu (page-locked host memory), nvme (swap files under nvme_path), "auto", or a
    # third-party tier.
    optimizer: str = attrs.field(default="none", validator=fields.component_name("offload.optimizer"))
    # Tier of each rank's compute-dtype parameter shard: none, cpu, nvme or "auto" (anything but none
    # needs a partitioner that keeps parameters on a tier, such as zero3).
    params: str = attrs.field(default="none", validator=fields.component_name("offload.params"))
    # Directory on the NVMe disk for the nvme tier's swap files; required when a tier is nvme.
    nvme_path: Path | None = attrs.field(
        default=None, converter=attrs.converters.optional(Path)
    )
    # Options of the tier selected for each role, validated against that tier's own class.
    optimizer_options: Mapping[str, Any] = attrs.field(factory=dict, converter=fields.table("offload.optimizer_options"))
    # As optimizer_options, for the tier of offload.params.
    params_options: Mapping[str, Any] = attrs.field(factory=dict, converter=fields.table("offload.params_options"))


@attrs.frozen(kw_only=True)
class TilingConfig:
    """``[tiling]``: which ``nn.Linear`` layers are split into tiles, and by which component.

    Keys other than these go to ``options`` (the selected component's own).
    """

    # The tiling component: linear, or a third-party name.
    name: str = attrs.field(default="linear", validator=fields.component_name("tiling.name"))
    # fnmatch patterns of module names (``"blocks.*.fc"``) of the layers to tile.
    modules: tuple[str, ...] = attrs.field(default=(), converter=fields.str_tuple("tiling.modules"))
    # Also tile every layer whose weight has at least this many elements; 0 = off.
    min_numel: int = attrs.field(default=0, validator=fields.non_negative_int("tiling.min_numel"))
    # Tiles per layer.
    tiles: int = attrs.field(default=4, validator=fields.positive_int("tiling.tiles"))
    options: Mapping[str, Any] = attrs.field(factory=dict, converter=fields.options_table)


@attrs.frozen(kw_only=True)
class ActivationCheckpointingConfig:
    """``[activation_checkpointing]``: which modules recompute their activations in backward.

    Keys other than these go to ``options`` (the selected component's own).
    """

    # The checkpointing component: recompute, or a third-party name.
    name: str = attrs.field(default="recompute", validator=fields.component_name("activation_checkpointing.name"))
    # Class names (``"Block"``) or fnmatch patterns of module names (``"blocks.*"``).
    modules: tuple[str, ...] = attrs.field(default=(), converter=fields.str_tuple("activation_checkpointing.modules"))
    # Where the saved inputs of each checkpointed module wait for backward.
    offload: str = attrs.field(
        default="none", validator=fields.one_of("activation_checkpointing.offload", ACTIVATION_OFFLOADS)
    )
    options: Mapping[str, Any] = attrs.field(factory=dict, converter=fields.options_table)


@attrs.frozen(kw_only=True)
class LRScheduleConfig:
    """``[lr_schedule]``: which schedule sets the learning rate of each step (see `zkernel.spec.lr_schedule`).

    Keys other than ``name`` go to ``options`` (the selected schedule's own).
    """

    # none (engine.lr as your loop sets it), warmup, warmup_decay, warmup_cosine, one_cycle,
    # lr_range_test (DeepSpeed's five), or a third-party schedule's name.
    name: str = attrs.field(default="none", validator=fields.component_name("lr_schedule.name"))
    options: Mapping[str, Any] = attrs.field(factory=dict, converter=fields.options_table)


@attrs.frozen(kw_only=True)
class PlannerConfig:
    """``[planner]``: which planner resolves ``"auto"`` (see `zkernel.kernel.planning`), with hints and overrides.

    Keys other than these go to ``options`` (the selected planner's own).
    """

    # The planner component that resolves "auto": default, or a third-party name.
    name: str = attrs.field(default="default", validator=fields.component_name("planner.name"))
    # Activation hints: sequences per rank per micro-batch and tokens per sequence. Without them
    # the planner places model states only (and says so in its decision).
    micro_batch: int | None = attrs.field(default=None, validator=fields.optional_positive_int("planner.micro_batch"))
    # Tokens per sequence (default: the model's position-embedding length, if it has one).
    sequence: int | None = attrs.field(default=None, validator=fields.optional_positive_int("planner.sequence"))
    # The model takes its loss with `zkernel.tiled_cross_entropy`: its head keeps no logits.
    tiled_loss: bool = attrs.field(default=False, validator=fields.true_or_false("planner.tiled_loss"))
    # What the planner takes as this machine's capacities instead of what it detects (bytes, or
    # a string with a unit): free memory per GPU, available host memory, free disk at nvme_path.
    gpu_memory: int | None = attrs.field(default=None, converter=fields.size("planner.gpu_memory"))
    # Available host memory, as gpu_memory above.
    ram: int | None = attrs.field(default=None, converter=fields.size("planner.ram"))
    # Free disk at offload.nvme_path, as gpu_memory above.
    disk: int | None = attrs.field(default=None, converter=fields.size("planner.disk"))
    options: Mapping[str, Any] = attrs.field(factory=dict, converter=fields.options_table)


def own_keys(schema: type) -> tuple[str, ...]:
    """The keys a section takes itself, before any component's options."""
    return tuple(a.name for a in attrs.fields(schema) if a.name != "options")


def build_section(key: str, schema: type, raw: Any) -> Any:
    """A section from a mapping; keys it does not know are its component's options where it has
    ``options`` (``[optimizer]``), else errors."""
    if isinstance(raw, schema):
        return raw
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{key} must be a table (mapping), got {type(raw).__name__}")
    known = set(own_keys(schema))
    kwargs = {k: v for k, v in raw.items() if k in known}
    extra = {k: v for k, v in raw.items() if k not in known}
    if "options" not in {a.name for a in attrs.fields(schema)}:
        if extra:
            raise ConfigError(f"unknown config key {key}.{sorted(extra)[0]}; valid: {', '.join(own_keys(schema))}")
        return schema(**kwargs)
    if "options" in extra:
        extra.update(extra.pop("options"))
    return schema(**kwargs, options=extra)
