"""A torch optimizer's parameter groups followed between steps by an engine that steps its own optimizer.

[Note: following a torch optimizer] Where a user's torch Adam/AdamW stays what their code changes
after the engine is built (Lightning keeps the optimizer ``configure_optimizers`` returned; a DeepSpeed
script passes a torch lr scheduler over its client optimizer), its groups' values are read again
before the engine's next step: whatever changed them since (a torch lr scheduler, per step or per
epoch, ``OneCycleLR`` with its betas, the user writing ``param_groups[i]["lr"]``) reaches that step.
The engine's ``lr`` becomes the largest group's rate (`zkernel.compat.torch_optim.step_rate`) and
every parameter's hyperparameters (`zkernel.spec.groups.ParamHyper`, [Note: per-parameter
hyperparameters] in `zkernel.kernel.param_hyper`) are set anew. A group at rate 0 (a warm-up's first
step) is a scale of 0; all groups at 0 are 0. Nothing is done when no value changed.
"""

from __future__ import annotations

from typing import Any

from zkernel.compat.torch_optim import GroupValues, TorchAdam, step_rate
from zkernel.kernel.param_hyper import mark_overrides


class TorchOptimizerSync:
    """Carries a mapped torch optimizer's values into ``engine`` ([Note: following a torch optimizer]).

    Built after the engine by the Lightning strategy and by ``zkernel.deepspeed.initialize`` (with a
    client lr scheduler); they call `sync` before each optimizer step of the engine. ``owns_rate``:
    False where the config's own lr schedule sets the rate, and only the scales follow the groups.
    """

    def __init__(self, mapping: TorchAdam, engine: Any, *, owns_rate: bool) -> None:
        self._map, self._engine = mapping, engine
        self._owns_rate = owns_rate
        self._last: list[GroupValues] | None = None

    def sync(self) -> None:
        """Set the engine's rate and every parameter's hyperparameters from the groups' values now."""
        values = self._map.values()
        if values == self._last:
            return
        rate = step_rate(values)
        if self._owns_rate:
            self._engine.lr = rate
        mark_overrides(self._engine.module, self._engine.groups, self._map.param_hyper(values, rate))
        self._last = values
