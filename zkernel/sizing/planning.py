"""``zkernel estimate --plan``: what the planner would choose for a model on this machine, without training.

The planner runs as at `zkernel.initialize` (`zkernel.kernel.planning`), in one
process, with this machine's capacities or the ones the caller gives.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from zkernel.kernel.config_source import load_config
from zkernel.kernel.planning import run_planner
from zkernel.platform.machine import RATE_NAMES, local_capacity
from zkernel.spec.config import AUTO, AUTO_KEYS, Config, ConfigError, auto_keys, config_value
from zkernel.spec.planner import Plan, PlanRequest, job_capacity


def plan(
    model: Any,
    config: Config | Mapping[str, Any] | str | os.PathLike | None = None,
    world_size: int = 1,
    *,
    gpus: int | None = None,
    plugins: Sequence[Any] = (),
    keys: Sequence[str] | None = None,
    rates: Mapping[str, float] | None = None,
) -> Plan:
    """What the planner would choose for ``model`` on ``world_size`` ranks of this machine, without training.

    ``model``: a module (shapes only), an import path ``"pkg.mod:factory"``, or
    a transformer's numbers (`zkernel.spec.model_shape.TransformerShape` or a dict).
    The keys of ``config`` that are ``"auto"`` are planned; when none is, all
    three are. ``keys`` names the keys to plan instead (of `AUTO_KEYS`; ``()``:
    none, so the planner only sizes and checks the placement ``config`` fixes,
    and raises `PlacementError` when it does not fit). ``gpus`` overrides how
    many GPUs this machine has (0: train on the CPU). Capacities come from this
    machine, replaced by ``[planner]`` ``gpu_memory``/``ram``/``disk``. ``rates``: the
    planned machine's rates by name (`zkernel.platform.machine.RATE_NAMES`; bytes per second,
    elements per second for ``cpu_adam``), used instead of measuring them here; the
    decision's `Plan.measurements` say which were given (reason ``"given"``).
    """
    from zkernel.platform.distributed import DistInfo
    from zkernel.spec.model_shape import TransformerShape, as_module, as_shape
    from zkernel.kernel.plugin_manager import collect_components, get_plugin_manager, resolve_components
    from zkernel.kernel.sizing import Estimator
    from zkernel.spec.registry import Family

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be an integer >= 1, got {world_size!r}")
    rates = dict(rates or {})
    unknown = sorted(set(rates) - set(RATE_NAMES))
    if unknown:
        raise ConfigError(f"unknown rate(s) {unknown}; rates a planner measures: {', '.join(RATE_NAMES)}")
    bad = {name: rate for name, rate in rates.items() if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0}
    if bad:
        raise ConfigError(f"rates must be positive numbers (per second), got {bad}")
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
    capacities = job_capacity([local], ranks_per_machine, cfg.planner)
    installed = get_plugin_manager(plugins, config=cfg)
    registry = collect_components(installed)
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
        # The planned machine's compute device: a GPU where it has GPUs, though this one may have none.
        sizing=Estimator(module, "cuda" if gpus > 0 else device.type, installed, registry),
        rates=rates,
    )
    dist_info = DistInfo(0, world_size, 0, device, None)
    return run_planner(selected, request, cfg, dist_info)
