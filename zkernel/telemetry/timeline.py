"""The step timeline: where each optimizer step's time goes, and how much transfer time compute hid.

The engine creates one `Timeline` per engine (enabled only when the user asks for
it) and brackets work with spans of a `SpanKind`: compute, the transfer kinds
(device-to-host, host-to-device, NVMe read/write, collectives, the parameter
stages) and the CPU optimizer step. A span is timed on the host
(`time.perf_counter`, any thread) or, when given a CUDA stream, by a pair of
timing events recorded on that stream. Once per optimizer step `end_step` closes
the step's collection; when every event of a step has completed (checked with
`Event.query`, never waited for outside `close`), the step is resolved:

1. GPU events become ``perf_counter`` seconds ([Note: one clock domain]).
2. Per kind, busy time is the length of the union of its spans; hidden time is
   the length of that union intersected with the union of COMPUTE spans; exposed
   = busy - hidden. Wall time runs from the step's first span start to its last
   span end (`summarize`, over `zkernel.telemetry.intervals`).
3. One `zkernel.step.timeline` INFO event is logged, the `StepSummary` is kept
   (the last `MAX_SUMMARIES`), and the spans are appended to the Chrome trace when
   ``trace_path`` was given; `close` waits for what is left and publishes the file.

A span belongs to the step during which it ended (was recorded on the host side),
so a span that straddles `end_step` counts towards the next step, and steps' wall
ranges may overlap. A disabled timeline returns one shared null span from every
call: no clock read, no allocation. A trace that cannot be written (disk full)
is dropped with a warning naming it; training goes on.

[Note: one clock domain]
Hidden time intersects intervals measured by two clocks: host spans with
``perf_counter`` and GPU spans with CUDA event timestamps. `GpuClock` maps the
events onto ``perf_counter``: one device synchronise at construction, then the
clocks' rate difference (9-26 ppm measured) is followed from the host time at
which each of the timeline's own events was submitted, including a probe event
that `end_step` records on an idle stream. Its [Note: aligning the GPU timer
with perf_counter] gives the accuracy: within a few microseconds (2.3 µs
measured over a minute on an H100).
GPU-vs-GPU overlap (a copy stream against the compute stream) never crosses
clocks and is as exact as the event timestamps (about half a microsecond).
"""

from __future__ import annotations

import collections
import enum
import math
import os
import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import attrs
import torch

from zkernel.telemetry import intervals
from zkernel.telemetry.chrome_trace import ChromeTraceWriter
from zkernel.telemetry.gpu_clock import GpuClock
from zkernel.telemetry.log import get_logger

log = get_logger()

__all__ = ["MAX_SUMMARIES", "SpanKind", "StepSummary", "Timeline", "summarize"]

# Resolved summaries kept on the timeline for callers (benchmarks) that read them afterwards.
MAX_SUMMARIES = 10_000


class SpanKind(str, enum.Enum):
    """What a span's time was spent on; the value is the short name used in logs and the trace."""

    COMPUTE = "compute"
    D2H = "d2h"
    H2D = "h2d"
    NVME_READ = "nvme_read"
    NVME_WRITE = "nvme_write"
    COLLECTIVE = "collective"
    CPU_STEP = "cpu_step"
    PARAM_NVME_READ = "param_nvme_read"
    PARAM_H2D = "param_h2d"
    ALL_GATHER = "all_gather"
    # The engine's thread blocked on a group's update still running on the host: the GPU
    # runs dry once its queue drains, so this is a lower bound of exposed step time.
    UPDATE_WAIT = "update_wait"
    # A later micro-batch's gradient added into its host landing buffer (host worker thread).
    GRAD_ACCUMULATE = "grad_accumulate"
    # Backward's host thread blocked for a free accumulation staging buffer (lent until its copy,
    # which waits for the GPU to produce the gradient, and the add are done): mostly the host
    # running ahead of the GPU; exposed only where the GPU's queue ran dry.
    ACCUMULATE_WAIT = "accumulate_wait"


_KIND_ORDER = {kind: i for i, kind in enumerate(SpanKind)}


def _as_kind(kind: SpanKind | str) -> SpanKind:
    if type(kind) is SpanKind:
        return kind
    try:
        return SpanKind(kind)
    except ValueError:
        valid = ", ".join(k.value for k in SpanKind)
        raise ValueError(f"unknown timeline span kind {kind!r}; valid kinds: {valid}") from None


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


@attrs.frozen(kw_only=True)
class StepSummary:
    """Where one optimizer step's time went, in seconds of one clock (the host's ``perf_counter``).

    Only kinds that had a span in the step appear in the mappings.
    """

    step: int
    # First span start to last span end.
    wall_s: float
    # Per kind: length of the union of its spans (overlapping spans of one kind count once).
    busy_s: Mapping[SpanKind, float]
    # Per kind: the part of busy_s during which some COMPUTE span ran (COMPUTE's own equals its busy_s).
    hidden_s: Mapping[SpanKind, float]
    # Per kind: bytes moved, the sum of the spans' nbytes (kinds whose spans gave none are absent).
    nbytes: Mapping[SpanKind, int]
    # Per kind: how many spans were recorded.
    count: Mapping[SpanKind, int]
    # Time some non-compute span ran while no COMPUTE span did: what the step lost to transfers and CPU work.
    exposed_total_s: float
    # Wall time covered by no span of any kind (Python overhead, waits nobody measured).
    idle_s: float

    @property
    def exposed_s(self) -> dict[SpanKind, float]:
        """Per kind: busy time not hidden behind compute (busy_s - hidden_s)."""
        return {kind: max(0.0, busy - self.hidden_s[kind]) for kind, busy in self.busy_s.items()}

    @property
    def gbps(self) -> dict[SpanKind, float]:
        """Per kind with bytes: achieved rate in GB/s (1e9 bytes) over that kind's busy time."""
        return {kind: n / self.busy_s[kind] / 1e9 for kind, n in self.nbytes.items() if self.busy_s.get(kind, 0.0) > 0}

    def log_fields(self) -> dict[str, Any]:
        """Flat fields of the ``zkernel.step.timeline`` event: ``<kind>_ms``, ``<kind>_exposed_ms``, ``<kind>_gbps``."""
        fields: dict[str, Any] = {
            "step": self.step,
            "wall_ms": _ms(self.wall_s),
            "exposed_ms": _ms(self.exposed_total_s),
            "idle_ms": _ms(self.idle_s),
        }
        exposed = self.exposed_s
        gbps = self.gbps
        for kind in sorted(self.busy_s, key=_KIND_ORDER.__getitem__):
            fields[f"{kind.value}_ms"] = _ms(self.busy_s[kind])
            if kind is not SpanKind.COMPUTE:
                fields[f"{kind.value}_exposed_ms"] = _ms(exposed[kind])
            if kind in gbps:
                fields[f"{kind.value}_gbps"] = round(gbps[kind], 2)
        return fields


def summarize(step: int, spans: Iterable[tuple[SpanKind, float, float, int]]) -> StepSummary:
    """The `StepSummary` of ``spans``: (kind, start_s, end_s, nbytes) in one clock, any order."""
    by_kind: dict[SpanKind, list[tuple[float, float]]] = collections.defaultdict(list)
    nbytes: dict[SpanKind, int] = collections.defaultdict(int)
    count: dict[SpanKind, int] = collections.defaultdict(int)
    first, last = math.inf, -math.inf
    for kind, start, end, n in spans:
        if end < start:
            end = start
        by_kind[kind].append((start, end))
        count[kind] += 1
        if n:
            nbytes[kind] += n
        if start < first:
            first = start
        if end > last:
            last = end
    if not by_kind:
        return StepSummary(
            step=step, wall_s=0.0, busy_s={}, hidden_s={}, nbytes={}, count={}, exposed_total_s=0.0, idle_s=0.0
        )
    compute = intervals.union(by_kind.get(SpanKind.COMPUTE, ()))
    busy: dict[SpanKind, float] = {}
    hidden: dict[SpanKind, float] = {}
    for kind, spans_of_kind in by_kind.items():
        merged = intervals.union(spans_of_kind)
        busy[kind] = intervals.length(merged)
        hidden[kind] = intervals.length(intervals.intersection(merged, compute))
    others = intervals.union(iv for kind, ivs in by_kind.items() if kind is not SpanKind.COMPUTE for iv in ivs)
    exposed_total = intervals.length(others) - intervals.length(intervals.intersection(others, compute))
    covered = intervals.length(intervals.union(iv for ivs in by_kind.values() for iv in ivs))
    wall = last - first
    return StepSummary(
        step=step,
        wall_s=wall,
        busy_s=busy,
        hidden_s=hidden,
        nbytes=dict(nbytes),
        count=dict(count),
        exposed_total_s=max(0.0, exposed_total),
        idle_s=max(0.0, wall - covered),
    )


class _HostRecord(NamedTuple):
    kind: SpanKind
    start: float
    end: float
    label: str
    nbytes: int
    thread: str


class _GpuRecord(NamedTuple):
    kind: SpanKind
    start: torch.cuda.Event
    end: torch.cuda.Event
    label: str
    nbytes: int
    stream: int | None  # stream id, None when the caller gave only events
    owned: bool  # events from the timeline's pool (returned after resolving) or the caller's
    # perf_counter just before each record call (owned events only): clock samples, see GpuClock.
    submitted_start: float = math.nan
    submitted_end: float = math.nan


class _Probe(NamedTuple):
    """The event `end_step` records on the timeline's probe stream, and the host time just before."""

    event: torch.cuda.Event
    submitted: float


class _PendingStep:
    """A step closed by `end_step` whose GPU events may still be running."""

    __slots__ = ("checked", "gpu", "host", "probe", "step")

    def __init__(
        self, step: int | None, host: list[_HostRecord], gpu: list[_GpuRecord], probe: _Probe | None
    ) -> None:
        self.step = step  # None: spans recorded after the last end_step, resolved by close (trace only)
        self.host = host
        self.gpu = gpu
        self.probe = probe  # the clock's probe recorded at end_step (CUDA timelines)
        self.checked = 0  # gpu[:checked] are known complete


class _NullSpan:
    """The span every call of a disabled timeline returns; shared, so entering it allocates nothing."""

    __slots__ = ()

    def __enter__(self) -> _NullSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    @property
    def nbytes(self) -> int:
        return 0

    @nbytes.setter
    def nbytes(self, value: int) -> None:
        pass


_NULL_SPAN = _NullSpan()


class _HostSpan:
    """A span timed with ``perf_counter`` on the thread that enters it."""

    __slots__ = ("_start", "_timeline", "kind", "label", "nbytes")

    def __init__(self, timeline: Timeline, kind: SpanKind, label: str, nbytes: int) -> None:
        self._timeline = timeline
        self.kind = kind
        self.label = label
        self.nbytes = nbytes  # may be set inside the block, once the size is known

    def __enter__(self) -> _HostSpan:
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        end = time.perf_counter()
        self._timeline._add_host(
            _HostRecord(self.kind, self._start, end, self.label, self.nbytes, threading.current_thread().name)
        )


class _StreamSpan:
    """A span timed by timing events recorded on a CUDA stream at enter and exit (no synchronisation)."""

    __slots__ = ("_start", "_stream", "_submitted", "_timeline", "kind", "label", "nbytes")

    def __init__(self, timeline: Timeline, kind: SpanKind, stream: torch.cuda.Stream, label: str, nbytes: int) -> None:
        self._timeline = timeline
        self._stream = stream
        self.kind = kind
        self.label = label
        self.nbytes = nbytes

    def __enter__(self) -> _StreamSpan:
        self._start = self._timeline._take_event()
        self._submitted = time.perf_counter()
        self._start.record(self._stream)
        return self

    def __exit__(self, *exc: object) -> None:
        end = self._timeline._take_event()
        submitted = time.perf_counter()
        end.record(self._stream)
        self._timeline._add_gpu(
            _GpuRecord(
                self.kind,
                self._start,
                end,
                self.label,
                self.nbytes,
                self._stream.stream_id,
                True,
                self._submitted,
                submitted,
            )
        )


class Timeline:
    """Per-step time accounting of compute and transfers; see the module docstring.

    Created by the engine (one per engine, on its compute device). ``enabled=False``
    makes every method a no-op. ``trace_path`` (optional; ``{rank}`` in it is
    replaced by ``rank``) receives a Chrome trace at `close`; ``rank`` is its pid.
    `span`, `gpu_span` and `host_span` may be called from any thread; `end_step`
    and `close` from the engine's thread.
    """

    def __init__(
        self,
        device: torch.device | str,
        *,
        enabled: bool,
        trace_path: str | os.PathLike | None = None,
        rank: int = 0,
    ) -> None:
        self.device = torch.device(device)
        self.enabled = bool(enabled)
        self.rank = int(rank)
        self._closed = not self.enabled
        self._lock = threading.Lock()
        self._host: list[_HostRecord] = []
        self._gpu: list[_GpuRecord] = []
        self._pending: collections.deque[_PendingStep] = collections.deque()
        self._summaries: collections.deque[StepSummary] = collections.deque(maxlen=MAX_SUMMARIES)
        self._free_events: list[torch.cuda.Event] = []
        self._clock: GpuClock | None = None
        self._probe_stream: torch.cuda.Stream | None = None
        self._writer: ChromeTraceWriter | None = None
        self._warned_unreadable = False
        self._cuda = self.device.type == "cuda"
        self._collective_stream: torch.cuda.Stream | None = None
        if self._cuda and not torch.cuda.is_available():
            raise ValueError(f"timeline device {self.device} is a CUDA device, but CUDA is not available")
        if not self.enabled:
            return
        if self._cuda:
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            self._clock = GpuClock(self.device)
            # High priority, otherwise idle: a probe runs soon after it is recorded.
            self._probe_stream = torch.cuda.Stream(self.device, priority=torch.cuda.Stream.priority_range()[1])
        self._t0 = time.perf_counter()
        if trace_path is not None:
            path = os.fspath(trace_path).replace("{rank}", str(self.rank))
            self._writer = ChromeTraceWriter(path, pid=self.rank, process_name=f"zkernel rank {self.rank}")
            # A timeline that is never closed still publishes what it resolved when the interpreter exits.
            self._finalizer = weakref.finalize(self, self._writer.finish)

    # -- recording (any thread) -----------------------------------------------------

    def span(
        self,
        kind: SpanKind | str,
        *,
        stream: torch.cuda.Stream | None = None,
        label: str = "",
        nbytes: int = 0,
    ):
        """A context manager timing its block as a span of ``kind``.

        Without ``stream`` (or without CUDA), host time on the calling thread. With a
        CUDA ``stream`` of the timeline's device, timing events recorded on that stream
        at enter and exit, so the span covers the work queued on it inside the block.
        The object entered has a settable ``nbytes`` for sizes known only inside.
        """
        if not self.enabled:
            return _NULL_SPAN
        kind = _as_kind(kind)
        if stream is not None and self._cuda:
            if stream.device_index != self.device.index:
                raise ValueError(
                    f"timeline span on a stream of cuda:{stream.device_index}; the timeline is on {self.device}"
                )
            return _StreamSpan(self, kind, stream, label, nbytes)
        return _HostSpan(self, kind, label, nbytes)

    def gpu_span(
        self,
        kind: SpanKind | str,
        start_event: torch.cuda.Event,
        end_event: torch.cuda.Event,
        label: str = "",
        *,
        nbytes: int = 0,
    ) -> None:
        """Record a span between two timing events the caller already recorded.

        Both must be created with ``enable_timing=True`` on the timeline's device and
        must not be recorded again until the step they belong to has been resolved
        (the next `end_step` usually; `close` at the latest): they are read lazily.
        """
        if not self.enabled:
            return
        if not self._cuda:
            raise ValueError(f"timeline gpu_span needs a CUDA timeline; this one is on {self.device}")
        self._add_gpu(_GpuRecord(_as_kind(kind), start_event, end_event, label, nbytes, None, False))

    def collective(self, work: Any, label: str = "", *, nbytes: int = 0) -> None:
        """Time an asynchronous NCCL collective just issued on the current stream as a COLLECTIVE span.

        A side stream of the timeline waits for what the collective waits for (the current
        stream), records the start, waits for the collective itself and records the end; the
        current stream's own dependencies are unchanged. Queueing behind earlier collectives
        counts as busy. Nothing happens when disabled, without CUDA, or for ``work`` None.
        """
        if not self.enabled or not self._cuda or work is None or isinstance(work, (bool, torch.cuda.Event)):
            return
        if self._collective_stream is None:
            self._collective_stream = torch.cuda.Stream(self.device)
        side = self._collective_stream
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        side.wait_stream(torch.cuda.current_stream(self.device))
        start.record(side)
        with torch.cuda.stream(side):
            work.wait()
        end.record(side)
        self.gpu_span(SpanKind.COLLECTIVE, start, end, label, nbytes=nbytes)

    def host_span(
        self,
        kind: SpanKind | str,
        start: float,
        end: float,
        label: str = "",
        thread: str | None = None,
        *,
        nbytes: int = 0,
    ) -> None:
        """Record a span measured elsewhere with ``time.perf_counter`` (seconds); ``thread`` names its lane."""
        if not self.enabled:
            return
        if end < start:
            raise ValueError(f"timeline host_span ends before it starts: start={start!r}, end={end!r}")
        name = thread if thread is not None else threading.current_thread().name
        self._add_host(_HostRecord(_as_kind(kind), float(start), float(end), label, int(nbytes), name))

    # -- per step and shutdown (engine thread) -------------------------------------

    def end_step(self, step: int) -> StepSummary | None:
        """Close step ``step``'s collection and resolve every closed step whose events are done.

        Called by the engine once per optimizer step. Never blocks on the device.
        Each resolved step is logged and kept; returns the newest summary resolved
        by this call, which on CUDA is usually an earlier step's, or None.
        """
        if not self.enabled:
            return None
        with self._lock:
            host, gpu = self._host, self._gpu
            self._host, self._gpu = [], []
        probe = None
        if self._probe_stream is not None:
            event = self._take_event()
            submitted = time.perf_counter()
            event.record(self._probe_stream)
            probe = _Probe(event, submitted)
        self._pending.append(_PendingStep(int(step), host, gpu, probe))
        return self._resolve(wait=False)

    def close(self) -> None:
        """Wait for the remaining steps' events, resolve them, write the Chrome trace, free the events.

        Idempotent. Spans recorded after the last `end_step` go to the trace only.
        Waits on each event (``Event.synchronize``), never on the whole device.
        """
        if self._closed:
            return
        with self._lock:
            self._closed = True
            self.enabled = False
            host, gpu = self._host, self._gpu
            self._host, self._gpu = [], []
        if host or gpu:
            self._pending.append(_PendingStep(None, host, gpu, None))
        try:
            self._resolve(wait=True)
        finally:
            if self._writer is not None:
                self._finalizer.detach()
                try:
                    self._writer.finish()
                except OSError as exc:
                    self._drop_trace(exc)
            self._free_events.clear()

    @property
    def clock_uncertainty_s(self) -> float:
        """How far GPU span times may be off the host clock at alignment (0 without CUDA); see `GpuClock`."""
        return 0.0 if self._clock is None else self._clock.uncertainty_s

    @property
    def summaries(self) -> tuple[StepSummary, ...]:
        """The resolved steps' summaries, oldest first (the last `MAX_SUMMARIES`)."""
        return tuple(self._summaries)

    @property
    def trace_path(self) -> os.PathLike | None:
        """Where the Chrome trace goes (after ``{rank}`` substitution), or None."""
        return None if self._writer is None else self._writer.path

    # -- internals --------------------------------------------------------------------

    def _add_host(self, record: _HostRecord) -> None:
        with self._lock:
            if not self._closed:
                self._host.append(record)

    def _add_gpu(self, record: _GpuRecord) -> None:
        with self._lock:
            if not self._closed:
                self._gpu.append(record)

    def _take_event(self) -> torch.cuda.Event:
        with self._lock:
            if self._free_events:
                return self._free_events.pop()
        return torch.cuda.Event(enable_timing=True)

    def _resolve(self, *, wait: bool) -> StepSummary | None:
        newest = None
        while self._pending:
            pending = self._pending[0]
            if not wait and not self._events_done(pending):
                break
            self._pending.popleft()
            summary = self._resolve_step(pending, wait=wait)
            if summary is not None:
                newest = summary
        return newest

    @staticmethod
    def _events_done(pending: _PendingStep) -> bool:
        if pending.probe is not None and not pending.probe.event.query():
            return False
        gpu = pending.gpu
        while pending.checked < len(gpu):
            record = gpu[pending.checked]
            if not (record.end.query() and record.start.query()):
                return False
            pending.checked += 1
        return True

    def _resolve_step(self, pending: _PendingStep, *, wait: bool) -> StepSummary | None:
        # (start, end, kind, label, nbytes, "thread" or "stream", its name or id), host seconds
        placed: list[tuple[float, float, SpanKind, str, int, str, Any]] = [
            (r.start, r.end, r.kind, r.label, r.nbytes, "thread", r.thread) for r in pending.host
        ]
        if pending.gpu or pending.probe is not None:
            self._place_gpu(pending, placed, wait=wait)
        summary = None
        if pending.step is not None:
            summary = summarize(pending.step, ((p[2], p[0], p[1], p[4]) for p in placed))
            self._summaries.append(summary)
            log.info("zkernel.step.timeline", **summary.log_fields())
        if self._writer is not None:
            try:
                self._write_trace(pending.step, summary, placed)
            except OSError as exc:
                self._drop_trace(exc)
        return summary

    def _drop_trace(self, exc: OSError) -> None:
        writer, self._writer = self._writer, None
        assert writer is not None
        self._finalizer.detach()
        writer.abort()
        log.warning("zkernel.timeline.trace_dropped", path=str(writer.path), error=str(exc))

    def _place_gpu(self, pending: _PendingStep, placed: list, *, wait: bool) -> None:
        """Put the step's GPU events on the host clock, calibrating it with them first; recycle own events."""
        clock = self._clock
        assert clock is not None
        recycle: list[torch.cuda.Event] = []
        timed: list[tuple[_GpuRecord, float, float]] = []
        samples: list[tuple[float, float]] = []
        for r in pending.gpu:
            try:
                if wait:
                    r.start.synchronize()
                    r.end.synchronize()
                gpu_start, gpu_end = clock.gpu_seconds(r.start), clock.gpu_seconds(r.end)
            except (RuntimeError, ValueError) as exc:  # never recorded, or created without enable_timing
                if not self._warned_unreadable:
                    self._warned_unreadable = True
                    log.warning("zkernel.timeline.unreadable_event", kind=r.kind.value, label=r.label, error=str(exc))
                continue
            finally:
                if r.owned:
                    recycle += (r.start, r.end)
            timed.append((r, gpu_start, gpu_end))
            if r.owned:
                samples += ((gpu_start, r.submitted_start), (gpu_end, r.submitted_end))
        probe = pending.probe
        if probe is not None:
            if wait:
                probe.event.synchronize()
            gpu_probe = clock.gpu_seconds(probe.event)
            samples.append((gpu_probe, probe.submitted))
        clock.calibrate(samples)
        for r, gpu_start, gpu_end in timed:
            start = clock.host_of(gpu_start)
            end = max(clock.host_of(gpu_end), start)
            placed.append((start, end, r.kind, r.label, r.nbytes, "stream", r.stream))
        if probe is not None:
            recycle.append(clock.rebase(probe.event, gpu_probe))
        if not self._closed:
            with self._lock:
                self._free_events.extend(recycle)

    def _write_trace(self, step: int | None, summary: StepSummary | None, placed: list) -> None:
        writer = self._writer
        assert writer is not None
        to_us = 1e6
        if summary is not None and placed:
            first = min(p[0] for p in placed)
            writer.add("step", -1, f"step {step}", (first - self._t0) * to_us, summary.wall_s * to_us, summary.log_fields())
        for start, end, kind, label, nbytes, where, name in sorted(placed, key=lambda p: p[0]):
            args: dict[str, Any] = {} if name is None else {where: name}
            if step is not None:
                args["step"] = step
            if nbytes:
                args["bytes"] = nbytes
            title = f"{kind.value} {label}" if label else kind.value
            writer.add(kind.value, _KIND_ORDER[kind], title, (start - self._t0) * to_us, (end - start) * to_us, args)
