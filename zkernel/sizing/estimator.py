"""Predict what one rank will hold before training: `estimate`, built on the components' answers.

`estimate(model, config, world_size)` returns the bytes of model state one
rank holds, in `Engine.memory_report`'s categories (``params``, ``grads``,
``master_weights``, ``optimizer_state``) by where they live (the compute
device, ``"cpu"``, ``"nvme"``), without allocating the model: it reads
parameter shapes only, so the model may be an ``nn.Module`` on the meta
device, an import path ``"pkg.mod:factory"`` (called under
``torch.device("meta")``), or the numbers of a GPT- or Llama-like transformer
(`TransformerShape`, or a dict of its fields; see `zkernel.sizing.model_shape`).
``grads`` is its peak as ``memory_report()`` sees it after any backward of an
accumulation window (not the transient buckets in flight during one); the
rest is the steady state after a step, less what zero3 holds between steps
for the next forward: the first units it starts gathering during the step, at
most ``prefetch_bytes`` in the compute dtype (see [Note: prefetch across the
step] in `zkernel.kernel.scheduler`; with ``prefetch_bytes = 0`` there are none).

Algorithm. Nothing here knows a partitioner, tier or optimizer ([Note:
components answer for their bytes] in `zkernel.spec.sizing`): the selected
partitioner lays the model out (``zkernel_size_partition``: its groups and,
per group, the buffers it keeps wherever the tiers put each role), each
selected tier says where the roles it owns live and which fractions of its
groups it keeps elsewhere (``zkernel_size_offload_tier``), and the optimizer
declares its state per group (``zkernel_declare_optimizer``, as at
`initialize`). `zkernel.kernel.sizing.Estimator` puts the answers together: it assigns each
trainable group its optimizer placement ([Note: optimizer spill]), asks the
partitioner for the group's buffers there, adds the optimizer's state and the
tier's staging copy, and tallies bytes by category and place. The accuracy
test (tests/sizing/test_estimator.py) holds the answers to what ``memory_report()``
measures, byte for byte.

The activations a forward saves are a separate, rough formula:
`zkernel.sizing.model_shape.estimate_activations`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from zkernel.kernel.config_source import load_config
from zkernel.kernel.plugin_manager import collect_components, get_plugin_manager
from zkernel.kernel.sizing import Estimator
from zkernel.platform.machine import Capacity
from zkernel.sizing.model_shape import TransformerShape, as_module
from zkernel.spec.config import Config, ConfigError, auto_keys
from zkernel.spec.registry import Family
from zkernel.spec.sizing import CATEGORIES, Role, totals

__all__ = [
    "CATEGORIES",
    "Estimator",
    "Row",
    "estimate",
    "estimate_table",
    "answering_tiers",
    "installed_tiers",
    "totals",
]


def estimate(
    model: nn.Module | str | TransformerShape | Mapping[str, Any],
    config: Config | Mapping[str, Any] | str | os.PathLike | None = None,
    world_size: int = 1,
    *,
    device: str | None = None,
    partitioner_options: Any = None,
    optimizer_options: Any = None,
    plugins: Sequence[Any] = (),
) -> dict[str, dict[str, int]]:
    """Predicted bytes one rank holds, by category (memory_report's) and by where it lives.

    ``device`` names the compute device in the result (default ``"cuda"`` when
    CUDA is available, else ``"cpu"``, as `zkernel.initialize` would pick);
    tiers add ``"cpu"`` and ``"nvme"``. ``grads`` is the peak after backward.
    ``partitioner_options``, ``optimizer_options``: the partitioner's and the
    optimizer tier's validated options objects, when the caller has them (else
    they are built from the config); the tier's spill fractions count
    ([Note: optimizer spill]), CUDA-only ones only on a compute device other
    than ``"cpu"``. ``plugins``: plugin objects beside the installed ones, as
    `zkernel.initialize` takes them.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be an integer >= 1, got {world_size!r}")
    cfg = load_config(config)
    if auto_keys(cfg):
        raise ConfigError(
            f"{', '.join(auto_keys(cfg))} = 'auto' is resolved by the planner at initialize: "
            "zkernel.sizing.planning.plan(model, config, world_size) (or `zkernel estimate --plan`) shows its choice"
        )
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    sizing = Estimator(as_module(model), device, get_plugin_manager(plugins, config=cfg))
    return _estimate_with(sizing, cfg, world_size, partitioner_options, optimizer_options)


def _estimate_with(sizing: Estimator, cfg: Config, world_size: int, partitioner_options: Any = None, optimizer_options: Any = None) -> dict[str, dict[str, int]]:
    return _roles_with(sizing, cfg, world_size, partitioner_options, optimizer_options)[0]


def _roles_with(
    sizing: Estimator, cfg: Config, world_size: int, partitioner_options: Any = None, optimizer_options: Any = None
) -> tuple[dict[str, dict[str, int]], dict[Role, dict[str, int]]]:
    """(bytes by category and place, the same by `Role`) of one concrete config."""
    if partitioner_options is None:
        sizing.layout(cfg, world_size, None)  # an unknown or silent partitioner is the first error
    shares = sizing.spill_shares(cfg, optimizer_options)
    groups = sizing.groups(cfg, world_size, partitioner_options, shares=shares)
    pool = sizing.selected_tier(cfg, "optimizer", optimizer_options).staging_pool
    return sizing.tally(groups, cfg, sizing.device, pool), sizing.tally_roles(groups, cfg, sizing.device, pool)


def installed_tiers(config: Config) -> list[str]:
    """Names of the offload tiers the installed plugins offer."""
    return collect_components(get_plugin_manager(config=config)).names(Family.OFFLOAD_TIER)


def answering_tiers(role: str, config: Config | None = None, device: str = "cpu") -> list[str]:
    """Names of the installed offload tiers that answer for their bytes as ``role``'s tier
    (``"optimizer"``, ``"params"``): those `estimate` and a planner can place state in."""
    config = config if config is not None else Config()
    sizing = Estimator(nn.Module(), device, get_plugin_manager(config=config))
    return sizing.answering_tiers(role)


# -- every partitioner x offload combination ------------------------------------------


@attrs.frozen
class Row:
    """One line of ``zkernel estimate``'s table."""

    partitioner: str
    offload_optimizer: str
    offload_params: str
    report: dict[str, dict[str, int]]
    # The same bytes by what each buffer is for (`zkernel.spec.sizing.Role`), for explaining a row.
    roles: dict[Role, dict[str, int]] = attrs.field(factory=dict)


def _options_for(sizing: Estimator, config: Config, partitioner: str) -> dict[str, Any]:
    """The config's partitioner options that ``partitioner`` takes (each partitioner has its own)."""
    component = sizing.registry.get(Family.PARTITIONER, partitioner)
    if component is None or component.options_cls is None:
        return {}
    names = {a.name for a in attrs.fields(component.options_cls)}
    return {k: v for k, v in config.partitioner_options.items() if k in names}


def estimate_table(
    model: nn.Module | str | TransformerShape | Mapping[str, Any],
    config: Config | Mapping[str, Any] | str | os.PathLike | None,
    world_size: int,
    *,
    device: str,
    tiers: Iterable[str] | None = None,
    plugins: Sequence[Any] = (),
) -> list[Row]:
    """`estimate` for every installed partitioner and offload combination that answer for their
    bytes (tiers: ``tiers``, default every installed one), the parameters offloaded only under a
    partitioner whose shards the params tier owns; a combination keeping bytes on ``"nvme"``
    needs ``offload.nvme_path``."""
    cfg = load_config(config)
    sizing = Estimator(as_module(model), device, get_plugin_manager(plugins, config=cfg))
    names = sizing.registry.names(Family.OFFLOAD_TIER) if tiers is None else list(tiers)
    serving = {role: [t for t in names if sizing.tier(t, role) is not None] for role in ("optimizer", "params")}
    device_params = [t for t in serving["params"] if sizing.tier(t, "params").level == 0]
    rows = []
    for partitioner in sizing.answering_partitioners():
        options = _options_for(sizing, cfg, partitioner)
        probe = attrs.evolve(cfg, partitioner=partitioner, partitioner_options=options)
        layout = sizing.layout(probe, world_size, None)
        for optimizer_tier in serving["optimizer"]:
            for params_tier in serving["params"] if layout.shards_params else device_params:
                places = {*sizing.tier(optimizer_tier, "optimizer").where.values(), *sizing.tier(params_tier, "params").where.values()}
                if "nvme" in places and cfg.offload.nvme_path is None:
                    continue  # a row keeping bytes in swap files needs offload.nvme_path
                # The configured tier options (its spill fractions) belong to the configured tiers only.
                offload = attrs.evolve(
                    cfg.offload,
                    optimizer=optimizer_tier,
                    params=params_tier,
                    optimizer_options=cfg.offload.optimizer_options if optimizer_tier == cfg.offload.optimizer else {},
                    params_options=cfg.offload.params_options if params_tier == cfg.offload.params else {},
                )
                variant = attrs.evolve(probe, offload=offload)
                rows.append(Row(partitioner, optimizer_tier, params_tier, *_roles_with(sizing, variant, world_size)))
    return rows


# -- what this machine has -----------------------------------------------------------


def shortfalls(per_rank: Mapping[str, int], capacity: Capacity, ranks_per_machine: int, device: str) -> list[str]:
    """The places (``device``, ``"cpu"``, ``"nvme"``) where ``ranks_per_machine`` ranks of ``per_rank`` bytes do not fit.

    The device is per GPU; CPU memory and disk are shared by the machine's
    ranks. A place whose capacity is unknown is not judged, except that
    needing a GPU without one, or NVMe without a path, is a shortfall.
    """
    short = []
    if device != "cpu" and (capacity.device_bytes is None or per_rank.get(device, 0) > capacity.device_bytes):
        short.append(device)
    host = per_rank.get("cpu", 0) * ranks_per_machine
    if capacity.host_bytes is not None and host > capacity.host_bytes:
        short.append("cpu")
    disk = per_rank.get("nvme", 0) * ranks_per_machine
    if disk and (capacity.disk_bytes is None or disk > capacity.disk_bytes):
        short.append("nvme")
    return short
