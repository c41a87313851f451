"""The library's logger (see STYLE.md 12)."""

from __future__ import annotations

import structlog


def get_logger(name: str = "zkernel"):
    """zkernel's structured logger."""
    return structlog.get_logger(name)
