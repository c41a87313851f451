"""What the engine is handed: forward inputs moved to its device and dtype, and a loss scaled twice.

[Note: a loss scaled twice] The most common porting mistake from a plain loop:
the loss divided by the accumulation steps before `Engine.backward`, which
already averages over them. Seen only where it is cheap: the loss is the
forward's own scalar output divided by (or multiplied by the inverse of)
exactly that number, a constant held on the host; `scaled_by` reads no device
value, and the engine warns once.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils._pytree import MappingKey, SequenceKey

__all__ = ["input_name", "prepare_input", "scaled_by"]


def prepare_input(value: Any, device: torch.device, compute_dtype: torch.dtype, where: str = "an input") -> Any:
    """A tensor input on ``device`` (floating point in ``compute_dtype``); anything else as it is.
    A meta tensor, which holds no values, is a `ValueError` naming ``where`` it was passed."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.is_meta:
        raise ValueError(
            f"{where} of the engine's forward is a meta-device tensor (shape {tuple(value.shape)}, "
            f"{value.dtype}), which holds no values: inputs must be real tensors (on the CPU or "
            f"{device}); build them outside a `with torch.device('meta')` block"
        )
    if value.is_floating_point() and value.dtype != compute_dtype:
        return value.to(device=device, dtype=compute_dtype)
    return value.to(device)


def input_name(path) -> str:
    """``path`` into ``(args, kwargs)`` as the caller wrote it: "argument 0", "argument 'mask'", "argument 1[2]"."""
    if not path:
        return "an input"
    head, *rest = path
    first = path[1] if len(path) > 1 else None
    if isinstance(head, SequenceKey) and head.idx == 0 and isinstance(first, SequenceKey):
        name = f"argument {first.idx}"
    elif isinstance(head, SequenceKey) and head.idx == 1 and isinstance(first, MappingKey):
        name = f"argument {first.key!r}"
    else:
        return "an input"
    return name + "".join(str(k) for k in rest[1:])


def scaled_by(loss: torch.Tensor, output_fn: Any, steps: int) -> bool:
    """Whether ``loss`` is the forward's scalar output (``output_fn``: its grad_fn) divided by
    ``steps`` or multiplied by ``1 / steps`` ([Note: a loss scaled twice])."""
    fn = loss.grad_fn
    if output_fn is None or fn is None or fn.name() not in ("DivBackward0", "MulBackward0"):
        return False
    if not fn.next_functions or fn.next_functions[0][0] is not output_fn:
        return False
    other = getattr(fn, "_saved_other", None)
    if not isinstance(other, torch.Tensor) or other.numel() != 1 or other.device.type != "cpu":
        return False
    expected = steps if fn.name() == "DivBackward0" else 1.0 / steps
    return math.isclose(float(other), expected, rel_tol=1e-6)
