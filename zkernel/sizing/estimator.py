"""Predict what one rank will hold before training: `estimate`.

`estimate(model, config, world_size)` returns the bytes of model state one
rank holds, in `Engine.memory_report`'s categories (``params``, ``grads``,
``master_weights``, ``optimizer_state``) by where they live (the compute
device, ``"cpu"``, ``"nvme"``), without allocating the model: it reads
parameter shapes only, so the model may be an ``nn.Module`` on the meta
device, an import path ``"pkg.mod:factory"`` (called under
``torch.device("meta")``), or the numbers of a GPT- or Llama-like transformer
(`TransformerShape`, or a dict of its fields; see `zkernel.sizing.model_shape`). ``grads`` is its peak as
``memory_report()`` sees it after any backward of an accumulation window (not
the transient buckets in flight during one); the rest is the steady state
after a step, less what zero3 holds between steps for the next forward: the
first units it starts gathering during the step, at most ``prefetch_bytes``
in the compute dtype (see [Note: prefetch across the step] in
`zkernel.kernel.scheduler`; with ``prefetch_bytes = 0`` there are none).

Algorithm. The model's unique parameters are cut into the groups the
selected partitioner makes (reverse-order buckets of ``bucket_size`` elements
for none/zero1/zero2; ZeRO-3 units by ``units`` policy, with those under
``persistence_threshold`` pooled in one whole group), each group's flat
buffers are listed with their roles (`Buffer`) exactly as the builtin
partitioners and tiers allocate them, padding to a multiple of the world size
included, and `TIER_PLACEMENT` says where each role lives for the selected
offload tiers (group by group where a tier keeps fractions of its groups
elsewhere: ``gpu_share``, ``host_share``, [Note: optimizer spill]). The
builtin partitioners are modelled here, not asked: the accuracy test
(tests/test_estimator.py) holds this file to what ``memory_report()``
measures.

The activations a forward saves are a separate, rough formula:
`zkernel.sizing.model_shape.estimate_activations`.
"""

from __future__ import annotations

import enum
import math
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from zkernel.spec.config import Config, ConfigError, auto_keys
from zkernel.kernel.config_source import load_config
from zkernel.platform.machine import available_host_bytes
from zkernel.sizing.model_shape import DTYPE_BYTES as _DTYPE_BYTES
from zkernel.sizing.model_shape import TransformerShape, as_module
from zkernel.params.unit_modules import unit_module_ids

CATEGORIES = ("params", "grads", "master_weights", "optimizer_state")
_ALIGN = 16  # elements; as `plugins/partitioners/_flat.ALIGN` (tests/test_estimator.py holds them equal)
PARTITIONERS = ("none", "zero1", "zero2", "zero3")
_STEP_COUNTER_BYTES = 4  # the optimizer's fp32 ``step`` count, one per parameter of a trainable group
DEVICE = "device"  # placeholder for the compute device in `TIER_PLACEMENT`


class Role(enum.Enum):
    """What a buffer is for; decides its `memory_report` category and, through its tier, where it lives."""

    PARAM_FULL = "param_full"  # whole compute-dtype parameters kept on the device
    PARAM_SHARD = "param_shard"  # this rank's compute-dtype slice (ZeRO-3), owned by offload.params
    STAGING = "staging"  # compute-dtype copy of the updated slice kept by an optimizer tier (bf16/fp16)
    MASTER = "master"  # fp32 slice the optimizer updates, owned by offload.optimizer
    GRAD_REDUCE = "grad_reduce"  # fp32 whole gradient accumulated over a window on the device (none, zero1)
    GRAD_LANDING = "grad_landing"  # fp32 gradient slice the step reads, owned by offload.optimizer
    OPTIMIZER_STATE = "optimizer_state"  # Adam moments and step counter, owned by offload.optimizer


# Role -> (memory_report category, offload role owning it, or None: always on the compute device).
_ROLES = {
    Role.PARAM_FULL: ("params", None),
    Role.PARAM_SHARD: ("params", "params"),
    Role.STAGING: ("params", "optimizer"),
    Role.MASTER: ("master_weights", "optimizer"),
    Role.GRAD_REDUCE: ("grads", None),
    Role.GRAD_LANDING: ("grads", "optimizer"),
    Role.OPTIMIZER_STATE: ("optimizer_state", "optimizer"),
}


@attrs.frozen
class Spill:
    """Part of an optimizer tier's groups whose optimizer roles are kept as another row of `TIER_PLACEMENT` keeps them."""

    option: str  # the tier's option giving the fraction of the trainable elements, e.g. "gpu_share"
    row: str  # the row those groups' optimizer roles follow, e.g. "none" (on the compute device)
    cuda_only: bool = False  # the tier ignores the option without CUDA
    # The tier places its groups as it adopts them, so a group's fp32 master on the device may be
    # the partitioner's own tensor; False: only zero3's module-bound groups are placed then, the
    # others are moved after the first step, as copies.
    at_adopt: bool = True


@attrs.frozen
class TierPlacement:
    """Where a tier keeps the buffers of the roles it owns (`DEVICE`: the compute device; None: not kept)."""

    serves: tuple[str, ...]  # offload roles it can be selected for: "optimizer", "params"
    where: Mapping[Role, str | None]
    # Fractions of its groups kept elsewhere, taken in this order ([Note: optimizer spill]).
    spills: tuple[Spill, ...] = ()
    # The option naming how many buffers the tier's staging copies in host memory are lent from
    # (one pool for all its host-stepped groups, each buffer as large as the largest); None: one
    # staging copy per group.
    staging_pool: str | None = None


# [Note: placement table] What `estimate` knows of each tier: where it keeps each
# buffer of the roles it owns (``offload.optimizer`` owns the fp32 master, the
# optimizer state, the gradient landing buffer and a compute-dtype staging copy;
# ``offload.params`` the compute-dtype parameter shard). On the device, tier
# ``none`` adopts the reduced gradient as its landing buffer (so for none and
# zero1 it is the window's whole gradient, counted once) and writes updates
# straight into the parameters when they live there (else into a staging copy
# on the device). The host tiers write host-stepped updates for parameters that
# live elsewhere into buffers lent per step from one pool (``staging_pool``):
# that many copies as large as the largest group, whatever the group count.
# (`estimate` counts the pool; the default planner still counts one copy per
# group, which its placement tests were sized with: moving it is open work.)
# Adding or changing a tier is editing its row; tests/test_estimator.py
# holds each installed tier's row to what ``memory_report()`` measures.
#
# [Note: optimizer spill] An optimizer tier may keep some of its groups as
# another row does (`Spill`): the ``cpu`` tier's numeric ``gpu_share`` keeps
# the optimizer of the first groups on the GPU (master, state, gradient); the
# ``nvme`` tier's ``gpu_share`` does the same and its ``host_share`` keeps the
# next groups' master and state in host memory, the rest in swap files.
# Groups are taken whole, in the next forward's order (zero3's units in
# module order, its pooled group last; for none/zero1/zero2 the last bucket
# built, which holds the first parameters, first), each by the first spill
# whose budget, ``int(fraction * total)`` elements, still holds it; a group
# no budget holds stays in the tier's own row. ``total`` is this rank's
# trainable elements as the tier learns them before adopting any group (over
# the shards, rounded up; the cpu tier's moves after the first step count the
# groups' padded slices, less than one element more per group). So a spill
# never takes more than its fraction, and the own row takes the rest; also
# when the fractions add up to 1, the floors of separate budgets leave a
# group there unless the first fraction is exact. ``gpu_share = "auto"``
# (cpu tier, sized at run time from the free GPU memory) is not modelled:
# estimated as 0.
TIER_PLACEMENT: dict[str, TierPlacement] = {
    "none": TierPlacement(
        ("optimizer", "params"),
        {Role.MASTER: DEVICE, Role.GRAD_LANDING: DEVICE, Role.OPTIMIZER_STATE: DEVICE, Role.STAGING: DEVICE, Role.PARAM_SHARD: DEVICE},
    ),
    # fp32 master, optimizer state, fp32 gradient landing buffer and the compute-dtype staging
    # copy in (pinned) CPU memory; as offload.params, the compute-dtype shard in CPU memory.
    "cpu": TierPlacement(
        ("optimizer", "params"),
        {Role.MASTER: "cpu", Role.GRAD_LANDING: "cpu", Role.OPTIMIZER_STATE: "cpu", Role.STAGING: "cpu", Role.PARAM_SHARD: "cpu"},
        spills=(Spill("gpu_share", "none", cuda_only=True, at_adopt=False),),
        staging_pool="staging_buffers",
    ),
    # master and optimizer state on NVMe, gradient landing buffer and staging copy in CPU memory;
    # as offload.params, the compute-dtype shard on NVMe. Not modelled: the page-locked pools
    # both roles stream through (their buffer_bytes), which are staging, not model state.
    "nvme": TierPlacement(
        ("optimizer", "params"),
        {Role.MASTER: "nvme", Role.GRAD_LANDING: "cpu", Role.OPTIMIZER_STATE: "nvme", Role.STAGING: "cpu", Role.PARAM_SHARD: "nvme"},
        spills=(Spill("gpu_share", "none", cuda_only=True), Spill("host_share", "cpu")),
        staging_pool="staging_buffers",
    ),
}


@attrs.frozen
class Buffer:
    """One per-rank buffer of a group, and where its tier keeps it (`DEVICE`, ``"cpu"``, ``"nvme"``)."""

    role: Role
    nbytes: int
    where: str = DEVICE


@attrs.frozen
class _Param:
    name: str
    numel: int
    trainable: bool


# -- groups, as the builtin partitioners make them -----------------------------------


def _parameters(module: nn.Module) -> list[_Param]:
    """Unique parameters (a tied one once, under its first name) in registration order."""
    return [_Param(n, p.numel(), p.requires_grad) for n, p in module.named_parameters(remove_duplicate=True)]


def _buckets(params: list[_Param], bucket_numel: int) -> list[list[int]]:
    """Element counts, bucket by bucket, of the reverse-order buckets of `plugins/partitioners/_flat.split_buckets`."""
    buckets, current, size = [], [], 0
    for p in reversed(params):
        if current and size + p.numel > bucket_numel:
            buckets.append(current)
            current, size = [], 0
        current.append(p.numel)
        size += p.numel
    if current:
        buckets.append(current)
    return buckets


def _extent(numels: Iterable[int]) -> int:
    """Elements of a flat buffer holding ``numels`` in order, each from a multiple of `_ALIGN`
    (`plugins/partitioners/_flat.FlatLayout`, [Note: aligned parameters])."""
    end = 0
    for numel in numels:
        end = -(-end // _ALIGN) * _ALIGN + numel
    return end


def _units(
    module: nn.Module, policy: str, leaf_modules: tuple[str, ...] = (), leaf_experts: bool = True
) -> list[list[_Param]]:
    """ZeRO-3's units (`plugins/partitioners/_flat.module_units`): parameters gathered together."""
    unit_ids = unit_module_ids(module, policy, leaf_modules, leaf_experts)
    seen: set[int] = set()
    units: dict[int, list[_Param]] = {}

    def visit(name: str, mod: nn.Module, unit: nn.Module) -> None:
        if id(mod) in unit_ids:
            unit = mod
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                units.setdefault(id(unit), []).append(_Param(f"{name}.{pname}", p.numel(), p.requires_grad))
        for child_name, child in mod.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child, unit)

    visit("", module, module)
    return list(units.values())


def _slices(numel: int, shards: int) -> tuple[int, int]:
    """(shard, padded) elements of a group's flat layout of ``numel`` (its extent; see [Note: flat
    layout] in the partitioners): every rank's slice a multiple of `_ALIGN`."""
    shard = -(-max(1, math.ceil(numel / shards)) // _ALIGN) * _ALIGN
    return shard, shard * shards


@attrs.frozen
class _Placement:
    """Where the selected tiers put one group's buffers."""

    optimizer: TierPlacement  # this group's row for the optimizer roles (the tier's own, or a spill's)
    params: TierPlacement
    tier: TierPlacement  # the selected optimizer tier's own row: what the partitioner asks of it
    copied_master: bool = False  # moved to the device after the first step: an fp32 master is a copy

    def where(self, role: Role) -> str | None:
        owner = _ROLES[role][1]
        return DEVICE if owner is None else getattr(self, owner).where[role]

    def on_device(self, role: Role) -> bool:
        return self.where(role) == DEVICE

    def kept(self, role: Role) -> bool:
        return self.where(role) is not None

    def buffer(self, role: Role, nbytes: int) -> Buffer:
        return Buffer(role, nbytes, self.where(role))

    def master_is_params(self, c: int) -> bool:
        """An fp32 master on the device is the parameters' own slice (nothing of its own)."""
        return c == 4 and self.on_device(Role.MASTER) and not self.copied_master


def _optimizer_buffers(shard: int, c: int, params: int, placement: _Placement) -> list[Buffer]:
    """What the optimizer tier adds for a trainable group of ``shard`` owned elements and ``params`` parameters."""
    buffers = [placement.buffer(Role.OPTIMIZER_STATE, 8 * shard + _STEP_COUNTER_BYTES * params)]
    if c != 4 and placement.kept(Role.STAGING):
        buffers.append(placement.buffer(Role.STAGING, shard * c))
    return buffers


def _whole_group(numel: int, params: int, shards: int, c: int, partitioner: str, placement: _Placement) -> list[Buffer]:
    """none/zero1/zero2: whole compute-dtype parameters, fp32 master/gradient/state slices."""
    shard, padded = _slices(numel, shards)
    buffers = [placement.buffer(Role.PARAM_FULL, padded * c)]
    if not placement.master_is_params(c):
        buffers.append(placement.buffer(Role.MASTER, 4 * shard))
    landing_adopted = placement.on_device(Role.GRAD_LANDING)
    if partitioner in ("none", "zero1"):
        # The window's whole gradient; a landing buffer on the device is it (none) or replaces it (zero1).
        buffers.append(placement.buffer(Role.GRAD_REDUCE, 4 * padded))
        if not landing_adopted:
            buffers.append(placement.buffer(Role.GRAD_LANDING, 4 * shard))
    else:
        buffers.append(placement.buffer(Role.GRAD_LANDING, 4 * shard))
    return buffers + _optimizer_buffers(shard, c, params, placement)


def _zero3_group(
    numel: int, params: int, shards: int, c: int, trainable: bool, whole: bool, placement: _Placement
) -> list[Buffer]:
    """zero3: a compute-dtype shard unless gathers cast an fp32 master that lives on the device."""
    shard, padded = _slices(numel, shards)
    buffers = [placement.buffer(Role.PARAM_FULL, padded * c)] if whole else []
    if not trainable:
        return [*buffers, placement.buffer(Role.PARAM_SHARD, shard * c)]
    params_on_device = placement.on_device(Role.PARAM_SHARD)
    # Whether gathers cast the master is the partitioner's choice for every group: it asks the tier.
    casts_master = c != 4 and placement.tier.where[Role.MASTER] == DEVICE and params_on_device
    if not casts_master:
        buffers.append(placement.buffer(Role.PARAM_SHARD, shard * c))
    # An fp32 master on the device is the shard, unless the params tier moved the shard elsewhere.
    if not (placement.master_is_params(c) and params_on_device):
        buffers.append(placement.buffer(Role.MASTER, 4 * shard))
    buffers.append(placement.buffer(Role.GRAD_LANDING, 4 * shard))
    return buffers + _optimizer_buffers(shard, c, params, placement)


def _partitioner_options(config: Config, partitioner: str) -> Any:
    """The builtin partitioner's validated options (its defaults filled in), as `initialize` builds them."""
    from zkernel.kernel.plugin_manager import collect_components, get_plugin_manager

    # [Note: resolving a component] in `zkernel.spec.registry`: the one place options are resolved.
    return collect_components(get_plugin_manager(config=config)).select(config, "partitioner", partitioner).options


def _optimizer_tier_options(config: Config) -> Any:
    """The selected optimizer tier's validated options (None when it is not installed or takes none)."""
    from zkernel.kernel.plugin_manager import collect_components, get_plugin_manager
    from zkernel.spec.registry import Family

    registry = collect_components(get_plugin_manager(config=config))
    if registry.get(Family.OFFLOAD_TIER, config.offload.optimizer) is None:
        return None
    return registry.select(config, "offload.optimizer").options


def spill_shares(config: Config, device: str, optimizer_options: Any = None) -> dict[str, float]:
    """The selected optimizer tier's spill fractions by option name ([Note: optimizer spill]).

    ``optimizer_options``: the tier's validated options object, when the caller
    has it (else built from ``config``, which loads the plugins). Fractions
    that are not numbers (``"auto"``) and, on a ``"cpu"`` compute device,
    CUDA-only ones count as 0 and are left out.
    """
    row = TIER_PLACEMENT.get(config.offload.optimizer)
    if row is None or not row.spills:
        return {}
    if optimizer_options is None:
        if not config.offload.optimizer_options:
            return {}
        optimizer_options = _optimizer_tier_options(config)  # validated: a wrong key or value is an error
    shares = {}
    for spill in row.spills:
        value = getattr(optimizer_options, spill.option, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            continue
        if spill.cuda_only and device == "cpu":
            continue
        shares[spill.option] = float(value)
    return shares


@attrs.frozen
class _Group:
    """One group as the partitioner makes it: its elements, whether it trains, whether zero3 keeps it whole."""

    numel: int  # its flat extent (alignment gaps included)
    trainable: bool
    elements: int  # of its parameters alone
    params: int  # how many parameters it holds
    whole: bool = False


def _share_total(groups: list[_Group], shards: int) -> int:
    """What the fractions are of: this rank's trainable elements as the tier is told them before
    adoption (its ``demand``), the trainable elements over the shards, rounded up."""
    return -(-sum(g.elements for g in groups if g.trainable) // shards)


def _spills_of(groups: list[_Group], shards: int, partitioner: str, tier: TierPlacement, shares: Mapping[str, float]) -> list[Spill | None]:
    """The spill each group's optimizer roles follow (None: the tier's own row), by [Note: optimizer spill]."""
    chosen: list[Spill | None] = [None] * len(groups)
    spills = [s for s in tier.spills if shares.get(s.option, 0.0) > 0]
    if not spills:
        return chosen
    trainable = [i for i, g in enumerate(groups) if g.trainable]
    sizes = {i: _slices(groups[i].numel, shards)[0] for i in trainable}
    total = _share_total(groups, shards)
    budgets = [int(shares[s.option] * total) for s in spills]
    # Shares that sum to 1 leave nothing on disk: the last takes what the others did not.
    everything = sum(shares[s.option] for s in spills) >= 1.0 - 1e-9
    used = [0] * len(spills)
    for i in trainable if partitioner == "zero3" else trainable[::-1]:
        for k, spill in enumerate(spills):
            # Placed at adopt, a GPU share takes only zero3's module-bound groups (the nvme tier's).
            if spill.cuda_only and spill.at_adopt and partitioner != "zero3":
                continue
            if sizes[i] <= budgets[k] - used[k] or (everything and k == len(spills) - 1):
                used[k] += sizes[i]
                chosen[i] = spill
                break
    return chosen


def _groups(module: nn.Module, config: Config, world_size: int, options: Any) -> tuple[list[_Group], int, list[_Param]]:
    """(the groups the partitioner makes, in the order it makes them; how many ways each is sharded; frozen parameters)."""
    partitioner = config.partitioner
    if partitioner not in PARTITIONERS:
        raise ConfigError(
            f"estimate knows the builtin partitioners ({', '.join(PARTITIONERS)}), not {partitioner!r}"
        )
    for role, tier in (("optimizer", config.offload.optimizer), ("params", config.offload.params)):
        if tier not in TIER_PLACEMENT or role not in TIER_PLACEMENT[tier].serves:
            known = [name for name, row in TIER_PLACEMENT.items() if role in row.serves]
            raise ConfigError(
                f"estimate has no placement for offload.{role} {tier!r}; known: {', '.join(known)}"
            )
    options = options if options is not None else _partitioner_options(config, partitioner)
    params = _parameters(module)
    frozen = [p for p in params if not p.trainable]
    if partitioner != "zero3":
        shards = 1 if partitioner == "none" else world_size
        buckets = _buckets([p for p in params if p.trainable], options.bucket_size)
        groups = [_Group(_extent(numels), True, sum(numels), len(numels)) for numels in buckets]
    else:
        shards = world_size
        groups, pooled = [], {True: [], False: []}
        for unit in _units(module, options.units, getattr(options, "leaf_modules", ()), getattr(options, "leaf_experts", True)):
            for trainable in (True, False):
                numels = [p.numel for p in unit if p.trainable == trainable]
                if sum(numels) < options.persistence_threshold:
                    pooled[trainable] += numels
                elif numels:
                    groups.append(_Group(_extent(numels), trainable, sum(numels), len(numels)))
        groups += [
            _Group(_extent(numels), trainable, sum(numels), len(numels), whole=True)
            for trainable, numels in pooled.items()
            if numels
        ]
    return groups, shards, frozen


@attrs.frozen
class SpillCount:
    """What the spills take of one rank's trainable elements (`spill_numel`)."""

    taken: dict[str, int]  # elements per spill option (the slices of the groups it takes)
    total: int  # what the fractions are of: this rank's trainable elements, unpadded
    groups: int  # its trainable groups


def spill_numel(
    module: nn.Module, config: Config, world_size: int, options: Any = None, *, shares: Mapping[str, float]
) -> SpillCount:
    """What each spill of ``shares`` takes ([Note: optimizer spill]).

    Any fraction from ``taken / total`` up to the one given places the same
    groups: the greedy order is the same, every group taken still fits, and
    every group passed over still does not.
    """
    groups, shards, _ = _groups(module, config, world_size, options)
    taken: dict[str, int] = {}
    for group, spill in zip(groups, _spills_of(groups, shards, config.partitioner, TIER_PLACEMENT[config.offload.optimizer], shares)):
        if spill is not None:
            taken[spill.option] = taken.get(spill.option, 0) + _slices(group.numel, shards)[0]
    return SpillCount(taken, _share_total(groups, shards), sum(g.trainable for g in groups))


def group_buffers(
    module: nn.Module, config: Config, world_size: int, options: Any = None, *, shares: Mapping[str, float] | None = None
) -> list[list[Buffer]]:
    """Every group's per-rank buffers for ``module`` under ``config`` on ``world_size`` ranks.

    ``options``: the partitioner's validated options (built from ``config`` when
    None); ``shares``: the optimizer tier's spill fractions by option name
    (`spill_shares`; none when None).
    """
    groups, shards, frozen = _groups(module, config, world_size, options)
    partitioner = config.partitioner
    c = _DTYPE_BYTES[config.precision]
    tier, params_row = TIER_PLACEMENT[config.offload.optimizer], TIER_PLACEMENT[config.offload.params]
    out = []
    for group, spill in zip(groups, _spills_of(groups, shards, partitioner, tier, shares or {})):
        row = tier if spill is None else TIER_PLACEMENT[spill.row]
        # Placed after the first step (all but zero3's module-bound groups): a copy of the master.
        copied = spill is not None and not spill.at_adopt and (partitioner != "zero3" or group.whole)
        placement = _Placement(row, params_row, tier, copied_master=copied)
        if partitioner != "zero3":
            out.append(_whole_group(group.numel, group.params, shards, c, partitioner, placement))
        else:
            out.append(_zero3_group(group.numel, group.params, shards, c, group.trainable, group.whole, placement))
    if partitioner != "zero3":
        # Frozen parameters stay whole on every rank, outside any group.
        out += [[Buffer(Role.PARAM_FULL, p.numel * c)] for p in frozen]
    return out


def staging_pool_size(config: Config, optimizer_options: Any = None) -> int | None:
    """How many buffers the selected optimizer tier lends its host staging copies from (its
    ``staging_pool`` option), or None when it keeps one per group.

    ``optimizer_options``: the tier's validated options object, when the caller has it (else built
    from ``config``, which loads the plugins)."""
    row = TIER_PLACEMENT.get(config.offload.optimizer)
    if row is None or row.staging_pool is None:
        return None
    if optimizer_options is None:
        optimizer_options = _optimizer_tier_options(config)
    count = getattr(optimizer_options, row.staging_pool, None)
    return count if isinstance(count, int) and not isinstance(count, bool) else None


def tally(groups: Iterable[Iterable[Buffer]], config: Config, device: str, staging_pool: int | None = None) -> dict[str, dict[str, int]]:
    """`estimate`'s report from `group_buffers`' groups: bytes by category and place (``device`` named).

    ``staging_pool``: `staging_pool_size`; with it, the staging copies in host memory are that
    many buffers as large as the largest (lent per step), not one per group."""
    report: dict[str, dict[str, int]] = {c: {} for c in CATEGORIES}
    pooled: dict[str, int] = {}  # place -> the largest staging copy lent from a pool there
    # An optimizer stepping where the parameters live writes its update straight into them; one
    # whose parameters live on NVMe writes it into a buffer the params tier lends for the step.
    home = TIER_PLACEMENT[config.offload.params].where[Role.PARAM_SHARD] if config.partitioner == "zero3" else DEVICE
    params_home = device if home == DEVICE else home
    for group in groups:
        for buffer in group:
            where = device if buffer.where == DEVICE else buffer.where
            if buffer.role is Role.STAGING and params_home in (where, "nvme"):
                continue
            if buffer.role is Role.STAGING and staging_pool is not None and where == "cpu":
                pooled[where] = max(pooled.get(where, 0), buffer.nbytes)
                continue
            by_place = report[_ROLES[buffer.role][0]]
            by_place[where] = by_place.get(where, 0) + buffer.nbytes
    for where, largest in pooled.items():
        by_place = report[_ROLES[Role.STAGING][0]]
        by_place[where] = by_place.get(where, 0) + staging_pool * largest
    return report


def estimate(
    model: nn.Module | str | TransformerShape | Mapping[str, Any],
    config: Config | Mapping[str, Any] | str | os.PathLike | None = None,
    world_size: int = 1,
    *,
    device: str | None = None,
    partitioner_options: Any = None,
    optimizer_options: Any = None,
) -> dict[str, dict[str, int]]:
    """Predicted bytes one rank holds, by category (memory_report's) and by where it lives.

    ``device`` names the compute device in the result (default ``"cuda"`` when
    CUDA is available, else ``"cpu"``, as `zkernel.initialize` would pick);
    tiers add ``"cpu"`` and ``"nvme"``. ``grads`` is the peak after backward.
    ``partitioner_options``, ``optimizer_options``: the partitioner's and the
    optimizer tier's validated options objects, when the caller has them (else
    they are built from the config, which loads the plugins); the tier's
    ``gpu_share``/``host_share`` are modelled ([Note: optimizer spill]), its
    ``gpu_share`` only on a compute device other than ``"cpu"``.
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
    shares = spill_shares(cfg, device, optimizer_options)
    groups = group_buffers(as_module(model), cfg, world_size, partitioner_options, shares=shares)
    return tally(groups, cfg, device, staging_pool_size(cfg, optimizer_options))


def totals(report: Mapping[str, Mapping[str, int]]) -> dict[str, int]:
    """Bytes by place, over every category of an `estimate` (or a `memory_report`)."""
    out: dict[str, int] = {}
    for by_place in report.values():
        for where, nbytes in by_place.items():
            out[where] = out.get(where, 0) + nbytes
    return out


# -- what this machine has -----------------------------------------------------------


@attrs.frozen(kw_only=True)
class Capacity:
    """Memory of the machine the job would run on (detected, or given)."""

    gpus: int
    gpu_bytes: int | None  # per GPU; None without GPUs
    ram_bytes: int | None
    disk_bytes: int | None  # free at nvme_path, None when no path is known


def detect_capacity(nvme_path: str | os.PathLike | None = None) -> Capacity:
    """GPUs and the smallest one's total memory (torch.cuda), MemAvailable, free disk at ``nvme_path``."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpu_bytes = min(torch.cuda.get_device_properties(i).total_memory for i in range(gpus)) if gpus else None
    disk = None
    if nvme_path is not None:
        path = Path(nvme_path)
        while not path.exists() and path != path.parent:
            path = path.parent
        disk = shutil.disk_usage(path).free
    return Capacity(gpus=gpus, gpu_bytes=gpu_bytes, ram_bytes=available_host_bytes(), disk_bytes=disk)


def shortfalls(per_rank: Mapping[str, int], capacity: Capacity, ranks_per_machine: int, device: str) -> list[str]:
    """The places (``device``, ``"cpu"``, ``"nvme"``) where ``ranks_per_machine`` ranks of ``per_rank`` bytes do not fit.

    The device is per GPU; CPU memory and disk are shared by the machine's
    ranks. A place whose capacity is unknown is not judged, except that
    needing a GPU without one, or NVMe without a path, is a shortfall.
    """
    short = []
    if device != "cpu" and (capacity.gpu_bytes is None or per_rank.get(device, 0) > capacity.gpu_bytes):
        short.append(device)
    host = per_rank.get("cpu", 0) * ranks_per_machine
    if capacity.ram_bytes is not None and host > capacity.ram_bytes:
        short.append("cpu")
    disk = per_rank.get("nvme", 0) * ranks_per_machine
    if disk and (capacity.disk_bytes is None or disk > capacity.disk_bytes):
        short.append("nvme")
    return short


def offload_combinations(installed_tiers: Iterable[str], partitioner: str) -> list[tuple[str, str]]:
    """(offload.optimizer, offload.params) pairs to tabulate: tiers both installed and in `TIER_PLACEMENT`.

    Parameters are offloaded with zero3 only.
    """
    installed = set(installed_tiers)
    serving = {role: [t for t, row in TIER_PLACEMENT.items() if t in installed and role in row.serves] for role in ("optimizer", "params")}
    return [(o, p) for o in serving["optimizer"] for p in (serving["params"] if partitioner == "zero3" else ["none"])]


# -- every partitioner x offload combination ------------------------------------------


@attrs.frozen
class Row:
    """One line of ``zkernel estimate``'s table."""

    partitioner: str
    offload_optimizer: str
    offload_params: str
    report: dict[str, dict[str, int]]


def _options_for(config: Config, partitioner: str) -> dict[str, Any]:
    """The config's partitioner options that ``partitioner`` takes (each partitioner has its own)."""
    from zkernel.kernel.plugin_manager import collect_components, get_plugin_manager
    from zkernel.spec.registry import Family

    component = collect_components(get_plugin_manager(config=config)).get(Family.PARTITIONER, partitioner)
    if component is None or component.options_cls is None:
        return {}
    names = {a.name for a in attrs.fields(component.options_cls)}
    return {k: v for k, v in config.partitioner_options.items() if k in names}


def installed_tiers(config: Config) -> list[str]:
    """Names of the offload tiers the installed plugins offer."""
    from zkernel.kernel.plugin_manager import collect_components, get_plugin_manager
    from zkernel.spec.registry import Family

    return collect_components(get_plugin_manager(config=config)).names(Family.OFFLOAD_TIER)


def estimate_table(
    model: nn.Module | str | TransformerShape | Mapping[str, Any],
    config: Config | Mapping[str, Any] | str | os.PathLike | None,
    world_size: int,
    *,
    device: str,
    tiers: Iterable[str] | None = None,
) -> list[Row]:
    """`estimate` for every builtin partitioner and every offload combination of ``tiers`` (default: installed)."""
    cfg = load_config(config)
    module = as_module(model)
    tiers = installed_tiers(cfg) if tiers is None else list(tiers)
    rows = []
    for partitioner in PARTITIONERS:
        options = _options_for(cfg, partitioner)
        for optimizer_tier, params_tier in offload_combinations(tiers, partitioner):
            if "nvme" in (optimizer_tier, params_tier) and cfg.offload.nvme_path is None:
                continue  # an NVMe row needs offload.nvme_path
            # The configured tier options (its spill fractions) belong to the configured tiers only.
            offload = attrs.evolve(
                cfg.offload,
                optimizer=optimizer_tier,
                params=params_tier,
                optimizer_options=cfg.offload.optimizer_options if optimizer_tier == cfg.offload.optimizer else {},
                params_options=cfg.offload.params_options if params_tier == cfg.offload.params else {},
            )
            variant = attrs.evolve(cfg, partitioner=partitioner, partitioner_options=options, offload=offload)
            rows.append(Row(partitioner, optimizer_tier, params_tier, estimate(module, variant, world_size, device=device)))
    return rows
