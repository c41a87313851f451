"""The Trainer's optimizer and scheduler over an engine that steps its own optimizer.

[Note: who steps] The engine steps zkernel's optimizer (on the device, the CPU or from NVMe) at the
end of each accumulation window, inside the backward of the window's last micro-batch (as DeepSpeed's
engine does behind the Trainer). The Trainer still builds its ``torch.optim`` optimizer from its
arguments (``optim``, ``learning_rate``, ``weight_decay`` and the no-decay parameter groups); that
optimizer never steps. It serves twice:

* its class and parameter groups become zkernel's ``[optimizer]``, as every torch optimizer's do
  (`zkernel.compat.torch_optim`, read with `TRAINER_ORIGIN`): the same Adam/AdamW, hyperparameters
  and per-group weight decay;
* `EngineOptimizer`, a view sharing its ``param_groups``, is what the Trainer holds: its ``step`` does
  nothing, and the Trainer's lr scheduler (``lr_scheduler_type``, warm-up) moves the groups' rates after
  each step; the largest is the next step's rate.

Where the config has its own schedule (a DeepSpeed ``scheduler`` section, a zkernel ``[lr_schedule]``),
the engine moves the rate itself and the Trainer holds `ConfigScheduleView`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from zkernel.compat.torch_optim import GroupValues, Origin, step_rate

# TrainingArguments.optim values whose optimizer zkernel has: torch's Adam/AdamW.
SUPPORTED_OPTIM = ("adamw_torch", "adamw_torch_fused", "adamw_torch_npu_fused", "adamw_hf")
TRAINER_ORIGIN = Origin(
    whose="the Trainer's",
    instead=f"TrainingArguments(optim=...) one of {', '.join(SUPPORTED_OPTIM)}, or an "
    "optimizers=(torch.optim.AdamW(...), scheduler) argument",
)


class EngineOptimizer(torch.optim.Optimizer):
    """What `ZKernelTrainer` holds as ``trainer.optimizer``: the Trainer's optimizer's parameter groups
    (the same dicts), with ``step`` and ``zero_grad`` doing nothing ([Note: who steps]).

    A real ``torch.optim.Optimizer``, so the Trainer's lr scheduler runs over it; it holds no state of
    its own (the engine's checkpoint has the optimizer's).
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        # The same group dicts: a scheduler built over ``optimizer`` moves these rates too.
        super().__init__(optimizer.param_groups, {})
        self.trainer_optimizer = optimizer

    @torch.no_grad()
    def step(self, closure=None):
        """Nothing: the engine stepped at the end of the window, in the last micro-batch's backward."""
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: the engine zeroes gradients after each step."""

    @property
    def lr(self) -> float:
        """The rate of the next step: the largest group's (`zkernel.compat.torch_optim.step_rate`; the
        other groups keep their ratio to it)."""
        return step_rate(GroupValues.of(group) for group in self.param_groups)


class ConfigScheduleView:
    """``trainer.lr_scheduler`` where the config's schedule sets the rate: ``step`` does nothing (the engine
    moves the schedule at each applied step) and ``get_last_lr`` is the rate of the last step taken, as a
    torch scheduler's is when the Trainer logs it. ``rates``: called for those rates (the trainer's)."""

    def __init__(self, rates: Callable[[], list[float]]) -> None:
        self._rates = rates

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Nothing: the engine moved the schedule in its step."""

    def get_last_lr(self) -> list[float]:
        return self._rates()

    def state_dict(self) -> dict[str, Any]:
        return {}  # the schedule's position is the engine's (its checkpoint keeps it)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Nothing: the engine's checkpoint restores the schedule's position."""
