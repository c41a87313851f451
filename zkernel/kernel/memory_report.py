"""What `Engine.memory_report` returns: bytes by category and place, and the parameters kept whole.

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

from collections.abc import Iterable

from zkernel.spec.tiers import WholeParams


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
