"""Swap-file reads and writes that never block the thread submitting them, completed as futures.

[Note: one collector] The native `AioHandle` runs many requests at once, but
a request may be collected by one caller only. A tier submits from several
threads (the main thread reads ahead, the host worker writes back, autograd's
thread reads ahead for a step started during backward) and several parties
wait for different requests, so one *reaper* thread per queue collects every
request (`AioHandle.wait_any_outcome`) and resolves the `Future` its submitter
got; callbacks added to those futures run on the reaper. Submitting never
blocks: at most ``queue_depth`` requests are handed to the engine, later ones
wait in a queue the reaper drains as requests complete. Every request is a
timeline span (its kind, from submission to completion, with its bytes) and
counts in `bytes_read` / `bytes_written`.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from concurrent.futures import Future
from typing import Any

from zkernel.platform.aio import AioHandle
from zkernel.telemetry.timeline import SpanKind, Timeline

QUEUE_DEPTH = 64


class IoQueue:
    """An `AioHandle` with a reaper thread (see [Note: one collector])."""

    def __init__(self, *, threads: int, block_size: int, timeline: Timeline, name: str) -> None:
        self._handle = AioHandle(threads=threads, block_size=block_size, queue_depth=QUEUE_DEPTH)
        self._timeline = timeline
        self._lane = f"zkernel-{name}-io"
        self._cv = threading.Condition()
        # Submitted to the engine: request id -> (future, kind, label, nbytes, write, start time).
        self._inflight: dict[int, tuple] = {}
        self._waiting: collections.deque = collections.deque()  # not yet handed to the engine
        self._resolving = 0  # taken off the books, future not resolved yet
        self._closing = False
        self.bytes_read = 0
        self.bytes_written = 0
        self._reaper = threading.Thread(target=self._reap, name=self._lane, daemon=True)
        self._reaper.start()

    # -- submission (any thread) ---------------------------------------------------------

    def read(self, buffer: Any, path: os.PathLike | str, offset: int, *, expect_crc: int, kind: SpanKind, label: str) -> Future:
        """Read ``len(buffer)`` bytes at ``offset`` and check them against ``expect_crc``; resolves to the CRC32C."""
        return self._submit(False, buffer, path, offset, expect_crc, kind, label)

    def write(self, buffer: Any, path: os.PathLike | str, offset: int, *, kind: SpanKind, label: str) -> Future:
        """Write ``buffer`` at ``offset``; resolves to the CRC32C of the bytes written."""
        return self._submit(True, buffer, path, offset, None, kind, label)

    def _submit(self, write: bool, buffer, path, offset, expect_crc, kind, label) -> Future:
        future: Future = Future()
        with self._cv:
            if self._closing:
                raise RuntimeError("the swap-file I/O queue is closed")
            self._waiting.append((future, write, buffer, os.fspath(path), offset, expect_crc, kind, label))
            self._start_waiting()
        return future

    def _start_waiting(self) -> None:
        """Hand queued requests to the engine while it has room (``_cv`` held; never blocks)."""
        started = False
        while self._waiting and len(self._inflight) < QUEUE_DEPTH:
            future, write, buffer, path, offset, expect_crc, kind, label = self._waiting.popleft()
            nbytes = buffer.numel() * buffer.element_size()
            start = time.perf_counter()
            try:
                if write:
                    request = self._handle.submit_write(buffer, path, offset, checksum=True)
                else:
                    request = self._handle.submit_read(buffer, path, offset, expect_crc=expect_crc)
            except Exception as exc:  # noqa: BLE001 - a bad argument fails this request only
                future.set_exception(exc)
                continue
            self._inflight[request] = (future, kind, label, nbytes, write, start)
            started = True
        if started:
            self._cv.notify_all()

    # -- completion (the reaper thread) ---------------------------------------------------

    def _reap(self) -> None:
        while True:
            with self._cv:
                while not self._inflight and not (self._closing and not self._waiting):
                    self._cv.wait()
                if not self._inflight:
                    return
            request, crc, error = self._handle.wait_any_outcome()  # the GIL is released while waiting
            end = time.perf_counter()
            with self._cv:
                future, kind, label, nbytes, write, start = self._inflight.pop(request)
                if error is None:
                    if write:
                        self.bytes_written += nbytes
                    else:
                        self.bytes_read += nbytes
                self._resolving += 1
                self._start_waiting()
            self._timeline.host_span(kind, start, end, label, thread=self._lane, nbytes=nbytes if error is None else 0)
            try:
                if error is None:
                    future.set_result(crc)
                else:
                    future.set_exception(error)
            finally:
                with self._cv:
                    self._resolving -= 1
                    self._cv.notify_all()
            # The reaper waits for the next request holding nothing of this one: an error raised to the
            # submitter carries its frames (an engine's), and a live local would keep them alive.
            future = error = None

    def _busy(self) -> bool:
        return bool(self._inflight or self._waiting or self._resolving)

    def wait_idle(self) -> None:
        """Block until every request submitted so far completed and its callbacks ran."""
        with self._cv:
            while self._busy():
                self._cv.wait()

    def close(self) -> None:
        """Complete what is in flight, stop the reaper and the I/O threads. Idempotent."""
        with self._cv:
            if self._closing:
                return
            self._closing = True
            self._cv.notify_all()
        self._reaper.join()
        self._handle.close()
