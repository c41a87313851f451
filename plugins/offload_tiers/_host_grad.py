"""Host-side gradient arithmetic of the host tiers: adding a micro-batch's gradient into its
landing buffer, and a landed gradient's squared norm, each through a cache-sized scratch."""

from __future__ import annotations

from typing import Any

import torch

from zkernel.telemetry.timeline import SpanKind

from ._staging import StagingPool

# Elements per fp32 piece of a widening add or a norm: it stays in the core's cache.
_WIDEN_CHUNK = 1 << 20


def accumulate(
    landing: torch.Tensor, staging: torch.Tensor, copied: Any, final: bool, pool: StagingPool, timeline
) -> float | None:
    """On the tier's accumulation thread: add a later micro-batch's gradient once its copy arrived,
    give the staging buffer back; the window's squared norm when ``final``."""
    copied.synchronize()
    with timeline.span(SpanKind.GRAD_ACCUMULATE, nbytes=staging.numel() * staging.element_size()):
        if staging.dtype == landing.dtype:
            landing.add_(staging)
        else:
            _widening_add(landing, staging)
    pool.give(staging, None)
    return sq_norm(landing) if final else None


def sq_norm(tensor: torch.Tensor) -> float:
    """Squared L2 norm of a host tensor, each fp32 piece's sum a float added in double.
    ``pow(2).sum()`` allocated a temporary as large as the gradient (fresh pages, faulted in and
    zeroed), and ``linalg.vector_norm`` sums fp32 squares without a cascade, low by a relative 1e-2
    on 67 M elements (`bench/host_accumulate.py` measures both)."""
    return sum(float(piece.mul_(piece).sum()) for _, piece in _fp32_pieces(tensor))


def _widening_add(landing: torch.Tensor, staging: torch.Tensor) -> None:
    """``landing += staging`` for a narrower ``staging`` (bf16 gradients into an fp32 buffer): torch's
    mixed-dtype add runs 4-7x slower than an fp32 one, the widened pieces at the fp32 add's rate
    (`bench/host_accumulate.py`)."""
    for start, piece in _fp32_pieces(staging):
        landing[start : start + piece.numel()].add_(piece)


def _fp32_pieces(tensor: torch.Tensor):
    """``(start, piece)`` over ``tensor``: each piece an fp32 copy of the next `_WIDEN_CHUNK` elements
    in one cache-sized scratch, valid until the next is taken."""
    scratch = torch.empty(min(_WIDEN_CHUNK, tensor.numel()), dtype=torch.float32)
    for start in range(0, tensor.numel(), _WIDEN_CHUNK):
        piece = scratch[: min(_WIDEN_CHUNK, tensor.numel() - start)]
        piece.copy_(tensor[start : start + piece.numel()])
        yield start, piece
