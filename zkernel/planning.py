"""Automatic placement: ``"auto"`` in the config, resolved by a planner before any component is built.

[Note: automatic placement] ``partitioner``, ``offload.optimizer`` and
``offload.params`` may be ``"auto"``. `zkernel.initialize` then, before it
resolves any other component (`resolve_auto`):

1. every rank reads what it has (`zkernel.machine.local_capacity`: free
   memory of its compute device, available host memory, free disk at
   ``offload.nvme_path``); the ranks gather these and every figure becomes the
   job's minimum (`Capacities.combine`), replaced by ``[planner]`` overrides;
2. rank 0 alone builds the planner ``[planner] name`` selects (a component of
   the planner family, `zkernel.registry.Family.PLANNER`) and asks it for a
   `Plan` (`Planner.plan`): the planner measures what it needs (other ranks
   would disturb the probes) and decides;
3. rank 0 broadcasts the plan, or its error, and every rank raises that error
   or applies the plan to its config (`Plan.apply`), so all ranks build the
   same components from the same concrete config and nothing after this
   point sees ``"auto"``.

Rank 0 logs the decision with the numbers behind it as one INFO event,
``zkernel.placement.planned``; the engine keeps it as
``engine.placement_plan`` (None when nothing was ``"auto"``). `plan` runs
steps 1-2 in one process without training (``zkernel estimate --plan``).
"""

from __future__ import annotations

import abc
import os
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from zkernel.config import AUTO, AUTO_KEYS, Config, ConfigError, PlannerConfig, auto_keys, config_value, load_config
from zkernel.log import get_logger
from zkernel.machine import LocalCapacity, Probe, local_capacity

log = get_logger()

_COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class PlacementError(ConfigError):
    """No placement the planner knows fits; the message has the numbers and what to change."""


@attrs.frozen(kw_only=True)
class Capacities:
    """What the job has, per rank or per machine, as the planner sees it."""

    # Free memory of one rank's compute device (the smallest over ranks); None when the compute
    # device is the CPU, whose memory is `host_bytes`.
    device_bytes: int | None
    # Host memory available on one machine, shared by its `ranks_per_machine` ranks (None: unknown).
    host_bytes: int | None
    # Free disk at offload.nvme_path on one machine, shared likewise (None: no path, or unknown).
    disk_bytes: int | None
    ranks_per_machine: int
    # Which of device/host/disk came from `[planner]` overrides instead of detection.
    overridden: tuple[str, ...] = ()

    @classmethod
    def combine(cls, ranks: Sequence[LocalCapacity], ranks_per_machine: int, overrides: PlannerConfig) -> Capacities:
        """The minimum over ``ranks`` of each figure (unknown where any rank does not know), then overrides."""

        def smallest(values: list[int | None]) -> int | None:
            return None if not values or any(v is None for v in values) else min(values)

        found = {
            "device": smallest([r.device_bytes for r in ranks]),
            "host": smallest([r.host_bytes for r in ranks]),
            "disk": smallest([r.disk_bytes for r in ranks]),
        }
        given = {"device": overrides.gpu_memory, "host": overrides.ram, "disk": overrides.disk}
        for key, value in given.items():
            if value is not None:
                found[key] = value
        return cls(
            device_bytes=found["device"],
            host_bytes=found["host"],
            disk_bytes=found["disk"],
            ranks_per_machine=ranks_per_machine,
            overridden=tuple(k for k, v in given.items() if v is not None),
        )


@attrs.frozen(kw_only=True)
class PlanRequest:
    """What a planner decides from (built by the kernel on rank 0, or by `plan`)."""

    # The model, read for shapes and module structure only (it may be on the meta device).
    model: nn.Module
    # The config as given: `auto` lists the keys to resolve; the others are fixed.
    config: Config
    world_size: int
    capacities: Capacities
    # Rank 0's compute device (where a planner's device probes run).
    device: torch.device
    # Names of the installed offload tiers (a planner chooses among these only).
    tiers: tuple[str, ...]
    # Every installed component (`zkernel.registry.ComponentRegistry`): names and options classes.
    components: Any = None
    # The transformer's numbers when the model was given by them (exact activation estimates).
    shape: Any = None
    # Keys whose value the planner chooses (`zkernel.config.AUTO_KEYS` that are "auto").
    auto: tuple[str, ...] = ()


@attrs.frozen(kw_only=True)
class Plan:
    """A planner's decision, concrete config values, and the numbers behind them.

    ``bytes`` holds the predicted bytes per rank by place (``"device"``,
    ``"cpu"``, ``"nvme"``) and kind (``"model_states"``, ``"activations"``,
    ``"working"``, ``"swap_pools"``: the page-locked pools swap files stream
    through); ``budgets`` the usable bytes per rank by place;
    ``measurements`` each probe's rate (`zkernel.machine.Probe`); ``rejected``
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
    capacities: Capacities | None = None
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
        shares = [
            f"{key} {value:g}"
            for key in ("gpu_share", "host_share")
            if isinstance(value := self.optimizer_options.get(key), (int, float)) and not isinstance(value, bool) and value > 0
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


# -- at initialize -------------------------------------------------------------------------


def resolve_auto(model: nn.Module, config: Config, registry: Any, dist_info: Any) -> tuple[Config, Plan | None]:
    """The concrete config for ``config`` and the plan that made it (None when nothing is ``"auto"``).

    Collective when the job has a process group: every rank must call it (see
    [Note: automatic placement]).
    """
    auto = auto_keys(config)
    if not auto:
        return config, None
    from zkernel.distributed import local_world_size
    from zkernel.plugin_manager import resolve_components
    from zkernel.registry import Family

    selected = resolve_components(registry, config, families=[Family.PLANNER])["planner.name"]
    local = local_capacity(dist_info.device, config.offload.nvme_path)
    ranks = [local]
    if dist_info.distributed:
        import torch.distributed as dist

        ranks = [None] * dist_info.world_size
        dist.all_gather_object(ranks, local)
    capacities = Capacities.combine(ranks, local_world_size(dist_info), config.planner)
    outcome: list[Any] = [None]
    failure: BaseException | None = None
    if dist_info.rank == 0:
        try:
            request = PlanRequest(
                model=model,
                config=config,
                world_size=dist_info.world_size,
                capacities=capacities,
                device=dist_info.device,
                tiers=tuple(registry.names(Family.OFFLOAD_TIER)),
                components=registry,
                auto=auto,
            )
            outcome[0] = ("plan", _run_planner(selected, request, config, dist_info))
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it
            failure = exc
            outcome[0] = ("error", type(exc).__name__, str(exc))
    if dist_info.distributed:
        import torch.distributed as dist

        dist.broadcast_object_list(outcome, src=0)
    if failure is not None:
        raise failure
    if outcome[0][0] == "error":
        _, kind, message = outcome[0]
        error = PlacementError if kind in ("PlacementError", "ConfigError") else RuntimeError
        raise error(f"planning the placement failed on rank 0 ({kind}): {message}")
    plan = outcome[0][1]
    if dist_info.rank == 0:
        log.info("zkernel.placement.planned", placement=plan.placement, **plan.event())
    return plan.apply(config), plan


def _run_planner(selected: Any, request: PlanRequest, config: Config, dist_info: Any) -> Plan:
    from zkernel.runtime import RuntimeContext

    context = RuntimeContext(config=config, dist=dist_info, compute_dtype=_COMPUTE_DTYPES[config.precision])
    planner = selected.build(context)
    if not isinstance(planner, Planner):
        raise TypeError(
            f"planner.name {config.planner.name!r} built a {type(planner).__name__}, which does not implement "
            "zkernel.planning.Planner"
        )
    result = planner.plan(request)
    if not isinstance(result, Plan):
        raise TypeError(f"planner {config.planner.name!r} returned {type(result).__name__}, not a zkernel.planning.Plan")
    return result


# -- without training ------------------------------------------------------------------------


def plan(
    model: Any,
    config: Config | Mapping[str, Any] | str | os.PathLike | None = None,
    world_size: int = 1,
    *,
    gpus: int | None = None,
    plugins: Sequence[Any] = (),
    keys: Sequence[str] | None = None,
) -> Plan:
    """What the planner would choose for ``model`` on ``world_size`` ranks of this machine, without training.

    ``model``: a module (shapes only), an import path ``"pkg.mod:factory"``, or
    a transformer's numbers (`zkernel.model_shape.TransformerShape` or a dict).
    The keys of ``config`` that are ``"auto"`` are planned; when none is, all
    three are. ``keys`` names the keys to plan instead (of `AUTO_KEYS`; ``()``:
    none, so the planner only sizes and checks the placement ``config`` fixes,
    and raises `PlacementError` when it does not fit). ``gpus`` overrides how
    many GPUs this machine has (0: train on the CPU). Capacities come from this
    machine, replaced by ``[planner]`` ``gpu_memory``/``ram``/``disk``.
    """
    from zkernel.distributed import DistInfo
    from zkernel.model_shape import TransformerShape, as_module, as_shape
    from zkernel.plugin_manager import collect_components, get_plugin_manager, resolve_components
    from zkernel.registry import Family

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be an integer >= 1, got {world_size!r}")
    cfg = load_config(config)
    if keys is not None:
        unknown = sorted(set(keys) - set(AUTO_KEYS))
        if unknown:
            raise ConfigError(f"keys {unknown} cannot be planned; the planner chooses {', '.join(AUTO_KEYS)}")
        values = {key: config_value(cfg, key) for key in AUTO_KEYS}
        for key in AUTO_KEYS:
            if key not in keys and values[key] == AUTO:
                raise ConfigError(f"{key} is 'auto' in the config but not among keys {list(keys)}: give it a value or plan it")
        values.update({key: AUTO for key in keys})
        offload = attrs.evolve(cfg.offload, optimizer=values["offload.optimizer"], params=values["offload.params"])
        cfg = attrs.evolve(cfg, partitioner=values["partitioner"], offload=offload)
    elif not auto_keys(cfg):
        cfg = attrs.evolve(
            cfg, partitioner=AUTO, offload=attrs.evolve(cfg.offload, optimizer=AUTO, params=AUTO, optimizer_options={}, params_options={})
        )
    shape = model if isinstance(model, TransformerShape) else as_shape(model) if isinstance(model, Mapping) else None
    module = as_module(shape if shape is not None else model)
    cuda = torch.cuda.is_available()
    gpus = (torch.cuda.device_count() if cuda else 0) if gpus is None else gpus
    device = torch.device("cuda", 0) if cuda and gpus > 0 else torch.device("cpu")
    local = local_capacity(device, cfg.offload.nvme_path)
    if gpus > 0 and local.device_bytes is None and cfg.planner.gpu_memory is None:
        raise ConfigError("no CUDA device here to read the GPU memory from: give [planner] gpu_memory (--gpu-memory)")
    if gpus == 0:
        local = attrs.evolve(local, device_bytes=None)
    ranks_per_machine = min(world_size, gpus) if gpus else world_size
    capacities = Capacities.combine([local], ranks_per_machine, cfg.planner)
    registry = collect_components(get_plugin_manager(plugins, config=cfg))
    selected = resolve_components(registry, cfg, families=[Family.PLANNER])["planner.name"]
    request = PlanRequest(
        model=module,
        config=cfg,
        world_size=world_size,
        capacities=capacities,
        device=device,
        tiers=tuple(registry.names(Family.OFFLOAD_TIER)),
        components=registry,
        shape=shape,
        auto=auto_keys(cfg),
    )
    dist_info = DistInfo(0, world_size, 0, device, None)
    return _run_planner(selected, request, cfg, dist_info)
