"""Learning-rate schedules ``one_cycle`` and ``lr_range_test``: DeepSpeed's OneCycle and LRRangeTest,
with their option names and defaults.

``one_cycle`` moves the rate from ``cycle_min_lr`` up to ``cycle_max_lr`` over
``cycle_first_step_size`` steps and back down over ``cycle_second_step_size``
(default: the first), then, with ``decay_step_size`` and ``decay_lr_rate`` set,
divides ``cycle_min_lr`` by ``1 + decay_lr_rate * k / decay_step_size`` ``k`` steps
after the cycle. With ``cycle_momentum`` (on by default, as in DeepSpeed) Adam's
beta1 moves the other way between ``cycle_max_mom`` and ``cycle_min_mom``; beta2
is then 0.99, whatever ``[optimizer] betas`` says, as DeepSpeed sets it, for
every parameter: a ``[[optimizer.param_groups]]`` entry that sets its own
``betas`` is then a `ConfigError` ([Note: per-parameter hyperparameters] in
`zkernel.kernel.param_hyper`).
``lr_range_test`` grows the rate from ``lr_range_test_min_lr`` by
``lr_range_test_step_rate`` times the number of ``lr_range_test_step_size``
intervals passed (whole intervals with ``lr_range_test_staircase``). Positions
count as DeepSpeed counts them ([Note: DeepSpeed's iteration] in `_iteration`).
"""

from __future__ import annotations

import math

import attrs

from zkernel.spec import hookimpl
from zkernel.spec.config import ConfigError
from zkernel.spec.options import boolean, integer, number
from zkernel.spec.lr_schedule import LRSchedule

from ._iteration import position

ONE_CYCLE_BETA2 = 0.99  # DeepSpeed's OneCycle pairs every beta1 it sets with this beta2


@attrs.frozen(kw_only=True)
class OneCycleOptions:
    """``[lr_schedule]`` options of ``one_cycle`` (the two rates have no default, as in DeepSpeed)."""

    # Rate at the start and end of the cycle (required).
    cycle_min_lr: float | None = attrs.field(default=None, validator=number(minimum=0, optional=True))
    # Rate at the cycle's peak (required).
    cycle_max_lr: float | None = attrs.field(default=None, validator=number(minimum=0, optional=True))
    # After the cycle, rate = cycle_min_lr / (1 + decay_lr_rate * k / decay_step_size).
    decay_lr_rate: float = attrs.field(default=0.0, validator=number(minimum=0))
    # Steps from cycle_min_lr up to cycle_max_lr.
    cycle_first_step_size: int = attrs.field(default=2000, validator=integer(minimum=1))
    # None: cycle_first_step_size.
    cycle_second_step_size: int | None = attrs.field(default=None, validator=integer(minimum=1, optional=True))
    # Steps per decay interval after the cycle; 0 = no decay.
    decay_step_size: int = attrs.field(default=0, validator=integer(minimum=0))
    # Move Adam's beta1 against the rate (beta2 then 0.99 for every parameter), as DeepSpeed does.
    cycle_momentum: bool = attrs.field(default=True, validator=boolean())
    # beta1 at the rate's peak.
    cycle_min_mom: float = attrs.field(default=0.8, validator=number(minimum=0))
    # beta1 at the cycle's start and end.
    cycle_max_mom: float = attrs.field(default=0.9, validator=number(minimum=0))
    # After the cycle, beta1's decay per interval.
    decay_mom_rate: float = attrs.field(default=0.0, validator=number(minimum=0))

    def __attrs_post_init__(self) -> None:
        missing = [k for k in ("cycle_min_lr", "cycle_max_lr") if getattr(self, k) is None]
        if missing:
            raise ValueError(f"one_cycle needs {' and '.join(missing)}; valid: a number >= 0")
        for key in ("cycle_min_mom", "cycle_max_mom"):
            if self.cycle_momentum and not 0 < getattr(self, key) < 1:
                raise ValueError(f"one_cycle's {key} {getattr(self, key)!r} is Adam's beta1; valid: a number in (0, 1)")


@attrs.frozen(kw_only=True)
class LRRangeTestOptions:
    """``[lr_schedule]`` options of ``lr_range_test``."""

    # Rate of the first step.
    lr_range_test_min_lr: float = attrs.field(default=0.001, validator=number(minimum=0))
    # Steps per interval of the rate's rise.
    lr_range_test_step_size: int = attrs.field(default=2000, validator=integer(minimum=1))
    # Rate = min_lr * (1 + step_rate * steps / step_size).
    lr_range_test_step_rate: float = attrs.field(default=1.0, validator=number(minimum=0))
    # Rise in whole intervals instead of every step.
    lr_range_test_staircase: bool = attrs.field(default=False, validator=boolean())


def _check_group_betas(config) -> None:
    """Refuse parameter groups with betas of their own when ``cycle_momentum`` sets every parameter's
    (called by `OneCycle` when `zkernel.initialize` builds it)."""
    own = [g for g in config.optimizer.param_groups if g.betas is not None]
    if own:
        raise ConfigError(
            "lr_schedule one_cycle with cycle_momentum = true (its default) sets every parameter's betas "
            f"each step (beta1 cycled, beta2 = {ONE_CYCLE_BETA2}), but the optimizer.param_groups entry "
            f"params = {list(own[0].params)!r} sets its own betas = {list(own[0].betas)!r}; set "
            "lr_schedule.cycle_momentum = false to keep the group's betas, or drop betas from the entry"
        )


class OneCycle(LRSchedule):
    """DeepSpeed's OneCycle."""

    def __init__(self, context) -> None:
        o = context.options
        if o.cycle_momentum:
            _check_group_betas(context.config)
        first = float(o.cycle_first_step_size)
        second = float(o.cycle_second_step_size) if o.cycle_second_step_size is not None else first
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.min_lr, self.max_lr = float(o.cycle_min_lr), float(o.cycle_max_lr)
        self.min_mom, self.max_mom = float(o.cycle_min_mom), float(o.cycle_max_mom)
        self.momentum = o.cycle_momentum
        no_decay = o.decay_step_size == 0
        self.decay_step_size = o.decay_step_size
        self.decay_lr_rate = 0.0 if no_decay else float(o.decay_lr_rate)
        self.decay_mom_rate = 0.0 if no_decay else float(o.decay_mom_rate)

    def _scale(self, t: int) -> float:
        """Where position ``t`` is in the cycle: 0 at the ends, 1 at the peak."""
        progress = (t + 1) / self.total_size
        x = 1.0 + progress - math.floor(1.0 + progress)
        return x / self.step_ratio if x <= self.step_ratio else (x - 1) / (self.step_ratio - 1)

    def lr_and_beta1(self, t: int) -> tuple[float, float]:
        if t < 0:  # as DeepSpeed's constructor sets them
            return self.min_lr, self.min_mom
        if t < self.total_size:
            scale = self._scale(t)
            return (
                self.min_lr + (self.max_lr - self.min_lr) * scale,
                self.max_mom - (self.max_mom - self.min_mom) * scale,
            )
        intervals = (t - self.total_size + 1) / self.decay_step_size if self.decay_step_size else 0.0
        return self.min_lr / (1 + self.decay_lr_rate * intervals), self.max_mom * (1 + self.decay_mom_rate * intervals)

    def hyper(self, applied_steps, base):
        lr, beta1 = self.lr_and_beta1(position(applied_steps))
        if not self.momentum:
            return attrs.evolve(base, lr=lr)
        return attrs.evolve(base, lr=lr, betas=(beta1, ONE_CYCLE_BETA2))


class LRRangeTest(LRSchedule):
    """DeepSpeed's LRRangeTest."""

    def __init__(self, context) -> None:
        o = context.options
        self.min_lr = float(o.lr_range_test_min_lr)
        self.step_size = o.lr_range_test_step_size
        self.rate = float(o.lr_range_test_step_rate)
        self.staircase = o.lr_range_test_staircase

    def hyper(self, applied_steps, base):
        t = max(0, position(applied_steps))  # position -1 sets the minimum, as position 0 does
        interval = t // self.step_size if self.staircase else t / self.step_size
        return attrs.evolve(base, lr=self.min_lr * (1 + self.rate * interval))


@hookimpl
def zkernel_register_lr_schedules(registry) -> None:
    registry.add(
        "one_cycle",
        OneCycle,
        description="DeepSpeed's OneCycle: lr up to cycle_max_lr and back (beta1 the other way), then decay",
        options_cls=OneCycleOptions,
    )
    registry.add(
        "lr_range_test",
        LRRangeTest,
        description="DeepSpeed's LRRangeTest: lr growing from lr_range_test_min_lr every lr_range_test_step_size steps",
        options_cls=LRRangeTestOptions,
    )
