"""Host-side gradient accumulation of the host tiers: the thread that adds a later micro-batch's
gradient into its landing buffer (`HostAccumulation`), the add itself, and a landed gradient's
squared norm, each through a cache-sized scratch."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from zkernel.telemetry.timeline import SpanKind

from ._staging import StagingPool

# Elements per fp32 piece of a widening add or a norm: it stays in the core's cache.
_WIDEN_CHUNK = 1 << 20


class HostAccumulation:
    """The accumulation thread of a host landing, and the page-locked buffers gradients cross in.

    With gradient accumulation on the host, a window's later micro-batch's gradient is copied
    (on the d2h stream, by `HostLanding`) into one of ``count`` staging buffers as large as the
    largest group, and added into the group's landing buffer on this object's own thread
    (`accumulate`), which then gives the buffer back. The pool is bounded, so a thread that adds
    slower than backward downloads holds back the downloads (`take` waits, and the wait is a
    timeline span) instead of page-locking a copy of every gradient.

    Threads: `expect` runs on the main thread at `adopt`; `take` and `submit` on autograd's
    thread (from `OptimizerTier.land`); the adds on the thread ``zkernel-accumulate``, started
    at the first `submit`; `close` on the main thread.
    """

    def __init__(self, count: int, dtype: torch.dtype, pin: bool | None, timeline) -> None:
        self.dtype = dtype
        self.pool = StagingPool(count, dtype, pin)  # allocated at the first accumulation
        self.timeline = timeline
        # Host adds run on their own thread: queued behind host steps on the worker, they held
        # backward's staging buffers for the whole step.
        self._thread: ThreadPoolExecutor | None = None

    def expect(self, numel: int) -> None:
        """A group of ``numel`` elements may cross through a buffer (sizes them)."""
        self.pool.expect(numel)

    def take(self, label: str, numel: int) -> torch.Tensor:
        """A free staging buffer for a later micro-batch's gradient of ``label``; the wait for one is timed."""
        buffer = self.pool.try_take(numel)
        if buffer is None:
            with self.timeline.span(SpanKind.ACCUMULATE_WAIT, label=label):
                buffer = self.pool.take(numel)
        return buffer

    def submit(self, landing: torch.Tensor, staging: torch.Tensor, copied: Any, final: bool) -> Future:
        """Add ``staging`` into ``landing`` on the accumulation thread once the event ``copied``
        completed; resolves to the window's squared norm when ``final``, else None."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zkernel-accumulate")
        return self._thread.submit(accumulate, landing, staging, copied, final, self.pool, self.timeline)

    def close(self) -> None:
        """Finish the adds queued so far, stop the thread, free the buffers."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        self.pool.close()


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
    zeroed), and ``linalg.vector_norm`` sums fp32 squares without a cascade, visibly low on tens of
    millions of elements (`bench/host_accumulate.py` measures both)."""
    return sum(float(piece.mul_(piece).sum()) for _, piece in _fp32_pieces(tensor))


def _widening_add(landing: torch.Tensor, staging: torch.Tensor) -> None:
    """``landing += staging`` for a narrower ``staging`` (bf16 gradients into an fp32 buffer): torch's
    mixed-dtype add runs several times slower than an fp32 one, the widened pieces at the fp32 add's rate
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
