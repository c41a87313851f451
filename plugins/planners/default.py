"""Planner ``default``: the fastest placement that fits, tried from the fastest to the slowest.

Algorithm. Everything the planner knows of a component it asks the component
through the request's sizing service (`zkernel.spec.sizing.SizingService`,
[Note: components answer for their bytes]): it names no partitioner or tier.
Placements are tried in stages, each slower than the one before and each
keeping less on the compute device (`_stages`). The partitioners tried are
those that divide something across ranks, those that divide less first (they
keep more, and communicate less). The tiers that answer for their bytes are
ranked by how far from the compute device they keep state (their
`TierSizing.level`: the device, host memory, swap files); for each level of
the optimizer's tier, fastest first: the optimizer there with the parameters
on a nearer tier, then with the parameters there too (parameters leave the
device only under a partitioner whose shards the params tier owns). With the
builtins: nothing offloaded (zero1, zero2, zero3); the optimizer on the
``cpu`` tier; the parameters on it too; the optimizer on ``nvme`` (with the
parameters on the device, then on the CPU); the parameters on ``nvme`` too.
A tier's spill fractions (the ``cpu`` tier's ``gpu_share``, the ``nvme``
tier's ``gpu_share`` and ``host_share``: `zkernel.spec.sizing.Spill`) are
sized from the device and host memory the placement leaves free, so that
only the rest of the optimizer is in its own place.

Within a stage, when the activations are known (`_activations`) and the
config does not checkpoint any module itself, the placements are tried as
they are, then with every block checkpointed, then with the checkpointed
blocks' inputs offloaded to host memory. A placement fits when, per rank,
its model states (`zkernel.estimate`), activations (an ESTIMATE), working
memory (the largest group gathered or reduced at once, plus zero3's
prefetch window) and the page-locked pools the nvme tiers stream their
swap files through fit: the device's free memory less ``device_reserve``,
the machine's host memory less 10% shared by its ranks, the disk at
``offload.nvme_path`` shared likewise. The first placement of a stage that
fits is chosen, unless it keeps model states on disk: then the stage's
placement that fits with the least on disk. A placement that fails on the
device because a layer is too large to gather gets the Linear layers
that are split into tiles small enough to gather (a partitioner that gathers
each module's own parameters at once: `PartitionSizing.gather_threshold`).

The spill fractions are sized as [Note: sizing the spill] in `_spill` says.
A candidate whose optimizer tier keeps masters split ([Note: sizing a split
master] in `zkernel.spec.sizing`) and does not fit is judged again with the
split turned off (the tier's `TierSizing.split_option` set false, unless the
config gives it): the buffers a split master is rebuilt in, as large as the
largest group, may cost more than small shares save.

[Note: one rank] On one rank nothing is communicated and nothing is divided,
so the partitioners differ only in what they keep and what they copy: zero3
keeps no compute-dtype copy beside its fp32 master, so each gather casts the
master (6 bytes an element read and written, every forward and every
recompute of every micro-batch) and each reduction copies the gradient into
its flat buffer; zero1 keeps the parameters whole in the compute dtype, 2
bytes an element more, and the step rounds into them once. The order is then
the same as over ranks, zero1 first: with the memory to spare it is the
faster, on GPT-6.7B ahead of zero3 and of the optimizer on the cpu tier alike
(BENCHMARKS.md, issue 46, goal 3, measured in one call), and zero3 is still
tried, before any checkpointing, where zero1 does not fit.

Keys the config sets are kept; offload tiers that do not answer for their
bytes, or that keep state in swap files without an ``offload.nvme_path``,
are skipped, and the plan says so.

Measured before choosing, on rank 0: host<->device copy throughput (CUDA),
disk write and read at ``offload.nvme_path``, the native CPU Adam's speed;
a rate the request gives (`PlanRequest.rates`, another machine's) is used
instead of measuring it.
They give the chosen placement's predicted seconds of host step and
transfers per optimizer step, in the decision.
"""

from __future__ import annotations

import math

import attrs
from torch import nn

from zkernel.platform.machine import RATE_NAMES, Probe, probe_copy, probe_cpu_adam, probe_disk
from zkernel.platform.sizes import format_bytes
from zkernel.spec import DEVICE, Buffer, Family, PartitionSizing, Role, TierSizing, hookimpl, totals
from zkernel.spec.options import boolean, number
from zkernel.spec.planner import Plan, PlacementError, Planner, PlanRequest
from zkernel.spec.tiers import HOST_MARGIN

from ._activations import Activations, activations_of
from ._spill import SpillSizing
from ._types import Candidate, Mode, Outcome, States

from zkernel.spec.model_shape import DTYPE_BYTES as _DTYPE_BYTES

_MAX_TILES = 64


@attrs.frozen(kw_only=True)
class DefaultPlannerOptions:
    """``[planner]`` options of the ``default`` planner."""

    # Fraction of the device's free memory left out of the plan (allocator fragmentation,
    # temporaries, the CUDA context's growth).
    device_reserve: float = attrs.field(default=0.1, validator=number(minimum=0.0))
    # Run the bandwidth probes (copy, disk, CPU Adam); false: the decision says "not measured".
    measure: bool = attrs.field(default=True, validator=boolean())

    def __attrs_post_init__(self) -> None:
        if self.device_reserve >= 1.0:
            raise ValueError(f"device_reserve must be below 1, got {self.device_reserve}")


class DefaultPlanner(Planner):
    """See the module docstring."""

    def __init__(self, context) -> None:
        self.options = context.options or DefaultPlannerOptions()

    def plan(self, request: PlanRequest) -> Plan:
        return _Planning(request, self.options).run()


class _Planning(SpillSizing):
    """One `DefaultPlanner.plan` call: the request, the budgets, and what was found."""

    def __init__(self, request: PlanRequest, options: DefaultPlannerOptions) -> None:
        if request.sizing is None or request.components is None:
            raise PlacementError(
                "the default planner sizes placements through PlanRequest.sizing and .components; "
                "this request carries none (build it as zkernel.kernel.planning.resolve_auto does)"
            )
        self.request = request
        self.sizing = request.sizing
        self.options = options
        self._layouts: dict[str, PartitionSizing | None] = {}
        self.config = config = request.config
        self.c = _DTYPE_BYTES[config.precision]
        caps = request.capacities
        self.separate = caps.device_bytes is not None  # else the compute device is the CPU
        self.label = "device" if self.separate else "cpu"
        host = None if caps.host_bytes is None else int(caps.host_bytes * (1 - HOST_MARGIN)) // caps.ranks_per_machine
        self.budgets: dict[str, int | None] = {"cpu": host}
        if self.separate:
            self.budgets["device"] = int(caps.device_bytes * (1 - options.device_reserve))
        self.budgets["nvme"] = None if caps.disk_bytes is None else caps.disk_bytes // caps.ranks_per_machine
        self.notes: list[str] = []
        self.activations, note = activations_of(request, config.planner.micro_batch)
        self.notes.append(note)
        if not self.separate:
            self.notes.append("the compute device is the CPU: model states, activations and offloaded state share host memory")
        self.usable = self._usable_tiers()
        self.measurements = self._measure()

    # -- what may be chosen ------------------------------------------------------------------

    def _layout(self, partitioner: str) -> PartitionSizing | None:
        """The partitioner's layout of the model (with the configured options it takes), or None
        when it is not installed or does not answer for its bytes."""
        if partitioner not in self._layouts:
            if self.request.components.get(Family.PARTITIONER, partitioner) is None:
                self._layouts[partitioner] = None
            else:
                variant = attrs.evolve(self.config, partitioner=partitioner, partitioner_options=self._partitioner_options(partitioner))
                self._layouts[partitioner] = self.sizing.partition(variant, self.request.world_size)
        return self._layouts[partitioner]

    def _tier(self, name: str, role: str) -> TierSizing | None:
        """Tier ``name``'s answer for ``role``, with the configured options when the config fixes it there."""
        given = getattr(self.config.offload, f"{role}_options") if self._fixed(f"offload.{role}") == name else {}
        return self.sizing.tier(name, role, given)

    def _usable_tiers(self) -> set[str]:
        usable = set()
        for tier in self.request.tiers:
            answers = [a for a in (self.sizing.tier(tier, role) for role in ("optimizer", "params")) if a is not None]
            if not answers:
                self.notes.append(f"offload tier {tier!r} skipped: it does not answer for its bytes (zkernel_size_offload_tier)")
            elif self.config.offload.nvme_path is None and any("nvme" in a.where.values() for a in answers):
                self.notes.append(f"offload tier {tier!r} skipped: no offload.nvme_path")
            else:
                usable.add(tier)
        return usable

    def _fixed(self, key: str) -> str | None:
        from zkernel.spec.config import config_value

        return None if key in self.request.auto else config_value(self.config, key)

    def _stages(self) -> list[list[tuple[str, str, str]]]:
        """Every (partitioner, offload.optimizer, offload.params) to try, in stages, fastest first
        (see the module docstring)."""
        partitioners = [
            name
            for name in self.request.components.names(Family.PARTITIONER)
            if (layout := self._layout(name)) is not None and layout.divides
        ]
        # Those that divide less come first, on one rank too ([Note: one rank]).
        partitioners.sort(key=lambda name: len(self._layout(name).divides))
        answers = {role: {t: a for t in sorted(self.usable) if (a := self.sizing.tier(t, role)) is not None} for role in ("optimizer", "params")}
        params = sorted(answers["params"], key=lambda t: answers["params"][t].level)
        stages = []
        for level in sorted({a.level for a in answers["optimizer"].values()}):
            optimizers = [t for t, a in answers["optimizer"].items() if a.level == level]
            for nearer in (True, False):
                stage = [
                    (p, o, q)
                    for o in optimizers
                    for q in params
                    if (answers["params"][q].level < level if nearer else answers["params"][q].level == level)
                    for p in partitioners
                    if answers["params"][q].level == 0 or self._layout(p).shards_params
                ]
                if stage:
                    stages.append(stage)
        return stages

    def _candidates(self) -> list[list[Candidate]]:
        fixed = {key: self._fixed(key) for key in ("partitioner", "offload.optimizer", "offload.params")}
        if fixed["partitioner"] is not None and self._layout(fixed["partitioner"]) is None:
            known = [n for n in self.request.components.names(Family.PARTITIONER) if self._layout(n) is not None]
            raise PlacementError(
                f"the default planner estimates the partitioners that answer for their bytes ({', '.join(known)}), "
                f"not partitioner {fixed['partitioner']!r}; set partitioner = 'auto' or one of those"
            )
        for key in ("offload.optimizer", "offload.params"):
            role = key.split(".")[1]
            if fixed[key] is not None and self._tier(fixed[key], role) is None:
                known = [t for t in self.request.tiers if self.sizing.tier(t, role) is not None]
                raise PlacementError(
                    f"the default planner estimates the offload tiers {', '.join(known)}, not "
                    f"{key} {fixed[key]!r}; set {key} = 'auto' or one of those"
                )
        if self.activations is None:
            modes = [Mode.AS_CONFIGURED]
        elif self.config.activation_checkpointing.modules:
            modes = [Mode.AS_CONFIGURED]
            self.notes.append("activation checkpointing as configured (counted as every block checkpointed)")
        else:
            modes = [Mode.PLAIN, Mode.CHECKPOINT, Mode.OFFLOAD]
        given = {v for v in fixed.values() if v is not None}
        seen: set[tuple[str, str, str]] = set()
        stages = []
        for placements in self._stages():
            chosen = []
            for p, o, q in placements:
                p = fixed["partitioner"] or p
                o = fixed["offload.optimizer"] or o
                q = fixed["offload.params"] or q
                if (self._tier(q, "params").level > 0 and not self._layout(p).shards_params) or (p, o, q) in seen:
                    continue
                if any(t not in self.usable and t not in given for t in (o, q)):
                    continue  # a tier the planner would choose is not usable here
                seen.add((p, o, q))
                chosen.append((p, o, q))
            if chosen:
                stages.append([Candidate(p, o, q, mode) for mode in modes for p, o, q in chosen])
        return stages

    def _disk_tiers(self, tiers) -> list[str]:
        """Those of ``tiers`` that keep state in swap files (for either role)."""
        return [
            t for t in tiers if any((a := self.sizing.tier(t, role)) is not None and "nvme" in a.where.values() for role in ("optimizer", "params"))
        ]

    # -- measurements --------------------------------------------------------------------------

    def _measure(self) -> dict[str, Probe]:
        """The rates the request gives (`PlanRequest.rates`, reason "given"), the others measured here."""
        given = {name: Probe(float(rate), "given") for name, rate in self.request.rates.items()}
        if not self.options.measure:
            off = Probe(None, "planner option measure = false")
            return {name: given.get(name, off) for name in RATE_NAMES}
        measured: dict[str, Probe] = {}
        if not {"host_to_device", "device_to_host"} <= given.keys():
            measured["host_to_device"], measured["device_to_host"] = probe_copy(self.request.device)
        if not {"disk_write", "disk_read"} <= given.keys():
            if self._disk_tiers(self.usable):
                measured["disk_write"], measured["disk_read"] = probe_disk(self.config.offload.nvme_path)
            else:
                reason = "no usable tier keeps state in swap files here"
                measured["disk_write"], measured["disk_read"] = Probe(None, reason), Probe(None, reason)
        if "cpu_adam" not in given:
            measured["cpu_adam"] = probe_cpu_adam()
        return {name: given.get(name) or measured[name] for name in RATE_NAMES}

    # -- a candidate as a config -----------------------------------------------------------------

    def _variant(self, candidate: Candidate, shares: dict[str, float] | None = None):
        """The config of ``candidate`` at spill fractions ``shares``; a tier the config fixes keeps
        the options it gives (such as ``split_master``), the fractions over them."""
        config = self.config
        given = {role: getattr(config.offload, f"{role}_options") if self._fixed(f"offload.{role}") == tier else {}
                 for role, tier in (("optimizer", candidate.optimizer), ("params", candidate.params))}  # fmt: skip
        return attrs.evolve(
            config,
            partitioner=candidate.partitioner,
            offload=attrs.evolve(
                config.offload,
                optimizer=candidate.optimizer,
                params=candidate.params,
                optimizer_options={**given["optimizer"], **dict(candidate.tier_options), **(shares or {})},
                params_options=dict(given["params"]),
            ),
            partitioner_options=self._partitioner_options(candidate.partitioner),
        )

    def _partitioner_options(self, partitioner: str) -> dict:
        """The configured partitioner options the candidate's partitioner takes (they differ by partitioner)."""
        given = dict(self.config.partitioner_options)
        component = self.request.components.get(Family.PARTITIONER, partitioner)
        if self._fixed("partitioner") == partitioner or component is None:
            return given
        names = {a.name for a in attrs.fields(component.options_cls)} if component.options_cls else set()
        return {k: v for k, v in given.items() if k in names}

    def _built_options(self, variant):
        """The candidate partitioner's validated options object (what `estimate` would build)."""
        from zkernel.spec.options import build_options

        component = self.request.components.get(Family.PARTITIONER, variant.partitioner)
        return build_options("partitioner_options", component.options_cls, variant.partitioner_options)

    # -- judging one candidate -------------------------------------------------------------------

    def _activation_bytes(self, mode: Mode) -> tuple[int, int]:
        """(on the device, in host memory) for ``mode``."""
        acts: Activations | None = self.activations
        if acts is None:
            return 0, 0
        if mode is Mode.AS_CONFIGURED:
            section = self.config.activation_checkpointing
            mode = Mode.OFFLOAD if section.offload == "cpu" else Mode.CHECKPOINT
        if mode is Mode.PLAIN:
            return acts.full, 0
        if mode is Mode.CHECKPOINT:
            return acts.checkpointed, 0
        return acts.checkpointed - acts.block_inputs, acts.block_inputs

    def _states(self, candidate: Candidate, options, shares: dict[str, float]) -> States:
        variant = self._variant(candidate, shares)
        world = self.request.world_size
        groups = self.sizing.groups(variant, world, options, shares=shares)
        largest, prefetch = self._transients(self.sizing.partition(variant, world, options))
        return States(self.sizing.tally(groups, variant, self.label), largest, prefetch, self._pools(candidate, groups))

    def _transients(self, layout: PartitionSizing) -> tuple[int, int]:
        """(largest bytes one group needs while gathered or reduced, the prefetch window), as the
        partitioner answers them."""
        answers = [layout.transient(group, self.c) for group in layout.groups]
        largest = max((a[0] for a in answers), default=0)
        return largest, min(self.config.prefetch_bytes, sum(a[1] for a in answers))

    def _pools(self, candidate: Candidate, groups: list[list[Buffer]]) -> int:
        """Page-locked host bytes the tiers stream their swap files through, as they size them
        (with the configured options where the config fixes the tier)."""
        total = 0
        for role, name in (("optimizer", candidate.optimizer), ("params", candidate.params)):
            tier = self._tier(name, role)
            if tier is None or tier.pool_bytes is None:
                continue
            files = [[b.nbytes for b in group if b.role.owner == role and b.where == "nvme"] for group in groups]
            total += tier.pool_bytes(files)
        return total

    def _need(self, candidate: Candidate, states: States, working: int) -> dict[str, dict[str, int]]:
        """Bytes per rank by place and kind: model states, the device's working memory, activations, pools."""
        need: dict[str, dict[str, int]] = {place: {"model_states": n} for place, n in totals(states.report).items()}
        need.setdefault(self.label, {"model_states": 0})
        on_device, on_host = self._activation_bytes(candidate.mode)
        need[self.label]["working"] = working
        need[self.label]["activations"] = on_device
        if on_host:
            need.setdefault("cpu", {"model_states": 0})
            need["cpu"]["activations"] = need["cpu"].get("activations", 0) + on_host
        if states.pools:
            need.setdefault("cpu", {"model_states": 0})
            need["cpu"]["swap_pools"] = states.pools
        return need

    def _outcome(self, candidate: Candidate, options, shares: dict[str, float], working: int, tiling) -> Outcome:
        """The candidate at spill fractions ``shares``, its device working memory (and tiling) known."""
        shares = self._effective(candidate, shares)
        states = self._states(candidate, options, shares)
        need = self._need(candidate, states, working)
        return Outcome(need, states.report, self._short(need), tiling, shares)

    def _judge(self, candidate: Candidate) -> Outcome:
        options = self._built_options(self._variant(candidate))
        given = self._given_shares(candidate)
        states = self._states(candidate, options, given)
        working, tiling = states.largest + states.prefetch, None
        need = self._need(candidate, states, working)
        threshold = self.sizing.partition(self._variant(candidate), self.request.world_size, options).gather_threshold
        if self.label in self._short(need) and threshold is not None and states.largest:
            found = self._tiling(threshold, need, states.prefetch)
            if found is not None:
                tiles, tiled = found
                need[self.label]["working"] = tiled
                if self.label in self._short(need):
                    need[self.label]["working"] = working
                else:
                    working, tiling = tiled, tiles
        outcome = Outcome(need, states.report, self._short(need), tiling, given)
        spills = self._sizable(candidate)
        if spills and self.label not in outcome.short:
            outcome = self._size_spills(candidate, options, outcome, spills)
        return outcome

    def _short(self, need: dict[str, dict[str, int]]) -> list[str]:
        short = []
        for place, kinds in need.items():
            total = sum(kinds.values())
            budget = self.budgets.get(place)
            if total and budget is not None and total > budget:
                short.append(place)
            elif total and budget is None and place == "nvme":
                short.append(place)
        return short

    def _tiling(self, threshold: int, need, prefetch) -> tuple[tuple[int, int], int] | None:
        """((min_numel, tiles), working bytes) that make every gathered module fit, or None.

        ``threshold``: the partitioner gathers each module's own parameters of at least this many
        elements at once (`PartitionSizing.gather_threshold`)."""
        section = self.config.tiling
        if section.modules or section.min_numel:
            return None  # tiling configured already
        budget = self.budgets[self.label]
        rest = sum(v for k, v in need[self.label].items() if k != "working")
        per_element = self.c + 4
        fit = (budget - rest - prefetch) // per_element
        if fit <= 0:
            return None
        counted: dict[int, int] = {}
        for module in self.request.model.modules():
            for p in module.parameters(recurse=False):
                counted[id(p)] = counted.get(id(p), 0) + 1
        too_large, largest_kept = [], 0
        for module in self.request.model.modules():
            own = [p for p in module.parameters(recurse=False)]
            numel = sum(p.numel() for p in own)
            if numel < threshold:
                continue
            if numel <= fit:
                largest_kept = max(largest_kept, numel)
            elif isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward and all(counted[id(p)] == 1 for p in own):
                too_large.append(module)
            else:
                return None  # not a tileable Linear (or tied): tiles cannot shrink it
        if not too_large:
            return None
        tiles = max(math.ceil(sum(p.numel() for p in m.parameters(recurse=False)) / fit) for m in too_large)
        if tiles > _MAX_TILES or any(m.out_features < tiles for m in too_large):
            return None
        min_numel = min(m.weight.numel() for m in too_large)
        per_tile = max(math.ceil(sum(p.numel() for p in m.parameters(recurse=False)) / tiles) for m in too_large)
        working = max(largest_kept, per_tile) * per_element + prefetch
        return (min_numel, tiles), working

    # -- the decision ----------------------------------------------------------------------------

    def run(self) -> Plan:
        # Per placement, the activation mode that came closest (least excess), for the decision and the error.
        rejected: dict[tuple[str, str, str], tuple[int, str]] = {}
        last: tuple[Candidate, Outcome] | None = None
        for stage in self._candidates():
            fitting: list[tuple[Candidate, Outcome]] = []
            for candidate in stage:
                outcome = self._judge(candidate)
                whole = self._whole_masters(candidate) if outcome.short else None
                if whole is not None:
                    # [Note: sizing a split master]: the rebuild buffers may cost more than the split saves.
                    whole_outcome = self._judge(whole)
                    if not whole_outcome.short:
                        candidate, outcome = whole, whole_outcome
                if not outcome.short:
                    fitting.append((candidate, outcome))
                    if not outcome.disk:
                        break  # nothing crosses the disk: no later candidate of the stage is faster
                    continue
                key = (candidate.partitioner, candidate.optimizer, candidate.params)
                excess = self._excess(outcome)
                if key not in rejected or excess < rejected[key][0]:
                    rejected[key] = (excess, f"{self._text(candidate, outcome)}: {self._shortfall(outcome)}")
                last = (candidate, outcome)
            if fitting:
                # [Note: sizing the spill]: the least on disk is fastest; ties keep the stage's order.
                candidate, outcome = min(fitting, key=lambda fit: fit[1].disk)
                plan = self._plan(candidate, outcome, [line for _, line in rejected.values()])
                first, first_outcome = fitting[0]
                if first is not candidate:
                    note = (
                        f"within the stage, {self._text(candidate, outcome)} keeps the least in swap files "
                        f"({format_bytes(outcome.disk)} per rank; {self._text(first, first_outcome)} fits with "
                        f"{format_bytes(first_outcome.disk)})"
                    )
                    plan = attrs.evolve(plan, notes=(*plan.notes, note))
                return plan
        raise self._nothing_fits([line for _, line in rejected.values()], last)

    def _whole_masters(self, candidate: Candidate) -> Candidate | None:
        """``candidate`` with its optimizer tier's split turned off (`TierSizing.split_option`), where
        it splits masters and the config does not give that option; else None."""
        tier = self._tier(candidate.optimizer, "optimizer")
        option = tier.split_option
        given = self.config.offload.optimizer_options if self._fixed("offload.optimizer") == candidate.optimizer else {}
        if option is None or option in given or candidate.tier_options:
            return None
        if not any(self._splits_master(candidate, where) for where in tier.split_master):
            return None
        return attrs.evolve(candidate, tier_options=((option, False),))

    @staticmethod
    def _text(candidate: Candidate, outcome: Outcome) -> str:
        shares = outcome.shares_text()
        return f"{candidate.text()} with {shares}" if shares else candidate.text()

    def _excess(self, outcome: Outcome) -> int:
        """Bytes over budget, summed over the places that are short (unknown disk counts fully)."""
        total = 0
        for place in outcome.short:
            need = sum(outcome.need[place].values())
            total += need - (self.budgets.get(place) or 0)
        return total

    def _shortfall(self, outcome: Outcome) -> str:
        parts = []
        for place in outcome.short:
            total = sum(outcome.need[place].values())
            budget = self.budgets.get(place)
            kinds = ", ".join(f"{k} {format_bytes(v)}" for k, v in outcome.need[place].items() if v)
            parts.append(f"{place} needs {format_bytes(total)} per rank ({kinds}), {format_bytes(budget)} usable")
        return "; ".join(parts)

    def _plan(self, candidate: Candidate, outcome: Outcome, rejected: list[str]) -> Plan:
        config = self.config
        auto = self.request.auto
        optimizer_options = {**config.offload.optimizer_options, **dict(candidate.tier_options)}
        params_options = dict(config.offload.params_options)
        notes = list(self.notes)
        for role, tier, options in (("optimizer", candidate.optimizer, optimizer_options), ("params", candidate.params, params_options)):
            component = self.request.components.get(Family.OFFLOAD_TIER, tier)
            slot = next(s for s in Family.OFFLOAD_TIER.slots if s.key == f"offload.{role}")
            if f"offload.{role}" in auto and options and component.options_for(slot) is None:
                notes.append(f"offload.{role}_options {sorted(options)} dropped: the chosen tier {tier!r} takes none")
                options.clear()
        kept = self._partitioner_options(candidate.partitioner)
        dropped = sorted(set(config.partitioner_options) - set(kept))
        if dropped:
            notes.append(f"partitioner_options {dropped} dropped: {candidate.partitioner} does not take them")
        device_spills = [s for s in self._tier(candidate.optimizer, "optimizer").spills if s.where.get(Role.MASTER) == DEVICE]
        share = sum(outcome.shares.get(s.option, 0.0) for s in device_spills)
        # A device share the tier places after the first step, where it was not sized as a spill (not
        # under a partitioner binding modules): into what that step left of the device.
        leftover = [
            s for s in device_spills if not s.at_adopt and s.option not in optimizer_options and s.option not in outcome.shares
        ]
        if leftover and "offload.optimizer" in auto and self.separate:
            share = self.leftover_gpu_share(candidate, outcome)
            if share > 0:
                optimizer_options[leftover[0].option] = share
                if leftover[0].cuda_only and self.request.device.type != "cuda":
                    notes.append(f"{leftover[0].option} takes effect on CUDA only")
        sized = {k: v for k, v in outcome.shares.items() if k not in optimizer_options}
        optimizer_options.update(sized)
        for spill in self._tier(candidate.optimizer, "optimizer").spills:
            if spill.cuda_only and sized.get(spill.option) and self.request.device.type != "cuda":
                notes.append(f"{spill.option} takes effect on CUDA only")
        if outcome.shares:
            notes.append(self._spill_note(candidate, outcome))
        for option, value in candidate.tier_options:
            notes.append(
                f"optimizer tier {candidate.optimizer!r} keeps its masters whole ({option} {str(value).lower()}): "
                "kept split, the buffers each is rebuilt in leave the placement short"
            )
        places = self._split_places(candidate, outcome)
        if places:
            words = {DEVICE: "on the GPU", "cpu": "in host memory", "nvme": "in swap files"}
            notes.append(
                f"optimizer tier {candidate.optimizer!r} keeps its fp32 masters {' and '.join(words[w] for w in places)} "
                "split: the bf16 parameter's low half and a tie bit, 2.125 bytes an element instead of 4 (its option split_master)"
            )
        checkpointing = None
        if candidate.mode in (Mode.CHECKPOINT, Mode.OFFLOAD):
            checkpointing = ((self.activations.block_class,), "cpu" if candidate.mode is Mode.OFFLOAD else "none")
        budgets = {place: b for place, b in self.budgets.items() if place != "nvme" or "nvme" in outcome.need}
        return Plan(
            planner="default",
            partitioner=candidate.partitioner,
            partitioner_options=kept,
            offload_optimizer=candidate.optimizer,
            offload_params=candidate.params,
            optimizer_options=optimizer_options,
            params_options=params_options,
            activation_checkpointing=checkpointing,
            tiling=outcome.tiling,
            bytes=outcome.need,
            budgets=budgets,
            capacities=self.request.capacities,
            measurements=self.measurements,
            predicted_seconds=self._seconds(candidate, outcome, share),
            rejected=tuple(rejected),
            notes=tuple(n for n in notes if n),
        )

    def _seconds(self, candidate: Candidate, outcome: Outcome, share: float) -> dict[str, float]:
        """Predicted seconds per optimizer step of what the placement adds, from the measured rates."""
        rate = {name: probe.rate for name, probe in self.measurements.items()}
        numel = self._trainable_numel(candidate)
        host_numel = int(numel * (1 - share))
        params_off = sum(outcome.report["params"].get(p, 0) for p in ("cpu", "nvme") if p != self.label) // self.c
        host_step = self._tier(candidate.optimizer, "optimizer").steps_on != DEVICE
        out: dict[str, float] = {}
        if host_step and rate["cpu_adam"]:
            out["host_optimizer_step"] = round(host_numel / rate["cpu_adam"], 4)
        if self.separate and rate["host_to_device"] and rate["device_to_host"]:
            down = 4 * host_numel if host_step else 0
            if host_step and self._splits_master(candidate, "cpu") and self._params_home(candidate) == DEVICE:
                # A split master in host memory is rebuilt from the parameter downloaded from the device.
                down += self.c * int(numel * self._host_fraction(candidate, outcome, share))
            up = self.c * host_numel if host_step else 0
            up += 2 * params_off * self.c  # forward and backward gathers read the shard from the host
            if up or down:
                out["host_device_transfers"] = round(up / rate["host_to_device"] + down / rate["device_to_host"], 4)
        if rate["disk_read"] and rate["disk_write"]:
            read = write = 0
            # Master and state in swap files are read and written back every step.
            swapped = sum(outcome.report[c].get("nvme", 0) for c in ("master_weights", "optimizer_state"))
            read += swapped
            write += swapped
            if self._tier(candidate.params, "params").home == "nvme":
                read += 2 * params_off * self.c
                write += params_off * self.c
            if read or write:
                out["disk"] = round(read / rate["disk_read"] + write / rate["disk_write"], 4)
        return out

    def _host_fraction(self, candidate: Candidate, outcome: Outcome, device_share: float) -> float:
        """The fraction of the trainable elements whose master the optimizer tier keeps in host memory:
        its own placement's (what ``device_share`` and the other spills leave) if that is host memory,
        and its spills' there."""
        tier = self._tier(candidate.optimizer, "optimizer")
        spilled = {s.option: s.where.get(Role.MASTER) for s in tier.spills if s.where.get(Role.MASTER) != DEVICE}
        host = sum(v for k, v in outcome.shares.items() if spilled.get(k) == "cpu")
        if tier.where.get(Role.MASTER) != "cpu":
            return host
        elsewhere = sum(v for k, v in outcome.shares.items() if k in spilled and spilled[k] != "cpu")
        return max(0.0, 1.0 - device_share - elsewhere)

    def _nothing_fits(self, rejected: list[str], last) -> PlacementError:
        model = self.request.model
        numel = sum(p.numel() for p in model.parameters())
        caps = self.request.capacities
        lines = [
            f"no placement fits: {numel:,} parameters, {self.config.precision}, {self.request.world_size} rank(s), "
            f"{caps.ranks_per_machine} per machine; usable per rank: "
            + ", ".join(f"{place} {format_bytes(b)}" for place, b in self.budgets.items())
            + f" (device: free memory less device_reserve {self.options.device_reserve:g}; cpu: available host memory "
            "less 10%, shared; nvme: free disk at offload.nvme_path, shared)"
        ]
        if rejected:
            lines.append("tried: " + " | ".join(rejected))
        else:
            lines.append("no placement could be tried with the installed tiers and the keys the config fixes")
        short = set(last[1].short) if last is not None else set()
        advice = []
        if self.label in short:
            advice.append(
                "more ranks (a partitioner dividing the parameters too keeps 1/N of the model states per rank), GPUs with more free memory"
                + (", a smaller [planner] micro_batch" if self.activations is not None else "")
            )
        if "cpu" in short or not self._disk_tiers(self.usable):
            if not self._disk_tiers(self.request.tiers):
                advice.append("more host memory, or NVMe offload: install a plugin offering a tier that keeps state in swap files")
            elif self.config.offload.nvme_path is None:
                advice.append("more host memory, or NVMe offload: set offload.nvme_path to a directory on a large disk")
            else:
                advice.append("more host memory")
        if "nvme" in short:
            advice.append(
                "an offload.nvme_path on a disk with more free space, or more GPU or host memory to keep more of "
                "the optimizer off the disk (the optimizer tier's spill fractions, such as gpu_share and host_share)"
            )
        if advice:
            lines.append("to make it fit: " + "; or ".join(advice))
        notes = [n for n in self.notes if n]
        if notes:
            lines.append("notes: " + "; ".join(notes))
        return PlacementError(". ".join(lines))


@hookimpl
def zkernel_register_planners(registry) -> None:
    registry.add(
        "default",
        DefaultPlanner,
        description="fastest placement that fits: no offload, optimizer to CPU (GPU share sized), params to CPU, "
        "then NVMe; checkpointing/tiling when activations or a layer do not fit",
        options_cls=DefaultPlannerOptions,
    )
