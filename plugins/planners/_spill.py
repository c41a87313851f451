"""Sizing the optimizer tier's spill: the fractions of its groups kept on the GPU and in host memory.

[Note: sizing the spill] A box holds what its GPUs, its RAM and its disk hold
together, and every byte of optimizer state on disk is read and written
every step (at 1-3 GB/s, against tens to hundreds of GB/s for host memory
and the GPU), so the nvme tier keeps the optimizer of the first
``gpu_share`` of the trainable elements (in module order, the next
forward's) on the GPU and of the next ``host_share`` in host memory
([Note: optimizer spill] in `zkernel.spec.sizing`; each tier declares its
spills, `zkernel.spec.sizing.Spill`). For a candidate whose
other needs fit the device, the planner, when the tier is its choice and the
config gives no fraction: gives ``gpu_share`` the
largest fraction (in thousandths) whose groups fit the device with
everything else the placement keeps there, then ``host_share`` the largest
that fits host memory likewise (the host budget is already per rank; the
optimizer pool shrinks as files leave the disk); each is judged by
estimating the placement at that fraction (groups are placed whole, the
bytes per element differ by placement), starting from the bytes per
element the largest fraction adds, then bisecting; then lowers each to the
least thousandth that places the same groups (so the next one has room).
The candidate fits if what is left fits the disk. A fraction of 0 places
nothing, so where neither has room the plan is the tier without fractions:
every master and state in swap files. Within the stage, the fitting
candidate with the least on disk wins (ties keep the order): a step moves that many bytes over the disk twice,
which costs more than checkpointing's recompute or parameters crossing
PCIe from host memory. A spill the tier places after the first step (the cpu
tier's ``gpu_share``: not ``at_adopt``) is sized the same way under a
partitioner that binds its groups to modules (zero3), whose groups the tier
places as it adopts them, so the share lowers what host memory must hold
from the first step. Under the others (zero1, zero2) the tier moves its
groups after the first step, so host memory must hold all of them first:
there the share is sized after the choice from the device memory left
(`SpillSizing.leftover_gpu_share`). Every fraction is judged in the bytes
the tier answers for, so a tier keeping its masters split ([Note: sizing a
split master] in `zkernel.spec.sizing`: the nvme tier by default in a bf16
run) gets larger fractions on the GPU and in host memory, and less on disk.
"""

from __future__ import annotations

import math

import attrs

from zkernel.platform.sizes import format_bytes
from zkernel.spec import DEVICE, Role, Spill, master_bytes, master_kept_split

from ._types import Candidate, Outcome

# Bytes per element of the optimizer a gpu_share keeps on the GPU: master, two moments, gradient
# (a split master: 1.875 less).
SHARE_BYTES = 16
# The spill fractions are sized in steps of 1/STEPS of the trainable elements.
STEPS = 1000


class SpillSizing:
    """The spill part of the default planner's `_Planning`, which it is mixed into: it uses that
    class's ``request``, ``sizing``, ``config``, ``budgets``, ``label``, ``separate``, ``_tier``,
    ``_layout``, ``_variant`` and ``_outcome``."""

    def _spills(self, candidate: Candidate) -> tuple[Spill, ...]:
        """The spills the candidate's optimizer tier declares."""
        return self._tier(candidate.optimizer, "optimizer").spills

    def _spill_options(self, candidate: Candidate) -> set[str]:
        """The spill fractions of the candidate's optimizer tier the planner counts: those placed as
        the tier adopts its groups. A spill that is not ``at_adopt`` (the cpu tier's gpu_share)
        still places groups bound to modules at adopt, so it counts under a partitioner that binds
        them (zero3); under the others it moves groups after the first step and does not lower
        what that step needs."""
        binds = self._layout(candidate.partitioner).binds_modules
        return {s.option for s in self._spills(candidate) if s.at_adopt or binds}

    def _given_shares(self, candidate: Candidate) -> dict[str, float]:
        """The counted spill fractions the config gives (numbers only), as the tier takes them here."""
        given = self.config.offload.optimizer_options
        out = {}
        for option in sorted(self._spill_options(candidate)):
            value = given.get(option)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[option] = float(value)
        return self._effective(candidate, out)

    def _effective(self, candidate: Candidate, shares: dict[str, float]) -> dict[str, float]:
        """``shares`` the tier acts on: positive, and a CUDA-only one only where the plan has a GPU."""
        cuda_only = {s.option for s in self._spills(candidate) if s.cuda_only}
        return {k: v for k, v in shares.items() if v > 0 and (self.separate or k not in cuda_only)}

    def _sizable(self, candidate: Candidate) -> list[Spill]:
        """The spills the planner sizes: the tier is its choice and the config gives no fraction."""
        if "offload.optimizer" not in self.request.auto:
            return []
        options = self._spill_options(candidate) - set(self.config.offload.optimizer_options)
        return [s for s in self._spills(candidate) if s.option in options and (self.separate or not s.cuda_only)]

    def _size_spills(self, candidate: Candidate, options, base: Outcome, spills: list[Spill]) -> Outcome:
        """``base`` with each spill in turn given the largest fraction (in 1/STEPS) that its place holds."""
        working = base.need[self.label]["working"]
        outcome = base
        for spill in spills:
            row = spill.where[Role.MASTER]
            place = self.label if row == DEVICE else row
            budget = self.budgets.get(place)
            cap = math.floor((1 - sum(outcome.shares.values())) * STEPS + 1e-9)
            if budget is None or cap <= 0 or sum(outcome.need[place].values()) > budget:
                continue
            shares = dict(outcome.shares)

            def judged(steps: int, shares=shares, option=spill.option) -> Outcome:
                return self._outcome(candidate, options, {**shares, option: steps / STEPS}, working, base.tiling)

            def fits(judged_outcome: Outcome, place=place, budget=budget) -> bool:
                return sum(judged_outcome.need[place].values()) <= budget

            whole = judged(cap)
            if fits(whole):
                outcome = self._trimmed(candidate, options, whole, spill.option)
                continue
            # The largest fraction that fits, in (0, cap): first where the bytes per element the
            # whole of it added say, then its neighbour, then bisection (groups are placed whole).
            low = sum(outcome.need[place].values())
            added = sum(whole.need[place].values()) - low
            guess = int((budget - low) / added * cap) if added > 0 else 0
            lo, hi, best = 0, cap, outcome  # fits at lo, not at hi
            probe, first = min(max(guess, 1), cap - 1), True
            while hi - lo > 1:
                tried = judged(probe)
                if fits(tried):
                    lo, best = probe, tried
                else:
                    hi = probe
                after = (probe + 1 if probe == lo else probe - 1) if first else (lo + hi) // 2
                probe, first = (after if lo < after < hi else (lo + hi) // 2), False
            outcome = self._trimmed(candidate, options, best, spill.option)
        return outcome

    def _trimmed(self, candidate: Candidate, options, outcome: Outcome, option: str) -> Outcome:
        """``outcome`` with fraction ``option`` lowered to the least step that still takes the same
        groups (from what they take up, a fraction places the same whole groups), or dropped if it
        takes none; so the next spill may take the rest. One element per group of slack: the tier
        may count its trainable elements without the groups' padding."""
        shares = dict(outcome.shares)
        variant = self._variant(candidate, shares)
        count = self.sizing.spill_count(variant, self.request.world_size, options, shares=shares)
        placed = count.taken.get(option, 0)
        if not placed:
            shares.pop(option, None)
            return attrs.evolve(outcome, shares=shares)
        least = math.ceil(placed * STEPS / count.total)
        while int(least / STEPS * (count.total - count.groups)) < placed and least < round(shares[option] * STEPS):
            least += 1
        # The fractions must not sum past 1 (rounding each up could); at exactly 1 the tier keeps
        # every group off the disk.
        room = math.floor((1 - sum(v for k, v in shares.items() if k != option)) * STEPS + 1e-9)
        shares[option] = min(least, room) / STEPS
        return attrs.evolve(outcome, shares=shares)

    def _spill_note(self, candidate: Candidate, outcome: Outcome) -> str:
        """Where the optimizer tier keeps what, in words (``outcome.shares`` are its fractions)."""
        words = {DEVICE: "on the GPU", "cpu": "in host memory", "nvme": "in swap files"}
        tier = self._tier(candidate.optimizer, "optimizer")
        parts = [f"{s.option} {outcome.shares[s.option]:g} {words[s.where[Role.MASTER]]}" for s in tier.spills if s.option in outcome.shares]
        home = tier.where[Role.MASTER]
        rest = sum(outcome.report[c].get(home, 0) for c in ("master_weights", "optimizer_state"))
        return (
            f"optimizer tier {candidate.optimizer!r} keeps the master and optimizer state of the first "
            f"trainable elements in module order: {', '.join(parts)}, the rest {words[home]} "
            f"({format_bytes(rest)} per rank)"
        )

    def _trainable_numel(self, candidate: Candidate) -> int:
        """Elements of the fp32 master one rank keeps (its shard of the trainable parameters), as the
        candidate's partitioner lays them out (a master's bytes per element vary: [Note: sizing a
        split master])."""
        return sum(g.shard for g in self._layout(candidate.partitioner).groups if g.trainable)

    def _params_home(self, candidate: Candidate) -> str:
        """Where the candidate keeps its parameter shards: the params tier's home under a partitioner
        whose shards that tier owns, else the compute device."""
        return self._tier(candidate.params, "params").home if self._layout(candidate.partitioner).shards_params else DEVICE

    def _splits_master(self, candidate: Candidate, where: str) -> bool:
        """The candidate's optimizer tier keeps the masters it places in ``where`` split ([Note: sizing
        a split master])."""
        tier = self._tier(candidate.optimizer, "optimizer")
        if (tier.split_option, False) in candidate.tier_options:
            return False
        params = {Role.PARAM_SHARD: self._params_home(candidate)}
        return master_kept_split(tier.split_master, self.config.precision, params, where)

    def _split_places(self, candidate: Candidate, outcome: Outcome) -> list[str]:
        """Where the candidate keeps masters split (its tier's own place and its spills' with a share)."""
        tier = self._tier(candidate.optimizer, "optimizer")
        places = [tier.where.get(Role.MASTER)] + [s.where.get(Role.MASTER) for s in tier.spills if outcome.shares.get(s.option)]
        return [w for w in dict.fromkeys(places) if w is not None and self._splits_master(candidate, w)]

    def leftover_gpu_share(self, candidate: Candidate, outcome: Outcome) -> float:
        """The cpu tier's gpu_share where it is not sized as a spill: what the device has left, at
        `SHARE_BYTES` per element (less what a split master saves, beside the buffer one is rebuilt
        in), in hundredths."""
        numel = self._trainable_numel(candidate)
        if not numel:
            return 0.0
        split = self._splits_master(candidate, DEVICE)
        share_bytes = SHARE_BYTES - 4 + master_bytes(numel, split) / numel
        leftover = self.budgets["device"] - sum(outcome.need["device"].values())
        if split:  # the fp32 buffer a split master is rebuilt in, as large as the largest group
            leftover -= 4 * max(g.shard for g in self._layout(candidate.partitioner).groups if g.trainable)
        fraction = min(1.0, max(0, leftover) / (share_bytes * numel))
        return math.floor(fraction * 100) / 100
