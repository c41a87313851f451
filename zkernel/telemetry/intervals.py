"""Interval arithmetic on closed-open time ranges ``(start, end)`` in seconds, for the step timeline.

Pure functions over sorted lists of tuples; no clocks, no torch. `union` turns any
collection of intervals into the sorted, disjoint form the others take; `length`
measures that form; `intersection` of two disjoint forms is a linear sweep.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["Interval", "intersection", "length", "union"]

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The sorted, disjoint intervals covering exactly what ``intervals`` cover.

    Overlapping and touching intervals merge; empty ones (``end <= start``) drop out.
    """
    merged: list[Interval] = []
    for start, end in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def length(disjoint: Iterable[Interval]) -> float:
    """Total length of intervals that do not overlap (the output of `union` or `intersection`)."""
    return sum(end - start for start, end in disjoint)


def intersection(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The sorted, disjoint intervals covered by both ``a`` and ``b`` (each sorted and disjoint)."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start = max(a[i][0], b[j][0])
        end = min(a[i][1], b[j][1])
        if end > start:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out
