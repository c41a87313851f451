"""The planner interface: what a planner is asked (`PlanRequest`) and what it answers (`Plan`).

A planner is a component of the planner family (``zkernel_register_planners``);
`zkernel.kernel.planning` asks the selected one for a `Plan` when the config has
``"auto"`` values (see [Note: automatic placement] there).
"""


from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from zkernel.spec.config import AUTO, Config, ConfigError, PlannerConfig
from zkernel.telemetry.log import get_logger
from zkernel.platform.machine import Capacity, Probe

log = get_logger()

_COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class PlacementError(ConfigError):
    """No placement the planner knows fits; the message has the numbers and what to change."""


# The planner's name for the one capacity type (`zkernel.platform.machine.Capacity`).
Capacities = Capacity


def job_capacity(ranks: Sequence[Capacity], ranks_per_machine: int, overrides: PlannerConfig) -> Capacity:
    """What the job has, as a planner sees it: the minimum over ``ranks`` of each figure, then the
    ``[planner]`` overrides (``gpu_memory``, ``ram``, ``disk``)."""
    return Capacity.combine(
        ranks, ranks_per_machine, device=overrides.gpu_memory, host=overrides.ram, disk=overrides.disk
    )


@attrs.frozen(kw_only=True)
class PlanRequest:
    """What a planner decides from (built by the kernel on rank 0, or by `plan`)."""

    # The model, read for shapes and module structure only (it may be on the meta device).
    model: nn.Module
    # The config as given: `auto` lists the keys to resolve; the others are fixed.
    config: Config
    world_size: int
    capacities: Capacity
    # Rank 0's compute device (where a planner's device probes run).
    device: torch.device
    # Names of the installed offload tiers (a planner chooses among these only).
    tiers: tuple[str, ...]
    # Every installed component (`zkernel.spec.registry.ComponentRegistry`): names and options classes.
    components: Any = None
    # The transformer's numbers when the model was given by them (exact activation estimates).
    shape: Any = None
    # Keys whose value the planner chooses (`zkernel.spec.config.AUTO_KEYS` that are "auto").
    auto: tuple[str, ...] = ()
    # Bytes of any placement of `model`, from the installed components' own answers
    # (`zkernel.spec.sizing.SizingService`; [Note: components answer for their bytes]).
    sizing: Any = None
    # Rates of the machine the plan is for, given instead of measured here, by probe name
    # (`zkernel.platform.machine.RATE_NAMES`: bytes per second, elements per second for the
    # CPU Adam rate); a planner uses
    # these and measures only the others (which then describe the machine it runs on).
    rates: Mapping[str, float] = attrs.field(factory=dict)



@attrs.frozen(kw_only=True)
class Plan:
    """A planner's decision, concrete config values, and the numbers behind them.

    ``bytes`` holds the predicted bytes per rank by place (``"device"``,
    ``"cpu"``, ``"nvme"``) and kind (``"model_states"``, ``"activations"``,
    ``"working"``, ``"swap_pools"``: the page-locked pools swap files stream
    through); ``budgets`` the usable bytes per rank by place;
    ``measurements`` each probe's rate (`zkernel.platform.machine.Probe`); ``rejected``
    one line per placement tried that does not fit; ``notes`` what was
    assumed or left out.
    """

    planner: str
    partitioner: str
    # partitioner_options for the chosen partitioner (applied when partitioner was "auto").
    partitioner_options: Mapping[str, Any] = attrs.field(factory=dict)
    offload_optimizer: str
    offload_params: str
    optimizer_options: Mapping[str, Any] = attrs.field(factory=dict)
    params_options: Mapping[str, Any] = attrs.field(factory=dict)
    # [activation_checkpointing] modules and offload the planner set, or None: as configured.
    activation_checkpointing: tuple[tuple[str, ...], str] | None = None
    # [tiling] min_numel and tiles the planner set, or None: as configured.
    tiling: tuple[int, int] | None = None
    bytes: Mapping[str, Mapping[str, int]] = attrs.field(factory=dict)
    budgets: Mapping[str, int | None] = attrs.field(factory=dict)
    capacities: Capacity | None = None
    measurements: Mapping[str, Probe] = attrs.field(factory=dict)
    predicted_seconds: Mapping[str, float] = attrs.field(factory=dict)
    rejected: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def apply(self, config: Config) -> Config:
        """``config`` with every ``"auto"`` replaced by this plan's choice (and what the plan added)."""
        offload = config.offload
        if offload.optimizer == AUTO:
            offload = attrs.evolve(offload, optimizer=self.offload_optimizer, optimizer_options=dict(self.optimizer_options))
        if offload.params == AUTO:
            offload = attrs.evolve(offload, params=self.offload_params, params_options=dict(self.params_options))
        changes: dict[str, Any] = {"offload": offload}
        if config.partitioner == AUTO:
            changes["partitioner"] = self.partitioner
            changes["partitioner_options"] = dict(self.partitioner_options)
        if self.activation_checkpointing is not None:
            modules, where = self.activation_checkpointing
            changes["activation_checkpointing"] = attrs.evolve(
                config.activation_checkpointing, modules=modules, offload=where
            )
        if self.tiling is not None:
            min_numel, tiles = self.tiling
            changes["tiling"] = attrs.evolve(config.tiling, min_numel=min_numel, tiles=tiles)
        return attrs.evolve(config, **changes)

    @property
    def placement(self) -> str:
        """``partitioner, optimizer on X, parameters on Y`` (and what else was set), for people."""
        text = f"{self.partitioner}, optimizer on {_where(self.offload_optimizer)}, parameters on {_where(self.offload_params)}"
        # The numbers the planner chose for the optimizer tier (its own options, such as a spill fraction).
        shares = [
            f"{key} {value:g}"
            for key, value in self.optimizer_options.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
        ]
        if shares:
            text += f" ({', '.join(shares)})"
        if self.activation_checkpointing is not None:
            modules, where = self.activation_checkpointing
            text += f", activation checkpointing of {', '.join(modules)}" + (" offloaded to CPU" if where == "cpu" else "")
        if self.tiling is not None:
            text += f", Linear layers of >= {self.tiling[0]:,} elements in {self.tiling[1]} tiles"
        return text

    def event(self) -> dict[str, Any]:
        """The fields of the ``zkernel.placement.planned`` event (plain values)."""
        caps = self.capacities
        return {
            "planner": self.planner,
            "partitioner": self.partitioner,
            "offload_optimizer": self.offload_optimizer,
            "offload_params": self.offload_params,
            "optimizer_options": dict(self.optimizer_options),
            "activation_checkpointing": list(self.activation_checkpointing[0]) if self.activation_checkpointing else None,
            "activation_offload": self.activation_checkpointing[1] if self.activation_checkpointing else None,
            "tiling": {"min_numel": self.tiling[0], "tiles": self.tiling[1]} if self.tiling else None,
            "bytes": {place: dict(kinds) for place, kinds in self.bytes.items()},
            "budgets": dict(self.budgets),
            "capacities": attrs.asdict(caps) if caps is not None else None,
            "measurements": {k: (p.rate if p.rate is not None else f"not measured ({p.reason})") for k, p in self.measurements.items()},
            "predicted_seconds": dict(self.predicted_seconds),
            "rejected": list(self.rejected),
            "notes": list(self.notes),
        }


def _where(tier: str) -> str:
    return "the compute device" if tier == "none" else tier


class Planner(abc.ABC):
    """A planner component (``zkernel_register_planners``): chooses the placement for ``"auto"``."""

    @abc.abstractmethod
    def plan(self, request: PlanRequest) -> Plan:
        """Choose values for ``request.auto`` (keep every other key as configured).

        Called by `zkernel.initialize` on rank 0 only, once, before any other
        component is built (and by `plan`, in one process); the result reaches
        every rank through a broadcast, so it must be picklable. May run
        measurements on ``request.device`` and at ``offload.nvme_path``; must
        leave nothing behind. Raises `PlacementError` with the numbers when
        nothing fits.
        """


