"""Migration from DeepSpeed: read a DeepSpeed JSON config as a `zkernel.Config`.

`from_deepspeed_config` maps what has a meaning here and accounts for every
other key: each DeepSpeed key is either

* mapped to a zkernel key (``zero_optimization.stage`` -> ``partitioner``, ...),
* built in: zkernel always behaves the way the value asks (``overlap_comm:
  true``: reduction always overlaps backward), so there is nothing to set,
* without an equivalent: listed, with the reason, in ONE warning event
  ``zkernel.deepspeed.unmapped`` on the ``zkernel`` logger, never silently
  dropped, or
* a value zkernel cannot honour (static fp16 loss scaling, fp16/bf16 master
  weights, an optimizer other than Adam/AdamW): a `ConfigError` naming the key.

A key DeepSpeed's own schema does not know (`zkernel.compat.deepspeed.schema`)
is a typo: a `ConfigError` naming it and the closest valid key, before anything
is mapped ([Note: unknown DeepSpeed keys]). A key left out takes DeepSpeed's
default where it differs from zkernel's (``gradient_clipping``: 1.0).

``"auto"`` values (as the Hugging Face Trainer writes them, to be filled in
from its own arguments) are treated as absent: zkernel's default applies, and
the warning lists each such key with the value it took (``auto_values``).
``train_batch_size`` and ``train_micro_batch_size_per_gpu`` give the accumulation steps where ``gradient_accumulation_steps`` is absent, as
DeepSpeed derives them (``train_batch_size = micro-batch x steps x world
size``, the world size being torchrun's ``WORLD_SIZE``), and a triple that
disagrees is an error, as in DeepSpeed; otherwise they are reported in the
``zkernel.deepspeed.config`` info event: the micro-batch is whatever the
training loop feeds the engine.

`is_deepspeed_config` is what `zkernel.kernel.config_source.load_config` asks, so
``zkernel.initialize(model, "ds_config.json")`` and ``zkernel config
ds_config.json`` take a DeepSpeed config as is.
"""

from __future__ import annotations

import difflib
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from zkernel.spec.config import Config, ConfigError, config_from_dict
from zkernel.compat.deepspeed import schema
from zkernel.compat.deepspeed.scheduler import map_scheduler
from zkernel.telemetry.log import get_logger

log = get_logger()

# Keys only a DeepSpeed config has at the top level (a zkernel config rejects all of them).
_MARKERS = ("zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu", "fp16", "bf16")

_PARTITIONERS = {0: "none", 1: "zero1", 2: "zero2", 3: "zero3"}
_OFFLOAD_DEVICES = ("none", "cpu", "nvme")
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# DeepSpeed's default gradient_clipping (GRADIENT_CLIPPING_DEFAULT in its runtime/constants.py, 1.0 since
# its PR #8068 and in 0.19.8); zkernel's own default (0.0: no clipping) is for zkernel configs.
_GRADIENT_CLIPPING_DEFAULT = 1.0

# DeepSpeed keys whose value zkernel always has: (value that matches, what zkernel does).
_BUILT_IN = {
    "zero_optimization.overlap_comm": (True, "gradient reduction always overlaps backward"),
    "zero_optimization.contiguous_gradients": (True, "gradients always land in contiguous flat buffers"),
    "zero_optimization.reduce_scatter": (True, "zero1/zero2/zero3 always reduce-scatter gradients"),
    "zero_optimization.allgather_partitions": (True, "updated partitions are always all-gathered"),
    "zero_optimization.ignore_unused_parameters": (True, "parameters without a gradient are skipped, as torch skips them"),
    "zero_optimization.load_from_fp32_weights": (True, "fp32 masters are what a checkpoint restores"),
    "zero_optimization.offload_optimizer.pin_memory": (True, "the CPU tier keeps its buffers in pinned memory"),
    "zero_optimization.offload_param.pin_memory": (True, "the CPU tier keeps its buffers in pinned memory"),
    "fp16.auto_cast": (True, "floating-point inputs are always cast to the compute dtype"),
    "optimizer.params.amsgrad": (False, "Adam without amsgrad"),
    "optimizer.params.torch_adam": (True, "the adamw optimizer is torch's"),
    "optimizer.params.fused": (True, "the adamw optimizer uses torch's fused kernel where the device has one"),
}


def is_deepspeed_config(raw: Any) -> bool:
    """Whether ``raw`` (a mapping) is a DeepSpeed config rather than a zkernel one."""
    if not isinstance(raw, Mapping):
        return False
    if any(key in raw for key in _MARKERS):
        return True
    optimizer = raw.get("optimizer")
    return isinstance(optimizer, Mapping) and ("type" in optimizer or "params" in optimizer)


class _Reader:
    """Walks a DeepSpeed config, recording what each key became."""

    def __init__(self, raw: Mapping[str, Any]) -> None:
        self.raw = raw
        self.unmapped: list[str] = []  # "key (reason)"
        self.auto: list[str] = []  # keys left to zkernel's defaults
        self.consumed: set[str] = set()  # keys read by a mapping
        self.covered: set[str] = set()  # tables reported whole (their keys are not listed again)

    # -- access ------------------------------------------------------------------

    def section(self, key: str) -> Mapping[str, Any]:
        value = self.get(key)
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise ConfigError(f"DeepSpeed config key {key} must be a table (mapping), got {value!r}")
        return value

    def peek(self, key: str) -> Any:
        """The value at dotted ``key`` (None when absent), without accounting for it."""
        node: Any = self.raw
        for part in key.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return None
            node = node[part]
        return node

    def get(self, key: str) -> Any:
        """The value at dotted ``key``, None when absent or "auto" (noted), accounted for as read."""
        node = self.peek(key)
        if node is None:
            return None
        self.consumed.add(key)
        if node == "auto":
            if key not in self.auto:
                self.auto.append(key)
            return None
        return node

    # -- typed values -------------------------------------------------------------

    def boolean(self, key: str) -> bool | None:
        value = self.get(key)
        if value is not None and not isinstance(value, bool):
            raise ConfigError(f"DeepSpeed config key {key} {value!r} is not valid; valid: true, false or \"auto\"")
        return value

    def integer(self, key: str, minimum: int = 0) -> int | None:
        """An integer; DeepSpeed configs write sizes like ``5e8``, so integral floats count."""
        value = self.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value != int(value) or value < minimum:
            raise ConfigError(f"DeepSpeed config key {key} {value!r} is not valid; valid: an integer >= {minimum}")
        return int(value)

    def number(self, key: str, minimum: float = 0.0) -> float | None:
        value = self.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < minimum:
            raise ConfigError(f"DeepSpeed config key {key} {value!r} is not valid; valid: a number >= {minimum}")
        return value

    # -- bookkeeping --------------------------------------------------------------

    def no_equivalent(self, key: str, reason: str) -> None:
        """Report ``key`` (a value or a whole table) as having no equivalent, if it is set."""
        if self.get(key) is not None:
            self.unmapped.append(f"{key} ({reason})")
        self.covered.add(key)

    def leftovers(self) -> None:
        """Every key no mapping read: built in when its value matches, else without an equivalent."""
        for key in _walk(self.raw):
            if key in self.consumed or any(key == c or key.startswith(c + ".") for c in self.covered):
                continue
            value = self.get(key)
            if value is None:
                continue
            built_in = _BUILT_IN.get(key)
            if built_in is not None and value == built_in[0]:
                continue
            if built_in is not None:
                self.unmapped.append(f"{key}={value!r} (zkernel cannot change this: {built_in[1]})")
            else:
                self.unmapped.append(f"{key} (no equivalent in zkernel)")


def _suggest(section: str, key: str, known: frozenset[str]) -> str:
    """``did you mean 'x'?`` for the synonym or closest spelling among ``known``, else what is valid."""
    synonym = schema.SYNONYMS.get(section, {}).get(key)
    if synonym is not None:
        return f"did you mean {synonym!r}?"
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}?" if close else f"valid: {', '.join(sorted(known))}"


def _check_keys(raw: Mapping[str, Any]) -> None:
    """Reject every key DeepSpeed's own schema does not know ([Note: unknown DeepSpeed keys])."""
    sections = dict(schema.SECTIONS)
    optimizer = raw.get("optimizer")
    if isinstance(optimizer, Mapping) and str(optimizer.get("type", "")).lower() in schema.ADAM_TYPES:
        sections["optimizer.params"] = schema.ADAM_PARAMS
    for section, known in sections.items():
        node: Any = raw
        for part in section.split(".") if section else ():
            node = node.get(part) if isinstance(node, Mapping) else None
        if not isinstance(node, Mapping):
            continue  # absent, or a value whose type the mapping checks
        removed = schema.REMOVED.get(section, frozenset())
        known = known | schema.LEGACY.get(section, frozenset())
        for key in node:
            dotted = f"{section}.{key}" if section else key
            if key in removed:
                raise ConfigError(
                    f"DeepSpeed config key {dotted} was removed from DeepSpeed (its {schema.DEEPSPEED_VERSION} "
                    "rejects it too); valid: remove the key"
                )
            if key not in known:
                where = f"in {section}" if section else "at the top level"
                raise ConfigError(
                    f"DeepSpeed config key {dotted} is not a key DeepSpeed {schema.DEEPSPEED_VERSION} knows "
                    f"{where}; {_suggest(section, key, known)}"
                )


# [Note: unknown DeepSpeed keys]
# A key DeepSpeed knows and zkernel does not map is reported in the one warning: the config is a
# valid DeepSpeed config, and the run differs from DeepSpeed's only where the warning says. A key
# DeepSpeed does not know is a typo (DeepSpeed's pydantic sections forbid it too): accepting it would
# train with a default the user did not ask for, or, for a misspelled zero_optimization, with no
# partitioning at all. So it is an error naming the closest valid key. The tables are
# `zkernel.compat.deepspeed.schema`, one DeepSpeed release's schema.


def _walk(node: Mapping[str, Any], prefix: str = ""):
    for key, value in node.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _walk(value, dotted + ".")
        else:
            yield dotted


def _offload(reader: _Reader, key: str) -> tuple[str, str | None]:
    """(tier name, nvme_path) of ``zero_optimization.offload_optimizer``/``offload_param``."""
    section = reader.section(key)
    if not section:
        return "none", None
    device = reader.get(f"{key}.device")
    device = "none" if device is None else device
    if device not in _OFFLOAD_DEVICES:
        raise ConfigError(f"DeepSpeed config key {key}.device {device!r} is not valid; valid: none, cpu, nvme")
    path = reader.get(f"{key}.nvme_path")
    if path is not None and not isinstance(path, str):
        raise ConfigError(f"DeepSpeed config key {key}.nvme_path must be a path string, got {path!r}")
    reader.no_equivalent(f"{key}.buffer_count", "the tier sizes its own buffers")
    reader.no_equivalent(f"{key}.buffer_size", "the tier sizes its own buffers")
    reader.no_equivalent(f"{key}.max_in_cpu", "the NVMe tier keeps no parameter cache in CPU memory")
    reader.no_equivalent(f"{key}.fast_init", "no equivalent in zkernel")
    ratio = reader.number(f"{key}.ratio")
    if ratio is not None and ratio != 1:
        reader.unmapped.append(f"{key}.ratio={ratio!r} (the whole optimizer step runs on the CPU)")
    return device, path if device == "nvme" else None


def _aio(reader: _Reader, offload: dict[str, Any]) -> None:
    """Map ``aio.block_size`` to the ``aio_block_size`` of each nvme tier; the rest of ``aio`` has no equivalent."""
    from zkernel.platform.aio import ALIGNMENT  # imports torch: only where an nvme block size is given

    block = reader.integer("aio.block_size", minimum=1)
    roles = [role for role in ("optimizer", "params") if offload[role] == "nvme"]
    if block is not None and not roles:
        reader.unmapped.append("aio.block_size (no offload device is nvme)")
    elif block is not None:
        if block % ALIGNMENT:
            raise ConfigError(
                f"DeepSpeed config key aio.block_size {block} is not valid here; valid: a positive multiple of "
                f"{ALIGNMENT} (zkernel reads and writes swap files with O_DIRECT)"
            )
        for role in roles:
            offload[f"{role}_options"] = {**offload.get(f"{role}_options", {}), "aio_block_size": block}
    for key in ("queue_depth", "thread_count", "intra_op_parallelism"):
        reader.no_equivalent(f"aio.{key}", "requests in flight at the disk are offload.<role>_options.aio_threads")
    for key in ("single_submit", "overlap_events", "use_gds"):
        reader.no_equivalent(f"aio.{key}", "no equivalent in zkernel")


def _zero(reader: _Reader, out: dict[str, Any], precision: str) -> str:
    """Map ``zero_optimization``; returns the offload tier of the optimizer."""
    zero = reader.get("zero_optimization")
    if isinstance(zero, bool):  # DeepSpeed's old form: true means stage 1
        stage = 1 if zero else 0
        zero = {}
    else:
        zero = reader.section("zero_optimization")
        stage = reader.integer("zero_optimization.stage")
        stage = 0 if stage is None else stage
    if stage not in _PARTITIONERS:
        raise ConfigError(f"DeepSpeed config key zero_optimization.stage {stage!r} is not valid; valid: 0, 1, 2, 3")
    out["partitioner"] = _PARTITIONERS[stage]
    options: dict[str, Any] = {}

    optimizer_tier, optimizer_path = _offload(reader, "zero_optimization.offload_optimizer")
    if reader.boolean("zero_optimization.cpu_offload"):  # deprecated spelling of offload_optimizer cpu
        optimizer_tier = "cpu" if optimizer_tier == "none" else optimizer_tier
    params_tier, params_path = _offload(reader, "zero_optimization.offload_param")
    if params_tier != "none" and stage != 3:
        raise ConfigError(
            f"DeepSpeed config key zero_optimization.offload_param.device {params_tier!r} needs "
            f"zero_optimization.stage 3 (got stage {stage}); valid: offload_param.device \"none\", or stage 3"
        )
    if optimizer_path and params_path and os.path.normpath(optimizer_path) != os.path.normpath(params_path):
        raise ConfigError(
            "DeepSpeed config keys zero_optimization.offload_optimizer.nvme_path and offload_param.nvme_path "
            f"differ ({optimizer_path!r}, {params_path!r}); zkernel has one offload.nvme_path: make them equal"
        )
    offload: dict[str, Any] = {"optimizer": optimizer_tier, "params": params_tier}
    if optimizer_tier == "cpu" and reader.peek("zero_optimization.offload_optimizer.pin_memory") is False:
        # The cpu tier pins where CUDA is available unless told not to (its pin_memory option).
        reader.get("zero_optimization.offload_optimizer.pin_memory")
        offload["optimizer_options"] = {"pin_memory": False}
    if optimizer_path or params_path:
        offload["nvme_path"] = optimizer_path or params_path
    elif "nvme" in (optimizer_tier, params_tier):
        # DeepSpeed's device "nvme" needs its nvme_path; zkernel's nvme tier says the same at initialize.
        raise ConfigError("offload.nvme_path is required when offload.optimizer or offload.params is 'nvme'")
    _aio(reader, offload)
    out["offload"] = offload

    bucket = reader.integer("zero_optimization.reduce_bucket_size", minimum=1)
    if bucket is not None:
        if stage < 3:
            options["bucket_size"] = bucket
        else:
            reader.unmapped.append("zero_optimization.reduce_bucket_size (zero3 reduces each module's gradients at once)")
    threshold = reader.integer("zero_optimization.stage3_param_persistence_threshold")
    prefetch = reader.integer("zero_optimization.stage3_prefetch_bucket_size")
    if stage == 3:
        if threshold is not None:
            options["persistence_threshold"] = threshold
        if prefetch is not None:
            out["prefetch_bytes"] = prefetch * _DTYPE_BYTES[precision]
    else:
        for key, value in (("stage3_param_persistence_threshold", threshold), ("stage3_prefetch_bucket_size", prefetch)):
            if value is not None:
                reader.unmapped.append(f"zero_optimization.{key} (used at stage 3 only; this is stage {stage})")
    reader.no_equivalent("zero_optimization.allgather_bucket_size", "each bucket is all-gathered in one call")
    reader.no_equivalent("zero_optimization.stage3_max_live_parameters", "zero3 releases each module after use")
    reader.no_equivalent("zero_optimization.stage3_max_reuse_distance", "zero3 releases each module after use")
    reader.no_equivalent("zero_optimization.sub_group_size", "no equivalent in zkernel")
    if options:
        out["partitioner_options"] = options
    return optimizer_tier


def _precision(reader: _Reader, out: dict[str, Any]) -> str:
    fp16 = reader.boolean("fp16.enabled")
    bf16 = reader.boolean("bf16.enabled")
    if fp16 and bf16:
        raise ConfigError("DeepSpeed config keys fp16.enabled and bf16.enabled are both true; valid: at most one")
    precision = "fp16" if fp16 else "bf16" if bf16 else "fp32"
    out["precision"] = precision
    static = reader.number("fp16.loss_scale")
    if static is not None and static > 0 and not fp16:
        reader.unmapped.append(f"fp16.loss_scale={static!r} (fp16 is not enabled)")
    elif static is not None and static > 0:
        raise ConfigError(
            f"DeepSpeed config key fp16.loss_scale {static!r} asks for a static loss scale; zkernel has only "
            "dynamic loss scaling: valid: 0 (dynamic), with fp16.initial_scale_power for its start"
        )
    power = reader.integer("fp16.initial_scale_power")
    if power is not None:
        out["initial_loss_scale"] = float(2**power)
    window = reader.integer("fp16.loss_scale_window", minimum=1)
    if window is not None:
        out["loss_scale_window"] = window
    hysteresis = reader.integer("fp16.hysteresis", minimum=1)
    if hysteresis is not None or fp16:
        out["loss_scale_hysteresis"] = 2 if hysteresis is None else hysteresis  # DeepSpeed's default: 2
    floor = reader.number("fp16.min_loss_scale")
    if floor is not None:
        out["min_loss_scale"] = floor  # an overflow there stops the run, as in DeepSpeed (on by default)
    consecutive = reader.boolean("fp16.consecutive_hysteresis")
    if consecutive is not None:
        out["loss_scale_consecutive_hysteresis"] = consecutive
    for key, what, enabled in (
        ("fp16.fp16_master_weights_and_grads", "fp16", fp16),
        ("bf16.bf16_master_weights_and_grads", "bf16", bf16),
        ("bf16.bf16_optimizer_states", "bf16", bf16),
    ):
        if reader.boolean(key) and not enabled:
            reader.unmapped.append(f"{key} ({what} is not enabled)")
        elif reader.boolean(key):
            raise ConfigError(
                f"DeepSpeed config key {key} is true, but zkernel keeps master weights, gradients and "
                f"optimizer state in fp32, never {what}; valid: false"
            )
    return precision


def _optimizer(reader: _Reader, out: dict[str, Any], optimizer_tier: str) -> None:
    section = reader.section("optimizer")
    optimizer: dict[str, Any] = {"name": "cpu_adam" if optimizer_tier != "none" else "adamw"}
    out["optimizer"] = optimizer
    if not section:
        reader.unmapped.append(
            "optimizer (absent: DeepSpeed would step the optimizer passed in code; zkernel uses its default AdamW)"
        )
        return
    kind = reader.get("optimizer.type")
    if not isinstance(kind, str) or kind.lower() not in ("adam", "adamw"):
        raise ConfigError(f"DeepSpeed config key optimizer.type {kind!r} is not valid here; valid: Adam, AdamW")
    adam_w_mode = reader.boolean("optimizer.params.adam_w_mode")
    # DeepSpeed's Adam is AdamW unless adam_w_mode is false; its AdamW always is.
    decoupled = kind.lower() == "adamw" or adam_w_mode is not False
    if not decoupled:
        optimizer["decoupled_weight_decay"] = False
    lr = reader.number("optimizer.params.lr")
    if lr is not None:
        optimizer["lr"] = lr
    betas = reader.get("optimizer.params.betas")
    if betas is not None:
        if not (
            isinstance(betas, (list, tuple))
            and len(betas) == 2
            and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas)
        ):
            raise ConfigError(
                f"DeepSpeed config key optimizer.params.betas {betas!r} is not valid; valid: two numbers in [0, 1)"
            )
        optimizer["betas"] = list(betas)
    eps = reader.number("optimizer.params.eps")
    if eps is not None:
        optimizer["eps"] = eps
    weight_decay = reader.number("optimizer.params.weight_decay")
    if weight_decay is not None:
        optimizer["weight_decay"] = weight_decay
    if reader.peek("optimizer.params.amsgrad") is True:  # false is built in (see _BUILT_IN)
        raise ConfigError("DeepSpeed config key optimizer.params.amsgrad is true; zkernel's Adam has no amsgrad; valid: false")


def _batch_sizes(reader: _Reader, out: dict[str, Any]) -> tuple[int | None, int | None, int]:
    """Map ``gradient_accumulation_steps``, derived from the batch sizes where absent as DeepSpeed
    derives it; returns (micro-batch, global batch, world size) for the info event."""
    from zkernel.platform.distributed import expected_world_size  # imports torch: only for a DeepSpeed config

    accumulation = reader.integer("gradient_accumulation_steps", minimum=1)
    sizes = []
    for key in ("train_micro_batch_size_per_gpu", "train_batch_size"):
        reader.consumed.add(key)
        # "auto" is the Hugging Face Trainer's to fill in; absent or auto, zkernel needs neither.
        sizes.append(None if reader.peek(key) in (None, "auto") else reader.integer(key, minimum=1))
    micro, batch = sizes
    world = expected_world_size()  # the data-parallel world the config is for
    if accumulation is None and micro is not None and batch is not None:
        accumulation = max(1, batch // micro // world)
    where = f"world size {world}" + ("" if "WORLD_SIZE" in os.environ else " (one process: WORLD_SIZE is not set)")
    if batch is not None and micro is not None and batch != micro * accumulation * world:
        raise ConfigError(
            f"DeepSpeed config keys train_batch_size {batch} != train_micro_batch_size_per_gpu {micro} x "
            f"gradient_accumulation_steps {accumulation} x {where}; valid: a train_batch_size equal to that product, "
            "as DeepSpeed asserts"
        )
    if batch is not None and micro is None and batch % ((accumulation or 1) * world):
        raise ConfigError(
            f"DeepSpeed config key train_batch_size {batch} is not a multiple of gradient_accumulation_steps "
            f"{accumulation or 1} x {where}; valid: a multiple of it, as DeepSpeed asserts"
        )
    if accumulation is not None:
        out["gradient_accumulation_steps"] = accumulation
    return micro, batch, world


def read_deepspeed_json(source: Mapping[str, Any] | str | os.PathLike) -> Any:
    """The DeepSpeed config ``source`` names: a mapping as it is, or the JSON of a file path."""
    if not isinstance(source, (str, os.PathLike)):
        return source
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"DeepSpeed config file {str(path)!r} does not exist")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"DeepSpeed config file {str(path)!r} is not valid JSON: {exc}") from exc


def from_deepspeed_config(source: Mapping[str, Any] | str | os.PathLike) -> Config:
    """A `zkernel.Config` equivalent to a DeepSpeed config (a dict or a path to its .json file).

    Raises `ConfigError` naming the DeepSpeed key when a value cannot be
    honoured; keys without an equivalent are listed in one warning event.
    """
    raw = read_deepspeed_json(source)
    if not isinstance(raw, Mapping):
        raise ConfigError(f"a DeepSpeed config must be a mapping, got {type(raw).__name__}")
    _check_keys(raw)
    reader = _Reader(raw)
    out: dict[str, Any] = {}
    precision = _precision(reader, out)
    optimizer_tier = _zero(reader, out, precision)
    _optimizer(reader, out, optimizer_tier)
    micro_batch, batch, world = _batch_sizes(reader, out)
    clipping = reader.number("gradient_clipping")
    if clipping is not None:
        out["gradient_clipping"] = clipping
    elif reader.peek("gradient_clipping") is None:  # absent: DeepSpeed's default ("auto": zkernel's)
        out["gradient_clipping"] = _GRADIENT_CLIPPING_DEFAULT
    map_scheduler(reader, out)
    reader.leftovers()
    try:
        config = config_from_dict(out)
    except ConfigError as exc:
        raise ConfigError(f"DeepSpeed config maps to an invalid zkernel config: {exc}") from exc
    log.info(
        "zkernel.deepspeed.config",
        partitioner=config.partitioner,
        precision=config.precision,
        optimizer=config.optimizer.name,
        offload_optimizer=config.offload.optimizer,
        offload_params=config.offload.params,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        train_micro_batch_size_per_gpu=micro_batch,
        train_batch_size=batch,
        world_size=world,
        note="the engine steps on the micro-batches the training loop feeds it",
    )
    if reader.unmapped or reader.auto:
        log.warning(
            "zkernel.deepspeed.unmapped",
            ignored=reader.unmapped,
            auto_defaults=reader.auto,
            auto_values={key: _chosen(key, config) for key in reader.auto},
            note="ignored keys have no zkernel equivalent; \"auto\" keys take zkernel's defaults (auto_values: "
            "the value each took; a Trainer fills them in from its own arguments instead)",
        )
    return config


def _chosen(key: str, config: Config) -> Any:
    """The value zkernel chose for the DeepSpeed ``key`` that was "auto"."""
    section, _, name = key.rpartition(".")
    if key in ("fp16.enabled", "bf16.enabled"):
        return f"precision={config.precision}"
    if section == "optimizer.params":
        return getattr(config.optimizer, name, config.optimizer.options.get(name, "the optimizer's default"))
    if section == "scheduler.params" and config.lr_schedule is not None:
        value = config.lr_schedule.options.get(name)
        if value is None and name == "warmup_max_lr":
            return f"[optimizer] lr={config.optimizer.lr}"
        return "the schedule's default" if value is None else value
    if key == "zero_optimization.reduce_bucket_size":
        return config.partitioner_options.get("bucket_size", f"the {config.partitioner} partitioner's default")
    if not section and hasattr(config, key):
        return getattr(config, key)
    return "zkernel's default"
