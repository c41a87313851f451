"""The side streams of one engine: where transfers run so that they overlap compute.

[Note: streams and events] Compute runs on the stream that is current when the
user calls the engine. Host-to-device uploads and device-to-host downloads run
on their own streams, created once per engine; collectives run on the process
group's own streams (NCCL) or threads (gloo). Work crosses streams only through
events (``wait_event``/``wait_stream`` and the ``work.wait()`` of a collective,
which on NCCL is a stream dependency, not a host wait), never a device-wide
synchronize. A tensor produced on one stream and freed after use on another is
marked with ``record_stream`` so the caching allocator does not hand its memory
out again before that use completes. Without CUDA every stream is None and the
same code runs in program order.
"""

from __future__ import annotations

import contextlib
from typing import Any

import attrs
import torch


@attrs.frozen
class Streams:
    """The side streams of one engine (None without CUDA)."""

    h2d: Any = None  # torch.cuda.Stream: host-to-device copies
    d2h: Any = None  # torch.cuda.Stream: device-to-host copies
    gather: Any = None  # torch.cuda.Stream: prefetched gathers and the uploads they wait for
    # Offloaded activations, out and back (see [Note: activation streams]).
    activation_h2d: Any = None
    activation_d2h: Any = None

    @classmethod
    def for_device(cls, device: torch.device) -> Streams:
        """[Note: activation streams] Saved activations move on streams of their own. Backward
        waits for each one's return, so those copies are on the compute stream's critical path,
        while parameter uploads and gradient downloads have slack (an update is needed only by
        the next forward). On one FIFO stream a restore queued behind a host step's uploads
        (gigabytes per step with an offloaded optimizer) waits for all of them; on its own
        stream it shares the link with them instead.
        """
        if device.type != "cuda":
            return cls()
        return cls(
            h2d=torch.cuda.Stream(device),
            d2h=torch.cuda.Stream(device),
            gather=torch.cuda.Stream(device),
            activation_h2d=torch.cuda.Stream(device),
            activation_d2h=torch.cuda.Stream(device),
        )

    def prefetch_context(self):
        """Run a prefetch on the gather stream, after the compute work queued so far.

        A prefetched gather then waits for its shard's upload on this stream, not on the
        compute stream, so compute goes on meanwhile; its output buffer, allocated in the
        compute stream's order, is not written before compute is done with its last use.
        """
        if self.gather is None:
            return contextlib.nullcontext()
        self.gather.wait_stream(torch.cuda.current_stream(self.gather.device_index))
        return use_stream(self.gather)


# [Note: stream calls on the hot path] With one unit per module a step makes ~1,000 stream
# lookups and switches (every gather, reduction and event). torch's ``current_stream()`` without
# a device, ``torch.cuda.stream(...)`` and ``is_available()`` each run several Python frames and
# environment lookups per call; the helpers below ask for the same things by device index, at
# about half the cost (`bench/stream_calls.py`).

_cuda_available: bool | None = None


def cuda_available() -> bool:
    """``torch.cuda.is_available()``, asked once per process."""
    global _cuda_available
    if _cuda_available is None:
        _cuda_available = torch.cuda.is_available()
    return _cuda_available


def current_stream(device: torch.device | None = None) -> Any:
    """The current CUDA stream of ``device`` (of the current device when None or without an index)."""
    index = device.index if device is not None else None
    return torch.cuda.current_stream(torch.cuda.current_device() if index is None else index)


def use_stream(stream: Any) -> Any:
    """``with use_stream(stream):`` makes ``stream`` current for the block, as ``torch.cuda.stream``
    does, in fewer calls for a stream of the current device (see [Note: stream calls on the hot path])."""
    if stream.device_index != torch.cuda.current_device():
        return torch.cuda.stream(stream)  # which also makes its device current for the block
    return _CurrentDeviceStream(stream)


class _CurrentDeviceStream:
    __slots__ = ("stream", "previous")

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.previous = None

    def __enter__(self) -> None:
        self.previous = torch.cuda.current_stream(self.stream.device_index)
        torch.cuda.set_stream(self.stream)

    def __exit__(self, *_exc) -> None:
        torch.cuda.set_stream(self.previous)


def record_event(stream: Any = None) -> Any:
    """An event recorded now on ``stream`` (the current stream when None); None without CUDA."""
    if not cuda_available():
        return None
    event = torch.cuda.Event()
    event.record(stream if stream is not None else current_stream())
    return event
