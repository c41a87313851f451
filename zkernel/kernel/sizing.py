"""The runtime's sizing service: the components' answers for their bytes, put together.

`Estimator` implements `zkernel.spec.sizing.SizingService` ([Note: components
answer for their bytes] there) over one installed plugin manager: it asks the
selected partitioner for its layout (``zkernel_size_partition``), the selected
tiers where the roles they own live (``zkernel_size_offload_tier``) and the
optimizer for its declared state (``zkernel_declare_optimizer``, as at
`initialize`), and tallies bytes by ``memory_report`` category and place.
`zkernel.estimate` and ``zkernel estimate`` (`zkernel.sizing.estimator`) build
on it; the kernel hands one to the planner in `PlanRequest.sizing`
(`zkernel.kernel.planning`). Nothing here knows a component by name.

[Note: optimizer spill] An optimizer tier may keep the optimizer roles of some
of its groups elsewhere (`zkernel.spec.sizing.Spill`: the cpu tier's numeric
``gpu_share``, the nvme tier's ``gpu_share`` and ``host_share``). Groups are
taken whole, in the partitioner's next-forward order (`PartitionSizing.forward_order`),
each by the first spill whose budget, ``int(fraction * total)`` elements,
still holds it; a group no budget holds stays in the tier's own placement.
``total`` is this rank's trainable elements as the tier learns them before
adopting any group (over the shards, rounded up). So a spill never takes more
than its fraction, and the own placement takes the rest; also when the
fractions add up to 1, the floors of separate budgets leave a group there
unless the first fraction is exact (the last spill then takes what is left).
A spill placed at adopt only (``at_adopt``) and only on CUDA (``cuda_only``)
takes groups only from a partitioner that binds them to modules
(`PartitionSizing.binds_modules`); one that is not placed at adopt moves
groups not bound to modules after the first step, so their fp32 master on the
device is a copy, not the partitioner's own tensor. A fraction sized at run
time (the cpu tier's ``gpu_share = "auto"``) is answered as 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from zkernel.kernel.plugin_manager import InstalledPlugins, collect_components, new_plugin_manager, resolve_components
from zkernel.platform.distributed import DistInfo
from zkernel.spec.config import Config, ConfigError
from zkernel.spec.options import build_options
from zkernel.spec.registry import Family, slot_of
from zkernel.spec.runtime import RuntimeContext
from zkernel.spec.sizing import (
    CATEGORIES,
    DEVICE,
    Buffer,
    PartitionSizing,
    Placement,
    Role,
    SizingService,
    Spill,
    SpillCount,
    TierSizing,
)

_COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Estimator(SizingService):
    """Bytes per rank of ``module`` under variants of one config, from the installed components' answers.

    One installed plugin manager serves every variant (the planner's
    candidates, the table's rows); answers are cached per partitioner,
    options and world size, and per tier, role and options.
    """

    def __init__(self, module: nn.Module, device: str, installed: InstalledPlugins, registry: Any = None) -> None:
        """``device``: the compute device's type (``"cuda"``, ``"cpu"``), which names `DEVICE` in reports."""
        self.module = module
        self.device = device
        self.installed = installed
        self.registry = registry if registry is not None else collect_components(installed)
        self._partitions: dict[Any, PartitionSizing] = {}
        self._tiers: dict[Any, TierSizing | None] = {}
        self._optimizers: dict[str, Any] = {}

    # -- the components' answers -----------------------------------------------------------------

    def partitioner_options(self, config: Config) -> Any:
        """The selected partitioner's validated options (its defaults filled in), as `initialize` builds them."""
        # [Note: resolving a component] in `zkernel.spec.registry`: the one place options are resolved.
        return self.registry.select(config, "partitioner").options

    def partition(self, config: Config, world_size: int, options: Any = None) -> PartitionSizing | None:
        options = self.partitioner_options(config) if options is None else options
        key = (config.partitioner, world_size, repr(options))
        if key not in self._partitions:
            self._partitions[key] = self.installed.pm.hook.zkernel_size_partition(
                name=config.partitioner, module=self.module, world_size=world_size, options=options
            )
        return self._partitions[key]

    def tier(self, name: str, role: str, options: Mapping[str, Any] | None = None, *, built: Any = None) -> TierSizing | None:
        """Tier ``name``'s answer for ``role``, with its options from ``options`` (or ``built``: validated)."""
        component = self.registry.get(Family.OFFLOAD_TIER, name)
        if component is None:
            return None
        family, slot = slot_of(f"offload.{role}")
        if built is None:
            # Options as `ComponentRegistry.select` validates them, without the tier's own config
            # check: an answer is asked of every installed tier, also where it could not run.
            owner, common = family.options_owner(slot)
            built = build_options(owner, component.options_for(slot), dict(options or {}), common)
        key = (name, role, repr(built))
        if key not in self._tiers:
            answer = self.installed.pm.hook.zkernel_size_offload_tier(name=name, role=role, options=built, device=self.device)
            self._tiers[key] = answer if answer is not None and answer.role == role else None
        return self._tiers[key]

    def answering_tiers(self, role: str) -> list[str]:
        """The installed tiers that answer for ``role`` (with their default options)."""
        return [name for name in self.registry.names(Family.OFFLOAD_TIER) if self.tier(name, role) is not None]

    def answering_partitioners(self) -> list[str]:
        """The installed partitioners that answer ``zkernel_size_partition`` (at world size 1, their defaults)."""
        out = []
        family, slot = slot_of("partitioner")
        owner, common = family.options_owner(slot)
        for component in self.registry.components(Family.PARTITIONER):
            options = build_options(owner, component.options_for(slot), {}, common)
            if self.installed.pm.hook.zkernel_size_partition(name=component.name, module=self.module, world_size=1, options=options) is not None:
                out.append(component.name)
        return out

    def layout(self, config: Config, world_size: int, options: Any) -> PartitionSizing:
        """The selected partitioner's layout; `ConfigError` naming those that answer when it does not."""
        layout = self.partition(config, world_size, options)
        if layout is None:
            component = self.registry.get(Family.PARTITIONER, config.partitioner)
            raise ConfigError(
                f"partitioner {config.partitioner!r} (plugin {component.plugin_name!r}) does not answer "
                "zkernel_size_partition, so its bytes cannot be estimated; partitioners that answer: "
                f"{', '.join(self.answering_partitioners())}"
            )
        return layout

    def selected_tier(self, config: Config, role: str, built: Any = None) -> TierSizing:
        """The answer of ``role``'s selected tier (``built``: its validated options, when the caller has
        them); `ConfigError` naming the tiers that answer when it does not."""
        name = getattr(config.offload, role)
        answer = self.tier(name, role, getattr(config.offload, f"{role}_options"), built=built)
        if answer is None:
            raise ConfigError(
                f"estimate has no placement for offload.{role} {name!r}; known: {', '.join(self.answering_tiers(role))} "
                "(a tier is known when its plugin answers zkernel_size_offload_tier)"
            )
        return answer

    def _state_bytes(self, config: Config, numel: int, params: int) -> int:
        """Bytes of the state the selected optimizer declares for a group of ``numel`` owned elements."""
        key = repr(config.optimizer)
        if key not in self._optimizers:
            selected = resolve_components(self.registry, config, families=[Family.OPTIMIZER])["optimizer.name"]
            dist = DistInfo(0, 1, 0, torch.device("cpu"), None)
            context = RuntimeContext(config=config, dist=dist, compute_dtype=_COMPUTE_DTYPES[config.precision])
            runtime = new_plugin_manager()
            runtime.register(selected.build(context))
            self._optimizers[key] = runtime.hook.zkernel_declare_optimizer
        declaration = self._optimizers[key](numel=numel, param_count=params)
        return 0 if declaration is None else sum(spec.nbytes for spec in declaration.state)

    # -- putting them together -------------------------------------------------------------------

    def spill_shares(self, config: Config, optimizer_options: Any = None) -> dict[str, float]:
        """The selected optimizer tier's spill fractions its options give ([Note: optimizer spill]):
        positive ones, and CUDA-only ones only on a compute device other than ``"cpu"``."""
        tier = self.selected_tier(config, "optimizer", optimizer_options)
        return {
            s.option: s.share
            for s in tier.spills
            if s.share > 0 and not (s.cuda_only and self.device == "cpu")
        }

    @staticmethod
    def _share_total(layout: PartitionSizing) -> int:
        """What the fractions are of: this rank's trainable elements as the tier is told them before
        adoption (its ``demand``), the trainable elements over the shards, rounded up."""
        return -(-sum(g.elements for g in layout.groups if g.trainable) // layout.shards)

    def _spills_of(self, layout: PartitionSizing, tier: TierSizing, shares: Mapping[str, float]) -> list[Spill | None]:
        """The spill each group's optimizer roles follow (None: the tier's own placement)."""
        groups = layout.groups
        chosen: list[Spill | None] = [None] * len(groups)
        spills = [s for s in tier.spills if shares.get(s.option, 0.0) > 0]
        if not spills:
            return chosen
        total = self._share_total(layout)
        budgets = [int(shares[s.option] * total) for s in spills]
        # Shares that sum to 1 leave nothing in the own placement: the last takes what the others did not.
        everything = sum(shares[s.option] for s in spills) >= 1.0 - 1e-9
        used = [0] * len(spills)
        for i in (i for i in layout.forward_order if groups[i].trainable):
            for k, spill in enumerate(spills):
                # Placed at adopt, a GPU share takes only groups a partitioner binds to modules.
                if spill.cuda_only and spill.at_adopt and not layout.binds_modules:
                    continue
                if groups[i].shard <= budgets[k] - used[k] or (everything and k == len(spills) - 1):
                    used[k] += groups[i].shard
                    chosen[i] = spill
                    break
        return chosen

    def groups(
        self, config: Config, world_size: int, options: Any = None, *, shares: Mapping[str, float] | None = None
    ) -> list[list[Buffer]]:
        layout = self.layout(config, world_size, options)
        c = _COMPUTE_DTYPES[config.precision].itemsize
        tier = self.selected_tier(config, "optimizer")
        params_tier = self.selected_tier(config, "params")
        out = []
        split: dict[str, int] = {}  # place -> the largest master kept split there
        for group, spill in zip(layout.groups, self._spills_of(layout, tier, shares or {})):
            # Placed after the first step (groups not bound to modules): a copy of the master.
            copied = spill is not None and not spill.at_adopt and not group.module_bound
            placement = Placement(
                optimizer=tier.where if spill is None else spill.where,
                params=params_tier.where,
                tier=tier.where,
                copied_master=copied,
                accumulation_steps=config.gradient_accumulation_steps,
                split_master=tier.split_master,
                precision=config.precision,
            )
            buffers = layout.buffers(group, placement, c)
            if group.trainable:
                buffers.append(placement.buffer(Role.OPTIMIZER_STATE, self._state_bytes(config, group.shard, group.params)))
                if c != 4 and placement.kept(Role.STAGING):
                    buffers.append(placement.buffer(Role.STAGING, group.shard * c))
                if placement.splits_master:  # rebuilt where it is in memory, else (a swap file) in host memory
                    where = placement.where(Role.MASTER)
                    where = where if where in (DEVICE, "cpu") else "cpu"
                    split[where] = max(split.get(where, 0), group.shard)
            out.append(buffers)
        params_home = params_tier.where.get(Role.PARAM_SHARD) if layout.shards_params else DEVICE
        out += [self._rebuild_buffers(split, tier.split_buffers, params_home, c)] if split else []
        return out + layout.frozen_buffers(c)

    def _rebuild_buffers(self, split: Mapping[str, int], count: int, params_home: str | None, c: int) -> list[Buffer]:
        """The buffers split masters are rebuilt into for a step ([Note: sizing a split master]):
        ``count`` fp32 ones per place of ``split`` (place -> its largest split master), as large as
        its largest; in host memory beside parameters on a separate device, as many ``c``-byte ones
        each parameter shard is downloaded into."""
        out = []
        for where, largest in split.items():
            out.append(Buffer(Role.MASTER, count * 4 * largest, where))
            if where == "cpu" and params_home == DEVICE and self.device != "cpu":
                out.append(Buffer(Role.MASTER, count * c * largest, where))
        return out

    def _shards_params(self, config: Config) -> bool:
        """Whether the selected partitioner's parameter shards are the params tier's."""
        for (name, _, _), layout in self._partitions.items():
            if name == config.partitioner and layout is not None:
                return layout.shards_params
        return self.layout(config, 1, None).shards_params

    def spill_count(self, config: Config, world_size: int, options: Any = None, *, shares: Mapping[str, float]) -> SpillCount:
        """What each spill of ``shares`` takes ([Note: optimizer spill]).

        Any fraction from ``taken / total`` up to the one given places the same
        groups: the greedy order is the same, every group taken still fits, and
        every group passed over still does not.
        """
        layout = self.layout(config, world_size, options)
        taken: dict[str, int] = {}
        for group, spill in zip(layout.groups, self._spills_of(layout, self.selected_tier(config, "optimizer"), shares)):
            if spill is not None:
                taken[spill.option] = taken.get(spill.option, 0) + group.shard
        return SpillCount(taken, self._share_total(layout), sum(g.trainable for g in layout.groups))

    def tally(
        self, groups: Iterable[Iterable[Buffer]], config: Config, device: str, staging_pool: int | None = None
    ) -> dict[str, dict[str, int]]:
        report: dict[str, dict[str, int]] = {c: {} for c in CATEGORIES}
        for role, by_place in self.tally_roles(groups, config, device, staging_pool).items():
            for where, nbytes in by_place.items():
                report[role.category][where] = report[role.category].get(where, 0) + nbytes
        return report

    def tally_roles(
        self, groups: Iterable[Iterable[Buffer]], config: Config, device: str, staging_pool: int | None = None
    ) -> dict[Role, dict[str, int]]:
        """`tally` by `Role` instead of category (the same bytes): what each kind of buffer adds where."""
        if staging_pool is None:
            # As the selected optimizer tier lends them (None there too: one copy per group).
            staging_pool = self.selected_tier(config, "optimizer").staging_pool
        report: dict[Role, dict[str, int]] = {}
        pooled: dict[str, int] = {}  # place -> the largest staging copy lent from a pool there
        params_tier = self.selected_tier(config, "params")
        shards_params = self._shards_params(config)
        # An optimizer stepping where the parameters live writes its update straight into them; a
        # params tier that lends a buffer for each update needs no staging copy either.
        home = params_tier.where.get(Role.PARAM_SHARD) if shards_params else DEVICE
        params_home = device if home == DEVICE else home
        lent = shards_params and params_tier.lends_update_buffer
        for group in groups:
            for buffer in group:
                where = device if buffer.where == DEVICE else buffer.where
                if buffer.role is Role.STAGING and (where == params_home or lent):
                    continue
                if buffer.role is Role.STAGING and staging_pool is not None and where == "cpu":
                    pooled[where] = max(pooled.get(where, 0), buffer.nbytes)
                    continue
                by_place = report.setdefault(buffer.role, {})
                by_place[where] = by_place.get(where, 0) + buffer.nbytes
        for where, largest in pooled.items():
            by_place = report.setdefault(Role.STAGING, {})
            by_place[where] = by_place.get(where, 0) + staging_pool * largest
        return report
