"""DeepSpeed's count of a schedule's position, shared by the builtin schedules.

[Note: DeepSpeed's iteration] The builtin schedules compute exactly what
DeepSpeed's schedulers of the same names set (`deepspeed.runtime.lr_schedules`),
so a run ported with its config keeps its learning rates step for step.
DeepSpeed's scheduler starts at ``last_batch_iteration = -1``, sets the
optimizer's rate for that position at construction, and moves one position
after each applied optimizer step; so the step that follows ``n`` applied
steps uses the value at position ``n - 1``, and the first step uses the one at
-1 (``warmup_min_lr`` for the warmups, 0 for ``warmup_cosine``, the cycle's
minimum for ``one_cycle``). Both the first and the second step of a warmup use
its minimum (positions -1 and 0).
"""

from __future__ import annotations

import math


def position(applied_steps: int) -> int:
    """DeepSpeed's ``last_batch_iteration`` when the step after ``applied_steps`` applied steps runs."""
    return applied_steps - 1


def warmup_fraction(t: int, steps: int, kind: str) -> float:
    """How far position ``t`` (0 <= t < ``steps``) is through a warmup of ``steps`` positions: ``log`` or ``linear``."""
    if kind == "log":
        return math.log(t + 1) / math.log(steps)
    return t / steps


def warmup_steps(configured: int) -> int:
    """DeepSpeed's warmups last at least 2 positions (the log warmup divides by log of it)."""
    return max(2, configured)
