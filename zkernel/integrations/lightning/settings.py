"""What the Lightning Trainer decides, as zkernel config: precision, accumulation, clipping; and the
named presets the strategy registers.

[Note: the Trainer's settings win] ``Trainer(precision=..., accumulate_grad_batches=...,
gradient_clip_val=...)`` is where a Lightning user says these, so they fill the config's
``precision``, ``gradient_accumulation_steps`` and ``gradient_clipping``. A config that sets one of
them to something else than its default and than the Trainer's is a `ConfigError` naming both,
never one of the two silently lost (the same rule as Lightning's DeepSpeed strategy for
``gradient_accumulation_steps``). A DeepSpeed config without ``gradient_clipping`` reads
as ``"auto"`` here (DeepSpeed's own default, 1.0, would otherwise contradict a Trainer
that does not clip): the Trainer's ``gradient_clip_val`` decides, as under Lightning's
DeepSpeed strategy.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import attrs

from zkernel.compat.deepspeed.config import is_deepspeed_config, read_deepspeed_json
from zkernel.errors import ConfigError
from zkernel.kernel.config_source import load_config
from zkernel.spec.config import Config

# Lightning's precision flags and the config's precision for each. "-mixed" and "-true" both
# step fp32 masters and compute in the half type, as Lightning's DeepSpeed strategy maps them.
PRECISIONS = {
    "32-true": "fp32",
    "32": "fp32",
    "bf16-mixed": "bf16",
    "bf16-true": "bf16",
    "16-mixed": "fp16",
    "16-true": "fp16",
}
_DEFAULTS = Config()

# name -> (description, config). `ZKernelStrategy.register_strategies` registers each.
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "zkernel": ("zkernel ZeRO-3, zkernel_stage_3's config", {"partitioner": "zero3"}),
    "zkernel_stage_1": ("zkernel ZeRO-1: optimizer state partitioned", {"partitioner": "zero1"}),
    "zkernel_stage_2": ("zkernel ZeRO-2: optimizer state and gradients partitioned", {"partitioner": "zero2"}),
    "zkernel_stage_2_offload": (
        "zkernel ZeRO-2, optimizer state and step on the CPU",
        {"partitioner": "zero2", "offload": {"optimizer": "cpu"}},
    ),
    "zkernel_stage_3": ("zkernel ZeRO-3: parameters partitioned too", {"partitioner": "zero3"}),
    "zkernel_stage_3_offload": (
        "zkernel ZeRO-3, optimizer and parameters offloaded to the CPU",
        {"partitioner": "zero3", "offload": {"optimizer": "cpu", "params": "cpu"}},
    ),
    "zkernel_stage_3_offload_nvme": (
        "zkernel ZeRO-3, optimizer and parameters offloaded to NVMe (nvme_path=..., default /local_nvme)",
        {"partitioner": "zero3", "offload": {"optimizer": "nvme", "params": "nvme", "nvme_path": "/local_nvme"}},
    ),
}


def load_base_config(source: Any) -> Config:
    """The `Config` a strategy's ``config=`` names (what `zkernel.initialize` takes), before the Trainer's
    settings; a DeepSpeed config's absent ``gradient_clipping`` is left to the Trainer."""
    if isinstance(source, (str, os.PathLike)) and str(source).lower().endswith(".json"):
        raw = read_deepspeed_json(source)
        if is_deepspeed_config(raw):
            source = raw
    if isinstance(source, Mapping):
        source = dict(source)
        if is_deepspeed_config(source):
            source.setdefault("gradient_clipping", "auto")
    return load_config(source)


def precision_of(flag: Any) -> str:
    """The config's precision for Lightning's precision flag; a `ConfigError` listing the valid ones."""
    key = str(flag)
    if key not in PRECISIONS:
        raise ConfigError(
            f"ZKernelStrategy does not support Trainer(precision={flag!r}); valid: "
            f"{', '.join(repr(k) for k in PRECISIONS)}"
        )
    return PRECISIONS[key]


def clipping_of(value: Any, algorithm: Any) -> float:
    """``gradient_clipping`` for the Trainer's ``gradient_clip_val``/``gradient_clip_algorithm``."""
    if value is None or float(value) == 0.0:
        return 0.0
    if str(getattr(algorithm, "value", algorithm) or "norm") != "norm":
        raise ConfigError(
            f"ZKernelStrategy clips the global gradient norm only; Trainer(gradient_clip_algorithm={algorithm!r}) "
            "is not supported: use gradient_clip_algorithm='norm' (the default)"
        )
    return float(value)


def with_trainer_settings(config: Config, *, precision: str, accumulation: int, clipping: float) -> Config:
    """``config`` with the Trainer's settings ([Note: the Trainer's settings win])."""
    trainer = {"precision": precision, "gradient_accumulation_steps": int(accumulation), "gradient_clipping": clipping}
    lightning = {
        "precision": "Trainer(precision=...)",
        "gradient_accumulation_steps": "Trainer(accumulate_grad_batches=...)",
        "gradient_clipping": "Trainer(gradient_clip_val=...)",
    }
    for key, value in trainer.items():
        given = getattr(config, key)
        if given != getattr(_DEFAULTS, key) and given != value:
            raise ConfigError(
                f"the config's {key} = {given!r} contradicts the Trainer's {lightning[key]} ({key} = {value!r}); "
                f"under Lightning set it with {lightning[key]} and leave it out of the config"
            )
    return attrs.evolve(config, **trainer)
