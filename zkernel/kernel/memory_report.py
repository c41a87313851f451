"""What `Engine.memory_report` returns, measured here: bytes by category and place, the parameters kept whole.

[Note: parameters kept whole] A sharding partitioner's report can show more
``params`` per rank than a shard: zero3 keeps units under its
``persistence_threshold`` whole on every rank, and holds units it gathered
ahead of the next forward (within ``prefetch_bytes``) until their use. On a
small model that is most of it, and the numbers alone read as if nothing
were sharded. So the report carries, beside its bytes, what the partitioner
says it holds whole and why (``zkernel_memory_whole``): `MemoryReport.whole`,
summed per reason, each with the config key that changes it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

from torch import nn

from zkernel.spec.groups import ParamGroup
from zkernel.spec.tiers import StoredBytes, WholeParams

__all__ = ["CATEGORIES", "MemoryReport", "measure_memory", "merge_whole"]

CATEGORIES = ("params", "grads", "master_weights", "optimizer_state")


class MemoryReport(dict):
    """``{category: {place: bytes}}`` (a plain dict to every caller), with `whole` beside it.

    ``whole``: the parameters held whole on this rank, one `WholeParams` per
    reason (``why`` and ``setting``), their counts and bytes summed over groups
    ([Note: parameters kept whole]).
    """

    def __init__(self, by_category: dict[str, dict[str, int]], whole: Iterable[WholeParams] = ()) -> None:
        super().__init__(by_category)
        self.whole: tuple[WholeParams, ...] = merge_whole(whole)

    def __reduce__(self):
        # Pickled whole (all_gather_object sends reports between ranks), with `whole`.
        return (MemoryReport, (dict(self), self.whole))

    def whole_lines(self) -> list[str]:
        """One sentence per reason, for people: ``"3 parameters (1.50 MiB) whole on this rank: <why>; set <key> to change it"``."""
        from zkernel.platform.sizes import format_bytes

        lines = []
        for entry in self.whole:
            noun = "parameter" if entry.params == 1 else "parameters"
            line = f"{entry.params} {noun} ({format_bytes(entry.nbytes)}) whole on this rank: {entry.why}"
            if entry.setting:
                line += f"; set {entry.setting} to change it"
            lines.append(line)
        return lines


def measure_memory(groups: Sequence[ParamGroup], hook, module: nn.Module) -> MemoryReport:
    """What `Engine.memory_report` returns: the tensors and swap-file regions the selected components
    name for each of ``groups`` (``hook``: the engine's runtime hooks, ``zkernel_memory_tensors``),
    plus ``module``'s parameters in no group, each storage counted once, under the first category
    that names it; and what the partitioner holds whole (``zkernel_memory_whole``)."""
    seen: set[tuple[str, int]] = set()
    report: dict[str, dict[str, int]] = {c: defaultdict(int) for c in CATEGORIES}
    contributions = [c for group in groups for c in hook.zkernel_memory_tensors(group=group) if c]
    # Parameters no group holds (frozen ones, which partitioners that keep parameters whole leave
    # in place) take device memory all the same.
    grouped = {id(p) for group in groups for p in group.params}
    contributions.append({"params": [p for p in module.parameters() if id(p) not in grouped]})
    for category in CATEGORIES:
        for contribution in contributions:
            for t in contribution.get(category, ()):
                if isinstance(t, StoredBytes):  # a swap file's region
                    key, place, nbytes = (t.place, t.key), t.place, t.nbytes
                else:
                    storage = t.untyped_storage()
                    key, place, nbytes = (str(t.device), storage.data_ptr()), str(t.device), storage.nbytes()
                if key in seen or nbytes == 0:
                    continue
                seen.add(key)
                report[category][place] += nbytes
    whole = [w for group in groups for w in hook.zkernel_memory_whole(group=group) if w]
    return MemoryReport({c: dict(v) for c, v in report.items()}, whole)


def merge_whole(entries: Iterable[WholeParams]) -> tuple[WholeParams, ...]:
    """``entries`` summed per (``why``, ``setting``), in first-seen order."""
    merged: dict[tuple[str, str | None], WholeParams] = {}
    for entry in entries:
        key = (entry.why, entry.setting)
        if key in merged:
            seen = merged[key]
            entry = WholeParams(params=seen.params + entry.params, nbytes=seen.nbytes + entry.nbytes, why=entry.why, setting=entry.setting)
        merged[key] = entry
    return tuple(merged.values())
