"""Helpers the memory tiers share for checkpoints."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch


def write_optimizer_state(
    group,
    values: Mapping[str, torch.Tensor],
    device: torch.device,
    make: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Copy ``values`` into ``group.optim_state`` in place; names not there yet (state an optimizer
    fills lazily) get new tensors on ``device`` (``make(like)`` allocates them when given)."""
    for name, value in values.items():
        held = group.optim_state.get(name)
        if isinstance(held, torch.Tensor) and held.shape == value.shape:
            held.copy_(value)
        else:
            fresh = make(value) if make is not None else torch.empty(value.shape, dtype=value.dtype, device=device)
            group.optim_state[name] = fresh.copy_(value)
