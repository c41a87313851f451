"""Automatic placement: ``"auto"`` in the config, resolved by a planner before any component is built.

[Note: automatic placement] ``partitioner``, ``offload.optimizer`` and
``offload.params`` may be ``"auto"``. `zkernel.initialize` then, before it
resolves any other component (`resolve_auto`):

1. every rank reads what it has (`zkernel.platform.machine.local_capacity`: free
   memory of its compute device, available host memory, free disk at
   ``offload.nvme_path``); the ranks gather these and every figure becomes the
   job's minimum (`zkernel.spec.planner.job_capacity`), replaced by ``[planner]`` overrides;
2. rank 0 alone builds the planner ``[planner] name`` selects (a component of
   the planner family, `zkernel.spec.registry.Family.PLANNER`) and asks it for a
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

from typing import Any

from torch import nn

from zkernel.platform.machine import local_capacity
from zkernel.spec.config import Config, auto_keys
from zkernel.spec.planner import _COMPUTE_DTYPES, PlacementError, Plan, Planner, PlanRequest, job_capacity
from zkernel.telemetry.log import get_logger

log = get_logger()

# -- at initialize -------------------------------------------------------------------------


def resolve_auto(
    model: nn.Module, config: Config, registry: Any, dist_info: Any, installed: Any = None
) -> tuple[Config, Plan | None]:
    """The concrete config for ``config`` and the plan that made it (None when nothing is ``"auto"``).

    Collective when the job has a process group: every rank must call it (see
    [Note: automatic placement]). ``installed``: the installed plugin manager
    the registry was collected from (built from ``config`` when None), which
    the planner's sizing service asks.
    """
    auto = auto_keys(config)
    if not auto:
        return config, None
    from zkernel.platform.distributed import local_world_size
    from zkernel.kernel.plugin_manager import resolve_components
    from zkernel.spec.registry import Family

    selected = resolve_components(registry, config, families=[Family.PLANNER])["planner.name"]
    local = local_capacity(dist_info.device, config.offload.nvme_path)
    ranks = [local]
    if dist_info.distributed:
        import torch.distributed as dist

        ranks = [None] * dist_info.world_size
        dist.all_gather_object(ranks, local)
    capacities = job_capacity(ranks, local_world_size(dist_info), config.planner)
    outcome: list[Any] = [None]
    failure: BaseException | None = None
    if dist_info.rank == 0:
        try:
            from zkernel.kernel.plugin_manager import get_plugin_manager
            from zkernel.kernel.sizing import Estimator

            installed = installed if installed is not None else get_plugin_manager(config=config)
            request = PlanRequest(
                model=model,
                config=config,
                world_size=dist_info.world_size,
                capacities=capacities,
                device=dist_info.device,
                tiers=tuple(registry.names(Family.OFFLOAD_TIER)),
                components=registry,
                auto=auto,
                sizing=Estimator(model, dist_info.device.type, installed, registry),
            )
            outcome[0] = ("plan", run_planner(selected, request, config, dist_info))
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


def run_planner(selected: Any, request: PlanRequest, config: Config, dist_info: Any) -> Plan:
    from zkernel.spec.runtime import RuntimeContext

    context = RuntimeContext(config=config, dist=dist_info, compute_dtype=_COMPUTE_DTYPES[config.precision])
    planner = selected.build(context)
    if not isinstance(planner, Planner):
        raise TypeError(
            f"planner.name {config.planner.name!r} built a {type(planner).__name__}, which does not implement "
            "zkernel.planning.Planner"
        )
    result = planner.plan(request)
    if not isinstance(result, Plan):
        raise TypeError(f"planner {config.planner.name!r} returned {type(result).__name__}, not a zkernel.spec.planner.Plan")
    return result


# -- without training ------------------------------------------------------------------------
