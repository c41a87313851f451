"""Learning-rate schedule ``none`` (the default): every step uses ``engine.lr``.

``engine.lr`` starts at ``[optimizer] lr`` and keeps whatever the training
loop sets between steps; nothing else changes it.
"""

from __future__ import annotations

from zkernel.spec import hookimpl
from zkernel.spec.lr_schedule import LRSchedule


class NoSchedule(LRSchedule):
    def __init__(self, context) -> None:
        del context

    def hyper(self, applied_steps, base):
        return None


@hookimpl
def zkernel_register_lr_schedules(registry) -> None:
    registry.add("none", NoSchedule, description="no schedule: engine.lr, which the training loop may set between steps")
