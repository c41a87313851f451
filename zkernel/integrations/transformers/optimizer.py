"""The Trainer's optimizer and scheduler over an engine that steps its own optimizer.

[Note: who steps] The engine steps zkernel's optimizer (on the device, the CPU or from NVMe) at the
end of each accumulation window, inside the backward of the window's last micro-batch (as DeepSpeed's
engine does behind the Trainer). The Trainer still builds its ``torch.optim`` optimizer from its
arguments (``optim``, ``learning_rate``, ``weight_decay`` and the no-decay parameter groups); that
optimizer never steps. It serves twice:

* its class and parameter groups become zkernel's ``[optimizer]`` (`deepspeed_section`,
  `group_overrides`): the same Adam/AdamW, hyperparameters and per-group weight decay;
* `EngineOptimizer`, a view sharing its ``param_groups``, is what the Trainer holds: its ``step`` does
  nothing, and the Trainer's lr scheduler (``lr_scheduler_type``, warm-up) moves ``param_groups[0]["lr"]``
  after each step, which the engine takes as the next step's rate.

Where the config has its own schedule (a DeepSpeed ``scheduler`` section, a zkernel ``[lr_schedule]``),
the engine moves the rate itself and the Trainer holds `ConfigScheduleView`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from zkernel.errors import ConfigError

# TrainingArguments.optim values whose optimizer zkernel has: torch's Adam/AdamW, any implementation.
SUPPORTED_OPTIM = ("adamw_torch", "adamw_torch_fused", "adamw_torch_npu_fused", "adamw_hf")


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
        """The rate of the next step (the first group's; other groups keep their ratio to it)."""
        return float(self.param_groups[0]["lr"])


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


def _check_supported(optimizer: torch.optim.Optimizer) -> None:
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise ConfigError(
            f"the Trainer's optimizer is {type(optimizer).__module__}.{type(optimizer).__name__}, which zkernel "
            "cannot step: zkernel steps Adam/AdamW; valid: TrainingArguments(optim=...) one of "
            f"{', '.join(SUPPORTED_OPTIM)}, an optimizers=(torch.optim.AdamW(...), scheduler) argument, or the "
            "config's optimizer section (DeepSpeed \"optimizer\": {\"type\": \"AdamW\"}, zkernel [optimizer])"
        )
    for flag in ("amsgrad", "maximize"):
        if any(group.get(flag) for group in optimizer.param_groups):
            raise ConfigError(
                f"the Trainer's optimizer has {flag}=True, which zkernel's Adam does not have; valid: {flag}=False"
            )


def _base_group(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The group the others are stated against: the first holding parameters with the largest weight
    decay (the Trainer's decay group, whose values are its arguments'; the no-decay group differs by 0)."""
    holding = [g for g in optimizer.param_groups if g["params"]] or optimizer.param_groups
    return max(holding, key=lambda g: float(g.get("weight_decay", 0.0)))


def _rate(group: Mapping[str, Any]) -> float:
    lr = group.get("initial_lr", group["lr"])
    return float(lr.item() if isinstance(lr, torch.Tensor) else lr)


def decoupled(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the weight decay is AdamW's (decoupled) rather than Adam's (added to the gradient)."""
    return isinstance(optimizer, torch.optim.AdamW) or bool(_base_group(optimizer).get("decoupled_weight_decay"))


def deepspeed_section(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The Trainer's optimizer as a DeepSpeed ``optimizer`` section (its first parameter group's values)."""
    _check_supported(optimizer)
    base = _base_group(optimizer)
    params = {
        "lr": _rate(base),
        "betas": [float(b) for b in base["betas"]],
        "eps": float(base["eps"]),
        "weight_decay": float(base["weight_decay"]),
    }
    if decoupled(optimizer):
        return {"type": "AdamW", "params": params}
    return {"type": "Adam", "params": {**params, "adam_w_mode": False}}


def group_overrides(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, Any]:
    """zkernel's ``no_weight_decay`` and ``param_groups`` for the Trainer's groups that differ from the first.

    A group that differs in weight decay only, to 0, is ``no_weight_decay`` (the Trainer's biases and
    normalisation weights); any other difference is a ``param_groups`` entry (``lr_scale`` the ratio of
    its rate to the first group's). Parameters are named by their exact names in ``model``.
    """
    names = {id(p): name for name, p in model.named_parameters()}
    base = _base_group(optimizer)
    no_decay: list[str] = []
    entries: list[dict[str, Any]] = []
    for group in optimizer.param_groups:
        if group is base or not group["params"]:
            continue
        missing = [p for p in group["params"] if id(p) not in names]
        if missing:
            raise ConfigError(
                f"the Trainer's optimizer holds {len(missing)} tensor(s) that are not parameters of the model; "
                "valid: an optimizer over the model's own parameters"
            )
        params = sorted({names[id(p)] for p in group["params"]})
        entry: dict[str, Any] = {"params": params}
        if _rate(group) != _rate(base):
            entry["lr_scale"] = _rate(group) / _rate(base) if _rate(base) else 0.0
        for key in ("weight_decay", "eps"):
            if key in group and float(group[key]) != float(base.get(key, group[key])):
                entry[key] = float(group[key])
        if "betas" in group and tuple(group["betas"]) != tuple(base.get("betas", group["betas"])):
            entry["betas"] = [float(b) for b in group["betas"]]
        if set(entry) == {"params", "weight_decay"} and entry["weight_decay"] == 0.0:
            no_decay.extend(params)
        elif len(entry) > 1:
            entries.append(entry)
    out: dict[str, Any] = {}
    if no_decay:
        out["no_weight_decay"] = tuple(no_decay)
    if entries:
        out["param_groups"] = tuple(entries)
    return out
