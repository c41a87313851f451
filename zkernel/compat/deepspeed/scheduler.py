"""Migration from DeepSpeed: a config's ``scheduler`` section as ``[lr_schedule]``.

Called by `zkernel.compat.deepspeed.config.from_deepspeed_config` with its reader
(the ``_Reader`` that accounts for every key). DeepSpeed's five schedulers map
to the builtin schedules of the same definition, which take DeepSpeed's
parameter names as their options (`zkernel_plugins.lr_schedules`); the table
below is DeepSpeed's schema (what its scheduler classes accept), checked here
so an error names the DeepSpeed key.
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Any

from zkernel.spec.config import ConfigError

if TYPE_CHECKING:
    from zkernel.compat.deepspeed.config import _Reader as Reader

# DeepSpeed's scheduler types -> zkernel's lr_schedule names, and each type's params by kind. The
# schedules take DeepSpeed's param names as their options (`zkernel_plugins.lr_schedules`).
_SCHEDULES = {
    "WarmupLR": "warmup",
    "WarmupDecayLR": "warmup_decay",
    "WarmupCosineLR": "warmup_cosine",
    "OneCycle": "one_cycle",
    "LRRangeTest": "lr_range_test",
}
_WARMUP_PARAMS = {"warmup_min_lr": "number", "warmup_max_lr": "number", "warmup_num_steps": "integer", "warmup_type": "warmup"}
_SCHEDULE_PARAMS: dict[str, dict[str, str]] = {
    "WarmupLR": _WARMUP_PARAMS,
    "WarmupDecayLR": {**_WARMUP_PARAMS, "total_num_steps": "integer"},
    "WarmupCosineLR": {
        "total_num_steps": "integer",
        "warmup_min_ratio": "number",
        "warmup_num_steps": "integer",
        "cos_min_ratio": "number",
        "warmup_type": "warmup",
    },
    "OneCycle": {
        "cycle_min_lr": "number",
        "cycle_max_lr": "number",
        "decay_lr_rate": "number",
        "cycle_first_step_size": "integer",
        "cycle_second_step_size": "integer",
        "cycle_first_stair_count": "unused",
        "cycle_second_stair_count": "unused",
        "decay_step_size": "integer",
        "cycle_momentum": "boolean",
        "cycle_min_mom": "number",
        "cycle_max_mom": "number",
        "decay_mom_rate": "number",
    },
    "LRRangeTest": {
        "lr_range_test_min_lr": "number",
        "lr_range_test_step_size": "integer",
        "lr_range_test_step_rate": "number",
        "lr_range_test_staircase": "boolean",
    },
}
# Params without a default in DeepSpeed: "auto" (the Hugging Face Trainer fills them in) cannot fall back.
# Of the others, "auto" takes zkernel's default (warmup_max_lr: [optimizer] lr, warmup_min_lr: 0), but
# warmup_num_steps takes the Trainer's default of 0 steps.
_REQUIRED = {"WarmupDecayLR": ("total_num_steps",), "WarmupCosineLR": ("total_num_steps",), "OneCycle": ("cycle_min_lr", "cycle_max_lr")}


def map_scheduler(reader: Reader, out: dict[str, Any]) -> None:
    """Map ``scheduler`` to ``[lr_schedule]``: the same schedule, computed as DeepSpeed computes it."""
    if not reader.section("scheduler"):
        return
    kind = reader.get("scheduler.type")
    if kind not in _SCHEDULES:
        raise ConfigError(
            f"DeepSpeed config key scheduler.type {kind!r} is not valid; valid: {', '.join(_SCHEDULES)} "
            "(or no scheduler section, and engine.lr set between steps)"
        )
    kinds = _SCHEDULE_PARAMS[kind]
    params = reader.section("scheduler.params")
    schedule: dict[str, Any] = {"name": _SCHEDULES[kind]}
    if kind == "WarmupLR" and reader.peek("scheduler.params.warmup_max_lr") is None:
        schedule["warmup_max_lr"] = 0.001  # DeepSpeed's default; zkernel's (None) is [optimizer] lr
    for name in params:
        key = f"scheduler.params.{name}"
        if name == "last_batch_iteration":
            start = reader.integer(key, minimum=-1) if reader.peek(key) != "auto" else None
            if start not in (None, -1):
                reader.unmapped.append(f"{key}={start} (the schedule follows the engine's applied steps, which a checkpoint restores)")
            continue
        if name not in kinds:
            valid = [*kinds, "last_batch_iteration"]
            close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
            raise ConfigError(
                f"DeepSpeed config key {key} is not a parameter of {kind}; valid: {', '.join(valid)}"
                + (f" (did you mean {close[0]!r}?)" if close else "")
            )
        value = _schedule_param(reader, key, kinds[name])
        if value is None and name == "warmup_num_steps" and reader.peek(key) == "auto":
            # What the Hugging Face Trainer fills in by default (its warmup_steps is 0), not the
            # 1000 of DeepSpeed's own default: a template's warm-up is the Trainer's to choose.
            value = 0
        if kinds[name] == "unused":
            if value is not None:
                reader.unmapped.append(f"{key} (DeepSpeed's {kind} does not use it either)")
        elif value is not None:
            schedule[name] = value
    for name in _REQUIRED.get(kind, ()):
        if name not in schedule:
            state = "\"auto\"" if reader.peek(f"scheduler.params.{name}") == "auto" else "absent"
            raise ConfigError(
                f"DeepSpeed config key scheduler.params.{name} is {state}, and {kind} has no default for it "
                "(the Hugging Face Trainer fills \"auto\" in from its arguments); valid: a number"
            )
    out["lr_schedule"] = schedule


def _schedule_param(reader: Reader, key: str, kind: str) -> Any:
    if kind == "integer":
        return reader.integer(key)
    if kind == "number":
        return reader.number(key)
    if kind == "boolean":
        return reader.boolean(key)
    value = reader.get(key)
    if kind == "warmup" and value is not None and value not in ("log", "linear"):
        raise ConfigError(f"DeepSpeed config key {key} {value!r} is not valid; valid: log, linear")
    return value
