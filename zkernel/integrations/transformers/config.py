"""The engine's config for a `ZKernelTrainer`: the user's ``zkernel_config`` with the Trainer's arguments in it.

[Note: the arguments fill the config] A Trainer user states the learning rate, Adam's betas and
epsilon, the weight decay, the warm-up, gradient accumulation, clipping, the micro-batch and
bf16/fp16 once, in ``TrainingArguments``. The config (a zkernel dict or file, or a DeepSpeed JSON)
may repeat them. As the Trainer does with a DeepSpeed config (its ``HfTrainerDeepSpeedConfig``):

* a value written ``"auto"`` is replaced by the argument's;
* a value the config states that differs from the argument is an error naming both, all of them in
  one `ConfigError`, raised when the Trainer is built (`check_against_arguments`), before training;
* where the config is silent about something the Trainer's loop depends on (the accumulation steps,
  clipping, the precision), the argument's value is written in, so the engine steps when the
  Trainer's loop does; the optimizer's hyperparameters likewise;
* keys only a model or the step count can fill (DeepSpeed's bucket sizes from ``hidden_size``, a
  scheduler's ``total_num_steps`` and ``warmup_num_steps``) are filled when the engine is built
  (`resolve`), with the step count the Trainer computed.

The Trainer's parameter groups (no weight decay on biases and normalisation weights) become
``[optimizer] no_weight_decay`` / ``param_groups`` (`zkernel.compat.torch_optim`), unless a zkernel
config names its own.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from zkernel.compat.deepspeed.config import from_deepspeed_config, is_deepspeed_config, read_deepspeed_json
from zkernel.errors import ConfigError
from zkernel.compat.torch_optim import TorchAdam
from zkernel.integrations.transformers.optimizer import TRAINER_ORIGIN
from zkernel.spec.config import Config, config_from_dict

# A DeepSpeed scheduler's params the Trainer fills from the step count (``trainer_config_finalize``).
_STEP_COUNT_KEYS = ("scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps")
# DeepSpeed keys the Trainer fills from the model's hidden size where they are "auto".
_HIDDEN_SIZE_KEYS = (
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
)
_ADAM_TYPES = ("adam", "adamw")


def read_source(source: Any) -> dict[str, Any]:
    """``zkernel_config`` as a plain dict (a deep copy): a dict, or a .json (zkernel's or DeepSpeed's) or
    .toml file. A `zkernel.Config` is refused: the Trainer fills "auto" values, which a built `Config`
    cannot hold."""
    if isinstance(source, Config):
        raise ConfigError(
            "zkernel_config=zkernel.Config(...) cannot take the Trainer's arguments; pass the same settings as a "
            "dict, or a path to a .json/.toml file (zkernel's or a DeepSpeed JSON)"
        )
    if isinstance(source, Mapping):
        return copy.deepcopy(dict(source))
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.suffix.lower() == ".toml":
            if not path.is_file():
                raise ConfigError(f"zkernel_config file {str(path)!r} does not exist")
            import tomllib

            return tomllib.loads(path.read_text())
        if path.suffix.lower() != ".json":
            raise ConfigError(f"zkernel_config file {str(path)!r} must end in .json or .toml")
        raw = read_deepspeed_json(path)
        if not isinstance(raw, Mapping):
            raise ConfigError(f"zkernel_config file {str(path)!r} must hold a JSON object, got {type(raw).__name__}")
        return dict(raw)
    raise ConfigError(
        "zkernel_config must be a dict or a path to a .json/.toml file (zkernel's config or a DeepSpeed JSON), "
        f"got {type(source).__name__}"
    )


class _Filler:
    """Fills dotted keys of one raw config from the arguments and records contradictions."""

    def __init__(self, raw: dict[str, Any], label: str) -> None:
        self.raw = raw
        self.label = label  # "DeepSpeed config" or "zkernel config"
        self.mismatches: list[str] = []

    def _node(self, key: str, create: bool) -> tuple[dict[str, Any] | None, str]:
        *parents, leaf = key.split(".")
        node: Any = self.raw
        for part in parents:
            if not isinstance(node, dict):
                return None, leaf
            if part not in node and create:
                node[part] = {}
            node = node.get(part)
        return (node if isinstance(node, dict) else None), leaf

    def value(self, key: str) -> Any:
        node, leaf = self._node(key, create=False)
        return None if node is None else node.get(leaf)

    def fill(self, key: str, value: Any, argument: str | None, *, when_absent: bool = False) -> None:
        """``"auto"`` -> ``value``; absent -> ``value`` where ``when_absent`` (its table created); a different
        stated value is a mismatch with ``argument`` (None: not a Trainer argument, never a mismatch)."""
        node, leaf = self._node(key, create=when_absent)
        if node is None:
            return
        current = node.get(leaf)
        if current == "auto" or (current is None and when_absent):
            node[leaf] = value
        elif current is not None and argument is not None and not _same(current, value):
            self.mismatches.append(f"{self.label} {key}={current!r} vs TrainingArguments {argument}={value!r}")

    def raise_mismatches(self) -> None:
        if self.mismatches:
            raise ConfigError(
                "zkernel_config contradicts the TrainingArguments:\n  - "
                + "\n  - ".join(self.mismatches)
                + "\nvalid: the same value in both, or \"auto\" (or no value) in the config, which then takes the "
                "argument's"
            )


def _same(stated: Any, argument: Any) -> bool:
    if isinstance(argument, bool) or isinstance(stated, bool):
        return stated is argument or stated == argument
    if isinstance(argument, (list, tuple)):
        return isinstance(stated, (list, tuple)) and len(stated) == len(argument) and all(
            _same(s, a) for s, a in zip(stated, argument)
        )
    if isinstance(argument, (int, float)) and isinstance(stated, (int, float)):
        return math.isclose(float(stated), float(argument), rel_tol=1e-12, abs_tol=0.0)
    return stated == argument


def _precision(args) -> str:
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


def _fill_deepspeed(filler: _Filler, args, world_size: int) -> None:
    """The Trainer's own fills of a DeepSpeed config (``trainer_config_process``), plus the keys its loop
    needs where the config is silent ([Note: the arguments fill the config])."""
    micro, steps = args.per_device_train_batch_size, args.gradient_accumulation_steps
    filler.fill("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size")
    filler.fill("gradient_accumulation_steps", steps, "gradient_accumulation_steps", when_absent=True)
    filler.fill("train_batch_size", world_size * micro * steps,
                "train_batch_size (world size x per_device_train_batch_size x gradient_accumulation_steps)")
    filler.fill("gradient_clipping", float(args.max_grad_norm or 0.0), "max_grad_norm", when_absent=True)
    filler.fill("optimizer.params.lr", args.learning_rate, "learning_rate")
    filler.fill("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1+adam_beta2")
    filler.fill("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    filler.fill("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    filler.fill("scheduler.params.warmup_min_lr", 0, None)
    filler.fill("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    fp16, bf16 = bool(args.fp16 or args.fp16_full_eval), bool(args.bf16 or args.bf16_full_eval)
    filler.fill("fp16.enabled", fp16, "fp16|fp16_full_eval", when_absent=fp16)
    filler.fill("bf16.enabled", bf16, "bf16|bf16_full_eval", when_absent=bf16)


def _fill_zkernel(filler: _Filler, args) -> None:
    """The same arguments, under zkernel's key names."""
    filler.fill("gradient_accumulation_steps", args.gradient_accumulation_steps, "gradient_accumulation_steps",
                when_absent=True)
    filler.fill("gradient_clipping", float(args.max_grad_norm or 0.0), "max_grad_norm", when_absent=True)
    filler.fill("precision", _precision(args), "bf16|fp16", when_absent=True)
    filler.fill("optimizer.lr", args.learning_rate, "learning_rate", when_absent=True)
    filler.fill("optimizer.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1+adam_beta2", when_absent=True)
    filler.fill("optimizer.eps", args.adam_epsilon, "adam_epsilon", when_absent=True)
    filler.fill("optimizer.weight_decay", args.weight_decay, "weight_decay", when_absent=True)


def _filled(source: Any, args, world_size: int) -> tuple[dict[str, Any], _Filler, bool]:
    raw = read_source(source)
    deepspeed = is_deepspeed_config(raw)
    filler = _Filler(raw, "DeepSpeed config" if deepspeed else "zkernel config")
    if deepspeed:
        _fill_deepspeed(filler, args, world_size)
    else:
        _fill_zkernel(filler, args)
    return raw, filler, deepspeed


def check_against_arguments(source: Any, args, world_size: int) -> None:
    """Raise the `ConfigError` `resolve` would for values that contradict ``args`` (and, for a zkernel
    config, for its structure: unknown keys, invalid values); called by `ZKernelTrainer.__init__`, so
    these stop the run before anything is built."""
    raw, filler, deepspeed = _filled(source, args, world_size)
    filler.raise_mismatches()
    if not deepspeed:
        config_from_dict(raw)


def refuse_double_checkpointing(raw: Mapping[str, Any], args) -> None:
    """Raise `ConfigError` where both the Trainer (``gradient_checkpointing``/``activation_checkpointing``)
    and the zkernel config checkpoint activations, or may: ``[activation_checkpointing] modules``, or a
    ``[planner] micro_batch``, with which the planner chooses whether to checkpoint the blocks itself
    ([Note: the Trainer's gradient checkpointing] in `zkernel.integrations.transformers.trainer`). Called
    by `ZKernelTrainer.__init__` with the config as the user wrote it. A DeepSpeed config's
    ``activation_checkpointing`` section selects no modules, so it never conflicts."""
    if not (getattr(args, "activation_checkpointing", False) or args.gradient_checkpointing):
        return
    section = raw.get("activation_checkpointing")
    modules = section.get("modules") if isinstance(section, Mapping) else None
    if modules:
        raise ConfigError(
            f"TrainingArguments(gradient_checkpointing=True) and the zkernel config's [activation_checkpointing] "
            f"modules={list(modules) if isinstance(modules, (list, tuple)) else modules!r} both checkpoint the "
            "model's layers: each would be recomputed twice in every backward; valid: one of them, either "
            "gradient_checkpointing=False with the config's modules, or no [activation_checkpointing] modules "
            "in the config"
        )
    planner = raw.get("planner")
    if isinstance(planner, Mapping) and planner.get("micro_batch") is not None:
        raise ConfigError(
            "TrainingArguments(gradient_checkpointing=True) and the zkernel config's [planner] "
            f"micro_batch={planner['micro_batch']!r}: the planner would size the activations as if none were "
            "checkpointed and may checkpoint the blocks itself, recomputing each twice in every backward; "
            "valid: gradient_checkpointing=False (the planner decides checkpointing), or no [planner] "
            "micro_batch (the planner then places the model states alone)"
        )


def has_lr_schedule(raw: Mapping[str, Any], deepspeed: bool) -> bool:
    """Whether the config sets the learning rate itself (DeepSpeed ``scheduler``, zkernel ``[lr_schedule]``)."""
    if deepspeed:
        return isinstance(raw.get("scheduler"), Mapping)
    schedule = raw.get("lr_schedule")
    return isinstance(schedule, Mapping) and schedule.get("name", "none") != "none"


def _hidden_size(model) -> int | None:
    config = getattr(model, "config", None)
    for owner in (config, getattr(config, "text_config", None)):
        if owner is None:
            continue
        if getattr(owner, "hidden_size", None):
            return int(owner.hidden_size)
        if getattr(owner, "hidden_sizes", None):
            return int(max(owner.hidden_sizes))
    return None


def resolve(source: Any, args, *, model, world_size: int, num_training_steps: int | None,
            trainer_optimizer) -> Config:
    """The engine's `Config` for a Trainer ([Note: the arguments fill the config]).

    ``trainer_optimizer``: the ``torch.optim`` optimizer the Trainer built from its arguments; where the
    config has no optimizer of its own it is the optimizer, and its parameter groups become
    ``no_weight_decay``/``param_groups`` (`zkernel.integrations.transformers.optimizer`).
    ``num_training_steps``: the Trainer's optimizer steps (None before `train`: a DeepSpeed schedule
    that needs them is then an error).
    """
    raw, filler, deepspeed = _filled(source, args, world_size)
    mapping = TorchAdam(trainer_optimizer, model, TRAINER_ORIGIN)  # refuses an optimizer zkernel does not have
    if deepspeed:
        _finalize_deepspeed(filler, args, model, num_training_steps)
        filler.raise_mismatches()
        if "optimizer" not in raw:
            raw["optimizer"] = mapping.deepspeed_section()
        config = from_deepspeed_config(raw)
    else:
        filler.raise_mismatches()
        config = config_from_dict(_zkernel_optimizer(raw, mapping))
    if config.optimizer.no_weight_decay or config.optimizer.param_groups:
        return config  # a zkernel config's own groups
    return attrs.evolve(config, optimizer=mapping.with_groups(config.optimizer))


def _zkernel_optimizer(raw: dict[str, Any], mapping: TorchAdam) -> dict[str, Any]:
    """A zkernel config's ``[optimizer]`` without a ``name``: the Trainer's optimizer, as DeepSpeed's maps
    (the CPU Adam where its state lives off the device)."""
    optimizer = raw.setdefault("optimizer", {})
    if not isinstance(optimizer, dict) or "name" in optimizer:
        return raw
    offload = raw.get("offload", {})
    if isinstance(offload, Mapping) and offload.get("optimizer", "none") not in ("none", "auto"):
        optimizer["name"] = "cpu_adam"
    if not mapping.decoupled and mapping.base()[1].weight_decay:
        optimizer.setdefault("decoupled_weight_decay", False)
    return raw


def _finalize_deepspeed(filler: _Filler, args, model, num_training_steps: int | None) -> None:
    """The Trainer's ``trainer_config_finalize``: keys filled from the model and the step count."""
    auto_sized = [key for key in _HIDDEN_SIZE_KEYS if filler.value(key) == "auto"]
    if auto_sized:
        hidden = _hidden_size(model)
        if hidden is None:
            raise ConfigError(
                f"DeepSpeed config keys {auto_sized} are \"auto\", filled from the model's config.hidden_size, "
                "which this model's config does not have; valid: integers in place of \"auto\""
            )
        filler.fill("zero_optimization.reduce_bucket_size", hidden * hidden, None)
        filler.fill("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * hidden * hidden), None)
        filler.fill("zero_optimization.stage3_param_persistence_threshold", 10 * hidden, None)
    if num_training_steps is None:
        needed = [key for key in _STEP_COUNT_KEYS if filler.value(key) == "auto"]
        if needed:
            raise ConfigError(
                f"DeepSpeed config keys {needed} are \"auto\", filled from the number of training steps, which is "
                "known only in train(); valid: TrainingArguments(max_steps=...) before evaluate()/predict(), or "
                "numbers in the config"
            )
        return
    filler.fill("scheduler.params.total_num_steps", num_training_steps, "num_training_steps (calculated)")
    filler.fill("scheduler.params.warmup_num_steps", args.get_warmup_steps(num_training_steps), "warmup_steps")

