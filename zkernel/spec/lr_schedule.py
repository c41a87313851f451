"""The learning-rate schedule interface: the hyperparameters of each optimizer step.

A schedule is a component of the ``lr_schedule`` family (factory
``factory(context)`` registered through ``zkernel_register_lr_schedules``,
selected by ``[lr_schedule] name``), so a third party's schedule plugs in by
name like the builtins (``none``, DeepSpeed's ``warmup``, ``warmup_decay``,
``warmup_cosine``, ``one_cycle`` and ``lr_range_test``).

[Note: a schedule is a function of the applied steps] The engine asks the
schedule for the next step's hyperparameters at `zkernel.initialize` and
after every optimizer step, passing the count of steps applied so far
(``global_steps - skipped_steps``: a step an fp16 overflow or a non-finite
gradient skipped does not advance the schedule, as DeepSpeed's engine does
not step its scheduler then). A schedule keeps no state of its own, so a
checkpoint needs nothing beyond the engine's counters to resume it, on any
world size, and every rank computes the same values without a collective.
The answer is in place before the next backward begins, which is when the
host tiers may start stepping groups speculatively ([Note: early and
speculative steps] in `zkernel.kernel.step_pipeline`).
"""

from __future__ import annotations

import abc

from zkernel.spec.groups import StepOptions


class LRSchedule(abc.ABC):
    """What the engine asks before each optimizer step (see [Note: a schedule is a function of the applied steps])."""

    @abc.abstractmethod
    def hyper(self, applied_steps: int, base: StepOptions) -> StepOptions | None:
        """The hyperparameters of the step that follows ``applied_steps`` applied steps.

        Called by the engine on every rank, at `zkernel.initialize` (with 0) and
        at the end of every ``engine.step()`` that reached an accumulation
        boundary; also after a checkpoint restored the counters. ``base`` holds
        ``[optimizer]``'s lr, betas, eps and weight decay. Returns them with the
        values this schedule sets for that step (``attrs.evolve(base, lr=...)``),
        or None to leave the engine's hyperparameters as they are (then
        ``engine.lr`` keeps whatever the training loop last set).

        Parameters of a ``[[optimizer.param_groups]]`` entry that sets its own
        ``betas`` or ``eps`` are stepped with those, not with the ones
        returned here; a schedule that sets the betas refuses such entries
        when it is built, as ``one_cycle`` does ([Note: per-parameter
        hyperparameters] in `zkernel.kernel.param_hyper`).
        """
