"""A torch ``Adam``/``AdamW`` read as zkernel's ``[optimizer]``: one mapping for every place a user hands
zkernel a torch optimizer (a client optimizer passed to `zkernel.deepspeed.initialize`, the optimizer a
Hugging Face Trainer builds, the one ``configure_optimizers`` returns under Lightning).

[Note: a torch optimizer as zkernel's] zkernel steps its own Adam over flat shards, so a torch
optimizer is never stepped: its class and parameter groups are read into the config once, at setup.

* Only ``torch.optim.Adam`` and ``torch.optim.AdamW`` themselves map (a subclass's ``step`` may
  differ); ``amsgrad`` and ``maximize`` have no zkernel equivalent; every group must share one kind
  of weight decay (AdamW's decoupled decay, or Adam's L2 term in the gradient). Each refusal is a
  `ConfigError` saying which optimizer, what was wrong and what is valid (`check_supported`).
* Every parameter the optimizer holds is a parameter of the model, named by all its names there (a
  tied parameter has several); every parameter of the model that requires grad is in a group, since
  the engine steps all of them.
* The base section (`TorchAdam.base`): the step's rate is the largest group's rate, so each group's
  ``lr_scale`` (its rate over the step's) is at most 1 and a group at rate 0 stays a scale of 0; the
  weight decay, betas and eps are those of the first group holding parameters with the largest weight
  decay (the Trainer's decay group: its no-decay group then differs by a weight decay of 0 only).
  A rate a torch lr scheduler recorded as ``initial_lr`` is read rather than the scheduler's first
  value (a warm-up starting at 0 would leave no ratio between the groups).
* The per-group overrides (`TorchAdam.with_groups`) are stated against the section they extend,
  whichever way that section was filled (from the optimizer, or from a DeepSpeed JSON the Trainer
  filled from its arguments): a group equal to it needs nothing, a group that differs by a weight
  decay of 0 alone is ``no_weight_decay``, any other difference is a ``param_groups`` entry with the
  values that differ. Parameters are named exactly (their names escaped as fnmatch patterns).

Who moves the rate afterwards is the caller's: a torch lr scheduler scales every group's rate, so the
engine's rate follows `step_rate` of the groups' current values, and the ratios stay; where the
groups' values may change in other ways between steps, the caller re-reads `TorchAdam.values` and
sets each parameter's hyperparameters anew (`TorchAdam.param_hyper`).
"""

from __future__ import annotations

import glob
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
from torch import nn

from zkernel.errors import ConfigError
from zkernel.spec.groups import ParamHyper
from zkernel.spec.sections import OptimizerConfig, ParamGroupConfig

SUPPORTED = (torch.optim.AdamW, torch.optim.Adam)
_VALID = "torch.optim.AdamW or torch.optim.Adam (those classes, not subclasses), with any parameter groups"


@attrs.frozen(kw_only=True)
class Origin:
    """Where an optimizer came from, for the error messages: ``whose`` is said before "optimizer" ("the
    client", "the Trainer's"), ``model`` is what its parameters must belong to, ``instead`` what else the
    caller accepts (said after what is valid; may be empty)."""

    whose: str
    model: str = "the model"
    instead: str = ""


def _number(value: Any) -> float:
    return float(value.item() if isinstance(value, torch.Tensor) else value)


@attrs.frozen
class GroupValues:
    """One torch parameter group's hyperparameters, as numbers."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float

    @classmethod
    def of(cls, group: Mapping[str, Any], *, initial: bool = False) -> GroupValues:
        """``group``'s values; with ``initial``, the rate a torch lr scheduler started from where it
        recorded one (``initial_lr``)."""
        lr = group.get("initial_lr", group["lr"]) if initial else group["lr"]
        return cls(
            lr=_number(lr),
            betas=(_number(group["betas"][0]), _number(group["betas"][1])),
            eps=_number(group["eps"]),
            weight_decay=_number(group["weight_decay"]),
        )


def step_rate(values: Iterable[GroupValues]) -> float:
    """The rate the engine steps at: the largest group's ([Note: a torch optimizer as zkernel's])."""
    return max((v.lr for v in values), default=0.0)


def lr_scale(value: GroupValues, rate: float) -> float:
    """``value``'s rate as a scale of the step's ``rate`` (1 where the step's rate is 0)."""
    return value.lr / rate if rate > 0 else 1.0


def check_supported(optimizer: Any, origin: Origin) -> None:
    """Raise a `ConfigError` saying what is wrong and what is valid unless ``optimizer`` is a torch Adam
    or AdamW zkernel can step ([Note: a torch optimizer as zkernel's]); called by `TorchAdam`."""
    instead = f"; or {origin.instead}" if origin.instead else ""
    kind = type(optimizer)
    if kind not in SUPPORTED:
        what = f"factory {optimizer!r}" if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer) \
            else kind.__name__
        raise ConfigError(
            f"{origin.whose} optimizer {what} cannot be mapped ({kind.__module__}.{kind.__qualname__}): zkernel steps "
            f"its own Adam/AdamW over the shards; valid: {_VALID}{instead}"
        )
    groups = optimizer.param_groups
    for i, group in enumerate(groups):
        for flag in ("amsgrad", "maximize"):
            if group.get(flag):
                raise ConfigError(
                    f"{origin.whose} optimizer's param_groups[{i}] sets {flag}=True, which zkernel's Adam does not "
                    f"have; valid: {_VALID}, amsgrad=False and maximize=False{instead}"
                )
        if bool(group.get("decoupled_weight_decay", False)) != bool(groups[0].get("decoupled_weight_decay", False)):
            raise ConfigError(
                f"{origin.whose} optimizer's param_groups mix decoupled_weight_decay values (param_groups[0] and "
                f"[{i}]); valid: one value in every group"
            )


class TorchAdam:
    """A torch Adam/AdamW checked once and read against ``model``: which parameters each group holds (by
    every name in ``model``), its groups' values, the base section and the per-group overrides ([Note:
    a torch optimizer as zkernel's]). Built by each caller at setup, before the engine."""

    def __init__(self, optimizer: Any, model: nn.Module, origin: Origin) -> None:
        check_supported(optimizer, origin)
        self.optimizer = optimizer
        self.decoupled = type(optimizer) is torch.optim.AdamW or bool(
            optimizer.param_groups[0].get("decoupled_weight_decay", False)
        )
        names: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).append(name)
        self.group_names: list[tuple[str, ...]] = []
        listed: set[int] = set()
        for i, group in enumerate(optimizer.param_groups):
            own: list[str] = []
            for param in group["params"]:
                if id(param) not in names:
                    raise ConfigError(
                        f"{origin.whose} optimizer's param_groups[{i}] holds a tensor (shape {tuple(param.shape)}) "
                        f"that is not a parameter of {origin.model}; valid: an optimizer over {origin.model}'s "
                        "own parameters (zkernel steps those only)"
                    )
                if id(param) not in listed:
                    listed.add(id(param))
                    own.extend(names[id(param)])
            self.group_names.append(tuple(own))
        left_out = [names[id(p)][0] for p in model.parameters() if p.requires_grad and id(p) not in listed]
        if left_out:
            raise ConfigError(
                f"parameters {left_out[:5]}{' ...' if len(left_out) > 5 else ''} of {origin.model} require grad "
                f"but are in no parameter group of {origin.whose} optimizer; zkernel steps every parameter that "
                "requires grad: valid: add them to a group, or set requires_grad=False on them before training"
            )

    def values(self, *, initial: bool = False) -> list[GroupValues]:
        """Each group's hyperparameters now (``initial``: see `GroupValues.of`)."""
        return [GroupValues.of(group, initial=initial) for group in self.optimizer.param_groups]

    def base(self) -> tuple[float, GroupValues]:
        """The step's rate and the group whose weight decay, betas and eps the base section takes."""
        values = self.values(initial=True)
        holding = [v for v, names in zip(values, self.group_names) if names] or values
        return step_rate(values), max(holding, key=lambda v: v.weight_decay)

    def deepspeed_section(self) -> dict[str, Any]:
        """The base section as a DeepSpeed ``optimizer`` section (``Adam`` with ``adam_w_mode`` false
        where the weight decay is Adam's L2 term)."""
        rate, base = self.base()
        params = {"lr": rate, "betas": list(base.betas), "eps": base.eps, "weight_decay": base.weight_decay}
        if self.decoupled:
            return {"type": "AdamW", "params": params}
        return {"type": "Adam", "params": {**params, "adam_w_mode": False}}

    def with_groups(self, section: OptimizerConfig) -> OptimizerConfig:
        """``section`` with ``no_weight_decay`` and ``param_groups`` for the groups that differ from it."""
        no_decay: list[str] = []
        entries: list[ParamGroupConfig] = []
        for names, value in zip(self.group_names, self.values(initial=True)):
            if not names:
                continue
            differs: dict[str, Any] = {}
            if value.lr != section.lr:
                if section.lr <= 0:
                    raise ConfigError(
                        f"optimizer.lr is 0 but the group of {names[0]!r} steps at {value.lr}, and a group's rate is "
                        "a scale of optimizer.lr; valid: optimizer.lr above 0"
                    )
                differs["lr_scale"] = value.lr / section.lr
            for key in ("weight_decay", "betas", "eps"):
                if getattr(value, key) != getattr(section, key):
                    differs[key] = getattr(value, key)
            patterns = tuple(glob.escape(n) for n in names)
            if differs == {"weight_decay": 0.0}:
                no_decay.extend(patterns)
            elif differs:
                entries.append(ParamGroupConfig(params=patterns, **differs))
        return attrs.evolve(section, no_weight_decay=tuple(no_decay), param_groups=tuple(entries))

    def param_hyper(self, values: list[GroupValues], rate: float) -> dict[str, ParamHyper]:
        """Every parameter's hyperparameters (by each of its names) for the groups' ``values`` at the
        step's ``rate``: what a caller that follows the groups between steps marks on the engine."""
        hyper: dict[str, ParamHyper] = {}
        for names, value in zip(self.group_names, values):
            one = ParamHyper(lr_scale=lr_scale(value, rate), weight_decay=value.weight_decay, betas=value.betas,
                             eps=value.eps)
            hyper.update((name, one) for name in names)
        return hyper
