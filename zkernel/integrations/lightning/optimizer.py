"""The torch optimizer ``configure_optimizers`` returns, stepped by zkernel.

[Note: the torch optimizer is a view] Lightning keeps the optimizer
``configure_optimizers`` returned: its lr schedulers step it, callbacks read
its ``param_groups``, checkpoints hold its hyperparameters. zkernel steps its
own optimizer over flat shards, so the torch optimizer is never stepped and
holds no state; it stays what the user and the schedulers see and change.

* At setup (`OptimizerMap.section`) its parameter groups become the config's
  ``[optimizer]``: one ``[[optimizer.param_groups]]`` entry per torch group,
  naming that group's parameters exactly, with the group's weight decay,
  betas and eps, and its learning rate as a scale of the largest one (the
  step's rate, ``optimizer.lr``).
* Before each optimizer step (`OptimizerMap.sync`) the groups' values are
  read again, so whatever changed them since (any torch lr scheduler, per step
  or per epoch: ``LambdaLR``, ``CosineAnnealingLR``, ``OneCycleLR`` with its
  betas, or the user writing ``param_groups[i]["lr"]``) reaches the next step:
  the engine's ``lr`` becomes the largest group's rate and every parameter's
  hyperparameters (`zkernel.spec.groups.ParamHyper`, see [Note: per-parameter
  hyperparameters] in `zkernel.kernel.param_hyper`) are set anew. A group at
  rate 0 (a warm-up's first step) is a scale of 0; all groups at 0 are 0.

Only ``torch.optim.Adam`` and ``torch.optim.AdamW`` (not subclasses, whose
``step`` may differ) map; ``amsgrad`` and ``maximize`` have no zkernel
equivalent. Anything else is a `ConfigError` before training starts.
"""

from __future__ import annotations

import glob
from collections.abc import Iterable
from typing import Any

import attrs
import torch
from torch import nn

from zkernel.errors import ConfigError
from zkernel.kernel.param_hyper import mark_overrides
from zkernel.spec.groups import ParamHyper
from zkernel.spec.sections import OptimizerConfig, ParamGroupConfig

SUPPORTED = (torch.optim.AdamW, torch.optim.Adam)
_DEFAULTS = OptimizerConfig()


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
    def of(cls, group: dict) -> GroupValues:
        return cls(
            lr=_number(group["lr"]),
            betas=(_number(group["betas"][0]), _number(group["betas"][1])),
            eps=_number(group["eps"]),
            weight_decay=_number(group["weight_decay"]),
        )


def step_rate(values: Iterable[GroupValues]) -> float:
    """The rate the engine steps at: the largest group's (see [Note: the torch optimizer is a view])."""
    return max((v.lr for v in values), default=0.0)


def lr_scale(value: GroupValues, rate: float) -> float:
    return value.lr / rate if rate > 0 else 1.0


class OptimizerMap:
    """Which parameters each group of a torch Adam/AdamW holds (by name in ``module``), checked once;
    built by the strategy at setup from the optimizer ``configure_optimizers`` returned."""

    def __init__(self, optimizer: Any, module: nn.Module) -> None:
        check_supported(optimizer)
        self.optimizer = optimizer
        self.decoupled = type(optimizer) is torch.optim.AdamW or bool(
            optimizer.param_groups[0].get("decoupled_weight_decay", False)
        )
        names: dict[int, list[str]] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).append(name)
        self.group_names: list[tuple[str, ...]] = []
        listed: set[int] = set()
        for i, group in enumerate(optimizer.param_groups):
            own: list[str] = []
            for param in group["params"]:
                if id(param) not in names:
                    raise ConfigError(
                        f"the optimizer's param_groups[{i}] holds a parameter (shape {tuple(param.shape)}) that is "
                        "not a parameter of the LightningModule; zkernel steps the module's parameters only: "
                        "build the optimizer from self.parameters() or self.named_parameters()"
                    )
                listed.add(id(param))
                own.extend(names[id(param)])
            self.group_names.append(tuple(own))
        left_out = [names[id(p)][0] for p in module.parameters() if p.requires_grad and id(p) not in listed]
        if left_out:
            raise ConfigError(
                f"parameters {left_out[:5]}{' ...' if len(left_out) > 5 else ''} require grad but are in no "
                "parameter group of the optimizer; zkernel steps every parameter that requires grad: add them "
                "to a group, or set requires_grad=False on them before fit"
            )

    def values(self) -> list[GroupValues]:
        """Each group's hyperparameters now."""
        return [GroupValues.of(group) for group in self.optimizer.param_groups]

    def section(self, base: OptimizerConfig, offloaded: bool) -> OptimizerConfig:
        """The config's ``[optimizer]`` for this optimizer, over the user's ``base`` section (its optimizer
        name and options); a value the user set there that the optimizer contradicts is a `ConfigError`."""
        values = self.values()
        first, rate = values[0], step_rate(values)
        if base.param_groups or base.no_weight_decay:
            raise ConfigError(
                "the config sets optimizer.param_groups or optimizer.no_weight_decay, but under Lightning the "
                "parameter groups come from configure_optimizers: remove them from the config and give the "
                "torch optimizer those groups"
            )
        for key, mine in (("betas", first.betas), ("eps", first.eps), ("weight_decay", first.weight_decay)):
            given = getattr(base, key)
            if given != getattr(_DEFAULTS, key) and given != mine:
                raise ConfigError(
                    f"the config's optimizer.{key} = {given!r} contradicts the optimizer from configure_optimizers "
                    f"({key} = {mine!r}); set it in one place (configure_optimizers)"
                )
        if base.lr != _DEFAULTS.lr and base.lr != rate:
            raise ConfigError(
                f"the config's optimizer.lr = {base.lr!r} contradicts the optimizer from configure_optimizers "
                f"(lr = {rate!r}); set it in one place (configure_optimizers)"
            )
        given = base.options.get("decoupled_weight_decay")
        if given is not None and bool(given) != self.decoupled:
            raise ConfigError(
                f"the config's optimizer.decoupled_weight_decay = {given!r} contradicts the optimizer from "
                f"configure_optimizers ({type(self.optimizer).__name__})"
            )
        name = base.name
        if name == _DEFAULTS.name and offloaded:
            name = "cpu_adam"  # the native host Adam, as a DeepSpeed config with optimizer offload maps
        return attrs.evolve(
            base,
            name=name,
            lr=rate,
            betas=first.betas,
            eps=first.eps,
            weight_decay=first.weight_decay,
            param_groups=tuple(
                ParamGroupConfig(
                    params=tuple(glob.escape(n) for n in names),
                    lr_scale=lr_scale(value, rate),
                    weight_decay=value.weight_decay,
                    betas=value.betas,
                    eps=value.eps,
                )
                for names, value in zip(self.group_names, values)
                if names
            ),
            options={**base.options, "decoupled_weight_decay": self.decoupled},
        )


class OptimizerSync:
    """Carries the torch optimizer's values into an engine before each step ([Note: the torch optimizer
    is a view]); the strategy calls `sync` before the backward that ends an accumulation window."""

    def __init__(self, mapping: OptimizerMap, engine: Any, *, owns_rate: bool) -> None:
        self._map, self._engine = mapping, engine
        self._owns_rate = owns_rate  # False: the config's lr_schedule sets the rate; only the scales follow
        self._last: tuple | None = None

    def sync(self) -> None:
        values = self._map.values()
        if values == self._last:
            return
        rate = step_rate(values)
        if self._owns_rate:
            self._engine.lr = rate
        overrides: dict[str, ParamHyper] = {}
        for names, value in zip(self._map.group_names, values):
            hyper = ParamHyper(
                lr_scale=lr_scale(value, rate), weight_decay=value.weight_decay, betas=value.betas, eps=value.eps
            )
            overrides.update((name, hyper) for name in names)
        mark_overrides(self._engine.module, self._engine.groups, overrides)
        self._last = values


def check_supported(optimizer: Any) -> None:
    """A `ConfigError` naming what is supported unless ``optimizer`` is a torch Adam or AdamW zkernel can step."""
    supported = (
        "torch.optim.AdamW or torch.optim.Adam (any parameter groups with their own lr, betas, eps, weight_decay)"
    )
    if type(optimizer) not in SUPPORTED:
        raise ConfigError(
            f"ZKernelStrategy cannot train with the optimizer {type(optimizer).__name__} "
            f"({type(optimizer).__module__}.{type(optimizer).__qualname__}) "
            f"from configure_optimizers: zkernel steps its own Adam over the shards, so it supports {supported}"
        )
    for i, group in enumerate(optimizer.param_groups):
        for flag in ("amsgrad", "maximize"):
            if group.get(flag):
                raise ConfigError(
                    f"the optimizer's param_groups[{i}] sets {flag}=True, which zkernel's Adam does not have; "
                    f"supported: {supported} with amsgrad=False and maximize=False"
                )
        if i and bool(group.get("decoupled_weight_decay", False)) != bool(
            optimizer.param_groups[0].get("decoupled_weight_decay", False)
        ):
            raise ConfigError("the optimizer's param_groups mix decoupled_weight_decay values; zkernel needs one")
