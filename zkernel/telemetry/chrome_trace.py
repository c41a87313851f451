"""A Chrome trace (Trace Event Format, JSON object form) streamed to disk and published atomically.

`ChromeTraceWriter` appends complete ("X") events to a hidden temporary file
beside the target as they arrive, so a long run does not hold its trace in
memory, and `finish` closes the JSON and renames the file into place: a reader
never sees a half-written trace. Events go on named lanes (Chrome's threads);
events of one lane that overlap in time are spread over extra lanes ("h2d",
"h2d #2", ...), since a viewer draws one lane as properly nested slices.

What Perfetto and chrome://tracing need, and all this writes: a top-level object
with ``traceEvents`` (a list); every event has ``ph`` (phase), ``pid``, ``tid``
and ``name``; an "X" event adds ``ts`` and ``dur`` in microseconds (floats are
fine); "M" metadata events named ``process_name`` / ``thread_name`` with
``args.name`` label the tracks, and ``thread_sort_index`` with
``args.sort_index`` orders them. ``cat``, ``args`` (shown when a slice is
selected) and ``displayTimeUnit`` are optional.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

__all__ = ["ChromeTraceWriter"]


class _Lane:
    """The extra lanes of one named lane: (tid, end of its last event in µs) each."""

    __slots__ = ("name", "sort_index", "tracks")

    def __init__(self, name: str, sort_index: int) -> None:
        self.name = name
        self.sort_index = sort_index
        self.tracks: list[list[float]] = []  # [tid, last_end_us]


class ChromeTraceWriter:
    """Writes one process's trace to ``path``; the file appears only at `finish`.

    Not thread-safe: one owner (the timeline) calls `add` and `finish`.
    """

    def __init__(self, path: str | os.PathLike, *, pid: int, process_name: str) -> None:
        self.path = Path(path)
        self.pid = int(pid)
        self._tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self._file = open(self._tmp, "w", encoding="utf-8")  # noqa: SIM115 (closed in finish)
        except OSError as exc:
            raise type(exc)(
                exc.errno, f"cannot write the timeline trace {self.path} ({exc.strerror})", str(self._tmp)
            ) from exc
        self._lanes: dict[str, _Lane] = {}
        self._next_tid = 1
        self._first = True
        self._file.write('{"displayTimeUnit": "ms", "traceEvents": [\n')
        self._emit({"ph": "M", "pid": self.pid, "tid": 0, "name": "process_name", "args": {"name": process_name}})

    def add(self, lane: str, sort_index: int, name: str, start_us: float, dur_us: float, args: dict[str, Any]) -> None:
        """Append one complete event on ``lane`` (created on first use, ordered by ``sort_index``).

        Events of a lane are packed best when added in order of start time.
        """
        if self._file is None:
            return
        tid = self._track(lane, sort_index, start_us, start_us + dur_us)
        self._emit(
            {
                "ph": "X",
                "pid": self.pid,
                "tid": tid,
                "name": name,
                "cat": lane,
                "ts": round(start_us, 3),
                "dur": round(dur_us, 3),
                "args": args,
            }
        )

    def finish(self) -> Path | None:
        """Close the JSON and rename it to ``path`` (idempotent). Returns the path, or None if already done."""
        if self._file is None:
            return None
        file, self._file = self._file, None
        try:
            file.write("\n]}\n")
            file.flush()
            os.fsync(file.fileno())
        finally:
            file.close()
        os.replace(self._tmp, self.path)
        return self.path

    def abort(self) -> None:
        """Drop the unfinished trace and its temporary file (idempotent; also after a failed `finish`)."""
        file, self._file = self._file, None
        if file is not None:
            with contextlib.suppress(OSError):  # closing flushes, which fails again on a full disk
                file.close()
        self._tmp.unlink(missing_ok=True)

    def _track(self, lane: str, sort_index: int, start_us: float, end_us: float) -> int:
        entry = self._lanes.get(lane)
        if entry is None:
            entry = self._lanes[lane] = _Lane(lane, sort_index)
        for track in entry.tracks:
            if start_us >= track[1]:
                track[1] = max(track[1], end_us)
                return int(track[0])
        tid = self._next_tid
        self._next_tid += 1
        entry.tracks.append([tid, end_us])
        label = lane if len(entry.tracks) == 1 else f"{lane} #{len(entry.tracks)}"
        self._emit({"ph": "M", "pid": self.pid, "tid": tid, "name": "thread_name", "args": {"name": label}})
        self._emit(
            {
                "ph": "M",
                "pid": self.pid,
                "tid": tid,
                "name": "thread_sort_index",
                "args": {"sort_index": entry.sort_index * 100 + len(entry.tracks)},
            }
        )
        return tid

    def _emit(self, event: dict[str, Any]) -> None:
        assert self._file is not None
        if not self._first:
            self._file.write(",\n")
        self._first = False
        self._file.write(json.dumps(event, separators=(",", ":")))
