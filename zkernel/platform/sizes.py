"""Byte counts written the way people write them ("80GiB", "1.5TB", "512e6")."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_size(text: str) -> int:
    """Bytes from ``"80GiB"``, ``"1.5TB"``, ``"512e6"``; `ValueError` saying what is valid otherwise."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match[2].lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size; valid: a number with an optional unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    return int(float(match[1]) * _UNITS[unit])


def format_bytes(nbytes: int | None) -> str:
    """``nbytes`` in the largest binary unit that keeps it at least 1 ("1.50 GiB", "64.00 KiB", "12 B");
    ``"unknown"`` for None (a capacity nobody could read). The one byte formatter of the project."""
    if nbytes is None:
        return "unknown"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes} B"
