"""What the engine is handed: forward inputs moved to its device and dtype, and a loss scaled twice.

[Note: a loss scaled twice] The most common porting mistake from a plain loop:
the loss divided by the accumulation steps before `Engine.backward`, which
already averages over them. Seen only where it is cheap: the loss is the
forward's own scalar output divided by (or multiplied by the inverse of)
exactly that number, a constant held on the host; `scaled_by` reads no device
value, and the engine warns once (`LossScaledTwice`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils._pytree import MappingKey, SequenceKey

from zkernel.telemetry.log import get_logger

log = get_logger()

__all__ = ["LossScaledTwice", "input_name", "prepare_input", "scaled_by"]


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


class LossScaledTwice:
    """The engine's check for a loss already divided by the accumulation steps ([Note: a loss scaled
    twice]), warned of once per engine.

    Built by `Engine.__init__` with ``gradient_accumulation_steps``; the engine calls `saw` with
    each forward's output, `check` in `Engine.backward` (where it divides the loss), and `forget`
    when a backward begins, on the training thread (`forget` also on autograd's, for a backward
    nobody announced)."""

    def __init__(self, steps: int) -> None:
        self._steps = steps
        self._output_fn: Any = None  # the last forward's scalar output's grad_fn
        self._warned = False

    def saw(self, out: Any) -> None:
        """Keep the grad_fn of a forward's scalar output (``out`` itself, or its ``loss``)."""
        loss = out if isinstance(out, torch.Tensor) else getattr(out, "loss", None)
        self._output_fn = loss.grad_fn if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None

    def forget(self) -> None:
        """Drop the kept output: its graph is gone after the backward that begins."""
        self._output_fn = None

    def check(self, loss: torch.Tensor) -> None:
        """Warn (once) where ``loss`` is the kept output divided by the accumulation steps."""
        if self._warned or not scaled_by(loss, self._output_fn, self._steps):
            return
        self._warned = True
        log.warning(
            "zkernel.backward.loss_scaled_twice",
            gradient_accumulation_steps=self._steps,
            advice="engine.backward already averages the gradients over gradient_accumulation_steps "
            "micro-batches (as DeepSpeed's engine does); pass the forward's loss without dividing it",
        )
