"""Plain-text tables for the command line (``zkernel plugins``, ``zkernel estimate``)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["text_table"]


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """``header`` and ``rows`` as left-aligned columns two spaces apart, one line a row."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        cells = [str(c).ljust(w) for c, w in zip(row, widths)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
