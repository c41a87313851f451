"""The torch optimizer ``configure_optimizers`` returns, stepped by zkernel.

[Note: the torch optimizer is a view] Lightning keeps the optimizer
``configure_optimizers`` returned: its lr schedulers step it, callbacks read
its ``param_groups``, checkpoints hold its hyperparameters. zkernel steps its
own optimizer over flat shards, so the torch optimizer is never stepped and
holds no state; it stays what the user and the schedulers see and change.

* At setup (`OptimizerMap.section`) its parameter groups become the config's
  ``[optimizer]`` as every torch optimizer's do (`zkernel.compat.torch_optim`):
  the step's rate is the largest group's, and each group that differs from the
  section is a ``no_weight_decay`` or ``[[optimizer.param_groups]]`` entry
  naming that group's parameters exactly.
* Before each optimizer step the strategy's `zkernel.kernel.torch_optim_sync.TorchOptimizerSync`
  reads the groups' values again ([Note: following a torch optimizer]), so
  whatever changed them since (any torch lr scheduler, per step or per epoch:
  ``LambdaLR``, ``CosineAnnealingLR``, ``OneCycleLR`` with its betas, or the
  user writing ``param_groups[i]["lr"]``) reaches the next step.

What maps and what is refused, and how the groups become ``[optimizer]``, is
`zkernel.compat.torch_optim` ([Note: a torch optimizer as zkernel's]), shared
with the DeepSpeed and Trainer paths; a refusal is a `ConfigError` before
training starts.
"""

from __future__ import annotations

from typing import Any

import attrs
from torch import nn

from zkernel.compat.torch_optim import Origin, TorchAdam
from zkernel.errors import ConfigError
from zkernel.spec.sections import OptimizerConfig

_DEFAULTS = OptimizerConfig()
_ORIGIN = Origin(whose="configure_optimizers'", model="the LightningModule")


class OptimizerMap(TorchAdam):
    """``configure_optimizers``' torch Adam/AdamW read against the LightningModule (a `ConfigError` if
    zkernel cannot step it); built by the strategy at setup."""

    def __init__(self, optimizer: Any, module: nn.Module) -> None:
        super().__init__(optimizer, module, _ORIGIN)

    def section(self, base: OptimizerConfig, offloaded: bool) -> OptimizerConfig:
        """The config's ``[optimizer]`` for this optimizer, over the user's ``base`` section (its optimizer
        name and options); a value the user set there that the optimizer contradicts is a `ConfigError`."""
        rate, first = self.base()
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
        section = attrs.evolve(
            base,
            name=name,
            lr=rate,
            betas=first.betas,
            eps=first.eps,
            weight_decay=first.weight_decay,
            options={**base.options, "decoupled_weight_decay": self.decoupled},
        )
        return self.with_groups(section)
