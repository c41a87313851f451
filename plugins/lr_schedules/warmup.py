"""Learning-rate schedules ``warmup``, ``warmup_decay`` and ``warmup_cosine``: DeepSpeed's WarmupLR,
WarmupDecayLR and WarmupCosineLR, with their option names and defaults.

``warmup`` raises the rate from ``warmup_min_lr`` to ``warmup_max_lr`` (default:
``[optimizer] lr``) over ``warmup_num_steps`` steps, logarithmically (``warmup_type =
"log"``, DeepSpeed's default) or linearly, then holds it. ``warmup_decay`` then
falls linearly to 0 at ``total_num_steps``. ``warmup_cosine`` scales ``[optimizer]
lr`` by a ratio that rises from ``warmup_min_ratio`` to 1 over the warmup and then
follows a cosine down to ``cos_min_ratio`` at ``total_num_steps``. Positions count
as DeepSpeed counts them ([Note: DeepSpeed's iteration] in `_iteration`).
"""

from __future__ import annotations

import math

import attrs

from zkernel.spec import hookimpl
from zkernel.spec.options import choice, integer, number
from zkernel.telemetry.log import get_logger
from zkernel.spec.lr_schedule import LRSchedule

from ._iteration import position, warmup_fraction, warmup_steps

log = get_logger()

WARMUP_TYPES = ("log", "linear")


@attrs.frozen(kw_only=True)
class WarmupOptions:
    """``[lr_schedule]`` options of ``warmup``."""

    # Rate of the first steps, where the warmup starts.
    warmup_min_lr: float = attrs.field(default=0.0, validator=number(minimum=0))
    # None: ``[optimizer] lr``.
    warmup_max_lr: float | None = attrs.field(default=None, validator=number(minimum=0, optional=True))
    # Steps the warmup takes.
    warmup_num_steps: int = attrs.field(default=1000, validator=integer(minimum=0))
    # Shape of the warmup: log (DeepSpeed's default) or linear.
    warmup_type: str = attrs.field(default="log", validator=choice(*WARMUP_TYPES))


def _total_steps_required(name: str, total: int | None) -> None:
    if total is None:
        raise ValueError(
            f"{name} needs total_num_steps, the number of optimizer steps of the run "
            "(where its decay ends); valid: an integer >= 1"
        )


def _warn_if_short(name: str, total: int, warmup: int) -> None:
    """DeepSpeed warns too: the decay would start after the run ends."""
    if total < warmup:
        log.warning("zkernel.lr_schedule.short", schedule=name, total_num_steps=total, warmup_num_steps=warmup)


@attrs.frozen(kw_only=True)
class WarmupDecayOptions(WarmupOptions):
    """``[lr_schedule]`` options of ``warmup_decay``: ``warmup``'s and where the decay reaches 0."""

    # Step at which the linear decay after the warmup reaches 0 (required).
    total_num_steps: int | None = attrs.field(default=None, validator=integer(minimum=1, optional=True))

    def __attrs_post_init__(self) -> None:
        _total_steps_required("warmup_decay", self.total_num_steps)


@attrs.frozen(kw_only=True)
class WarmupCosineOptions:
    """``[lr_schedule]`` options of ``warmup_cosine`` (ratios of ``[optimizer] lr``)."""

    # Step at which the cosine ends (required).
    total_num_steps: int | None = attrs.field(default=None, validator=integer(minimum=1, optional=True))
    # Ratio of [optimizer] lr the warmup starts from.
    warmup_min_ratio: float = attrs.field(default=0.0, validator=number(minimum=0))
    # Steps the warmup takes.
    warmup_num_steps: int = attrs.field(default=1000, validator=integer(minimum=0))
    # Ratio of [optimizer] lr the cosine ends at.
    cos_min_ratio: float = attrs.field(default=0.0001, validator=number(minimum=0))
    # Shape of the warmup: log (DeepSpeed's default) or linear.
    warmup_type: str = attrs.field(default="log", validator=choice(*WARMUP_TYPES))

    def __attrs_post_init__(self) -> None:
        _total_steps_required("warmup_cosine", self.total_num_steps)
        if self.total_num_steps == warmup_steps(self.warmup_num_steps):
            raise ValueError(
                f"warmup_cosine's total_num_steps ({self.total_num_steps}) equals its warmup "
                f"({warmup_steps(self.warmup_num_steps)} steps), which leaves the cosine no steps; "
                "valid: a total_num_steps other than the warmup's length"
            )


class Warmup(LRSchedule):
    """DeepSpeed's WarmupLR (``decay`` False) and WarmupDecayLR (``decay`` True)."""

    def __init__(self, context, decay: bool = False) -> None:
        options = context.options
        self.min_lr = float(options.warmup_min_lr)
        self.max_lr = None if options.warmup_max_lr is None else float(options.warmup_max_lr)
        self.steps = warmup_steps(options.warmup_num_steps)
        self.kind = options.warmup_type
        self.total = options.total_num_steps if decay else None
        if self.total is not None:
            _warn_if_short("warmup_decay", self.total, options.warmup_num_steps)

    def hyper(self, applied_steps, base):
        t = position(applied_steps)
        max_lr = base.lr if self.max_lr is None else self.max_lr
        if t < 0:
            return attrs.evolve(base, lr=self.min_lr)
        if t < self.steps:
            gamma = warmup_fraction(t, self.steps, self.kind)
        elif self.total is None:
            gamma = 1.0
        else:
            gamma = max(0.0, (self.total - t) / max(1.0, self.total - self.steps))
        return attrs.evolve(base, lr=self.min_lr + (max_lr - self.min_lr) * gamma)


class WarmupCosine(LRSchedule):
    """DeepSpeed's WarmupCosineLR."""

    def __init__(self, context) -> None:
        options = context.options
        self.total = options.total_num_steps
        self.min_ratio = float(options.warmup_min_ratio)
        self.steps = warmup_steps(options.warmup_num_steps)
        self.cos_min_ratio = float(options.cos_min_ratio)
        self.kind = options.warmup_type
        _warn_if_short("warmup_cosine", self.total, options.warmup_num_steps)

    def ratio(self, t: int) -> float:
        if t < 0:
            return 0.0
        if t < self.steps:
            return self.min_ratio + warmup_fraction(t, self.steps, self.kind) * (1.0 - self.min_ratio)
        progress = (t - self.steps + 1) / (self.total - self.steps)
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2)

    def hyper(self, applied_steps, base):
        return attrs.evolve(base, lr=base.lr * self.ratio(position(applied_steps)))


@hookimpl
def zkernel_register_lr_schedules(registry) -> None:
    registry.add(
        "warmup",
        Warmup,
        description="DeepSpeed's WarmupLR: warmup_min_lr to warmup_max_lr over warmup_num_steps (log or linear), then constant",
        options_cls=WarmupOptions,
    )
    registry.add(
        "warmup_decay",
        lambda context: Warmup(context, decay=True),
        description="DeepSpeed's WarmupDecayLR: warmup, then linear decay to 0 at total_num_steps",
        options_cls=WarmupDecayOptions,
    )
    registry.add(
        "warmup_cosine",
        WarmupCosine,
        description="DeepSpeed's WarmupCosineLR: lr times a ratio warming up from warmup_min_ratio, then a cosine to cos_min_ratio",
        options_cls=WarmupCosineOptions,
    )
