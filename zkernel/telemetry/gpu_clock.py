"""`GpuClock`: places completed CUDA timing events on the host's ``time.perf_counter`` scale.

Used by the step timeline so that spans timed by CUDA events (copies, kernels)
and spans timed on the host (CPU optimizer step, NVMe I/O) can be intersected in
one clock domain. It synchronises the device once, at construction, and never
again; after that it only records probe events and reads events that are
already complete.

[Note: aligning the GPU timer with perf_counter]
Offset. At construction the device is drained and an event is recorded and
waited for, bracketed by host times before ``record`` and after ``synchronize``;
on an idle device the event's timestamp falls inside the bracket, so its host
time is taken as the bracket's midpoint, wrong by at most half the bracket's
width. The narrowest of several brackets is kept (`uncertainty_s`: about 4 µs on
an H100).

Rate. The two clocks do not tick at the same rate: on three H100 machines the
GPU timer ran 9, 18 and 26 µs per second (ppm) slower than perf_counter; a fixed
offset turns 18 ppm into 1.6 ms of error after 90 s (measured) and 65 ms after an
hour. The
rate is followed without waiting for the device: every event the timeline
records itself comes with the host time just before its ``record`` call (a
*sample*), and an event can only run after it was submitted, usually within a
few microseconds (the alignment's half-width), sometimes much later (queued
behind other work on its stream; about 50 µs for the first command after the
GPU sat idle). So each sample bounds the rate from below: the slope from the
alignment point to (GPU time, submission time + `uncertainty_s`) cannot exceed
the true one. `calibrate` takes the largest bound per step and the rate is the
largest of the last `WINDOW` steps' bounds: the least delayed sample decides,
and the window lets the estimate follow a rate that wanders with temperature. A
bound more than `MAX_RATE` off (a clock jump) is ignored, and samples before
`MIN_BASELINE_S` of GPU time are not used (the alignment error would dominate
the slope). Measured on an H100 against fresh alignment brackets over 60 s of
50 ms and of 200 ms steps (GPU busy, and idle between steps): within 2.3 µs. If
every sample of a run were taken on an idle GPU, spans would land about the
wake-up latency (50 µs) early, a constant rather than a growing error
(simulated in tests/telemetry/test_timeline.py).

Precision. ``Event.elapsed_time`` returns float32 milliseconds, whose resolution
decays with the interval (0.25 ms after an hour). GPU time is therefore
accumulated in float64 from event to event: the caller moves the reference to a
recent completed event each step (`rebase`), so every ``elapsed_time`` spans
about one step.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Iterable

import torch

__all__ = ["MAX_RATE", "MIN_BASELINE_S", "WINDOW", "ClockFit", "GpuClock"]

# Steps whose least delayed sample is considered when re-estimating the rate.
WINDOW = 8
# GPU seconds since alignment before a rate is estimated.
MIN_BASELINE_S = 1.0
# Largest believable rate difference between the clocks (crystals differ by ppm, not per mille).
MAX_RATE = 1e-3
# Brackets tried at alignment; the narrowest wins.
_ALIGN_TRIES = 8


class ClockFit:
    """The model host = host0 + (1 + rate) * gpu_seconds, and its calibration from samples (pure arithmetic)."""

    def __init__(self, host0: float, uncertainty_s: float) -> None:
        self.host0 = host0  # perf_counter time of GPU second 0 (the alignment event)
        self.uncertainty_s = uncertainty_s
        self.rate = 0.0  # host seconds per GPU second, minus 1
        self._window: collections.deque[float] = collections.deque(maxlen=WINDOW)  # per step: best bound

    def host_of(self, gpu_seconds: float) -> float:
        """The ``perf_counter`` time of a GPU time under the current model."""
        return self.host0 + (1.0 + self.rate) * gpu_seconds

    def calibrate(self, samples: Iterable[tuple[float, float]]) -> None:
        """Follow the clocks' rate from one step's samples: (gpu_seconds, perf_counter just before record).

        A sample bounds the rate from below (its event ran after it was submitted); the
        fit takes the largest bound of the last `WINDOW` steps.
        """
        best = -math.inf
        for gpu, submitted in samples:
            if gpu < MIN_BASELINE_S:
                continue
            rate = (submitted + self.uncertainty_s - self.host0) / gpu - 1.0
            if abs(rate) <= MAX_RATE and rate > best:
                best = rate
        if best > -math.inf:
            self._window.append(best)
            self.rate = max(self._window)


class GpuClock:
    """Maps completed timing events of one CUDA device to ``perf_counter`` seconds.

    Owned by one timeline and used from its engine thread only, once per resolved
    step and in step order: `gpu_seconds` of the step's completed events,
    `calibrate` with the step's samples, `host_of` to convert, then `rebase` onto
    one of the step's events.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.fit = self._align()

    def _align(self) -> ClockFit:
        torch.cuda.synchronize(self.device)  # the one device-wide wait, at construction
        stream = torch.cuda.current_stream(self.device)
        ref = torch.cuda.Event(enable_timing=True)
        best: tuple[float, float] | None = None  # (half width, host time of ref)
        for i in range(_ALIGN_TRIES):
            event = ref if i == 0 else torch.cuda.Event(enable_timing=True)
            before = time.perf_counter()
            event.record(stream)
            event.synchronize()
            after = time.perf_counter()
            half = (after - before) / 2
            ref_host = before + half - ref.elapsed_time(event) / 1e3
            if best is None or half < best[0]:
                best = (half, ref_host)
        assert best is not None
        self._ref = ref
        self._ref_gpu = 0.0  # GPU seconds from the alignment event to self._ref
        return ClockFit(host0=best[1], uncertainty_s=best[0])

    @property
    def uncertainty_s(self) -> float:
        """Half-width of the alignment bracket: how far the offset may be off at the start."""
        return self.fit.uncertainty_s

    @property
    def rate(self) -> float:
        """The measured rate difference, host seconds per GPU second minus 1."""
        return self.fit.rate

    def gpu_seconds(self, event: torch.cuda.Event) -> float:
        """GPU seconds from the alignment to a completed timing event (negative if it ran before).

        Raises ``ValueError``/``RuntimeError`` (from torch) for an event never recorded or without timing.
        """
        return self._ref_gpu + self._ref.elapsed_time(event) / 1e3

    def host_of(self, gpu_seconds: float) -> float:
        """The ``perf_counter`` time of a `gpu_seconds` value under the current fit."""
        return self.fit.host_of(gpu_seconds)

    def calibrate(self, samples: Iterable[tuple[float, float]]) -> None:
        """See `ClockFit.calibrate`."""
        self.fit.calibrate(samples)

    def rebase(self, event: torch.cuda.Event, gpu_seconds: float) -> torch.cuda.Event:
        """Measure later events from ``event`` (completed; ``gpu_seconds`` its `gpu_seconds`).

        Returns the previous reference, which the caller may reuse once nothing reads it.
        The caller must not record ``event`` again while it is the reference.
        """
        old, self._ref, self._ref_gpu = self._ref, event, gpu_seconds
        return old
