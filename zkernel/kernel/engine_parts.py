"""What `zkernel.initialize` built for an engine, handed to `Engine.__init__` in one value."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs
import torch

from zkernel.platform.streams import Streams
from zkernel.spec.groups import ParamGroup
from zkernel.spec.tiers import OptimizerTier, ParamsTier
from zkernel.telemetry.timeline import Timeline

__all__ = ["EngineParts"]


@attrs.frozen(kw_only=True)
class EngineParts:
    """What `zkernel.initialize` built for an engine: made by `zkernel.kernel.bootstrap`, read once
    by `Engine.__init__`."""

    runtime_pm: Any
    groups: list[ParamGroup]
    compute_dtype: torch.dtype
    optimizer_tier: OptimizerTier
    params_tier: ParamsTier
    worker: ThreadPoolExecutor
    streams: Streams
    timeline: Timeline
    can_rollback: bool
    skips_params: bool  # the optimizer leaves skipped parameters as they are itself
    # The optimizer honours ``StepOptions.found_inf`` ([Note: a non-finite flag read one step late]).
    takes_found_inf: bool = False
    speculate: str
    # (parameter name, dtype at initialize), to give the parameters back at close.
    original_dtypes: tuple[tuple[str, torch.dtype], ...]
    # Bytes of every parameter, whole, in its dtype at `initialize` (where `close` can put them).
    whole_bytes: int = 0
    # (name, shape, dtype) of every parameter and buffer at initialize (state dicts, checkpoints).
    original_tensors: tuple[tuple[str, tuple[int, ...], torch.dtype], ...] = ()
    # The planner's decision when the config had "auto" values (`zkernel.spec.planner.Plan`), else None.
    placement_plan: Any = None
    # The selected `zkernel.spec.lr_schedule.LRSchedule` (None: no schedule, as ``lr_schedule.name = "none"``).
    lr_schedule: Any = None
    # Names of the values the partitioner's meta-device construction left unset ([Note: values left unset]).
    left_unset: frozenset[str] = frozenset()
