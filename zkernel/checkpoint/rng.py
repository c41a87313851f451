"""Random number generator states as JSON: torch CPU, CUDA (current device), Python ``random``, numpy."""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch


def _encode(state: torch.Tensor) -> str:
    return base64.b64encode(state.cpu().numpy().tobytes()).decode("ascii")


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def capture() -> dict[str, Any]:
    """This process's generator states, JSON-serialisable."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": _encode(torch.get_rng_state()),
        "cuda": _encode(torch.cuda.get_rng_state()) if torch.cuda.is_available() else None,
        "python": [version, list(internal), gauss],
        "numpy": [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
    }


def restore(states: dict[str, Any]) -> None:
    """Set this process's generators from `capture`'s result (CUDA only where both have CUDA)."""
    torch.set_rng_state(_decode(states["torch"]))
    if states.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(_decode(states["cuda"]))
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
