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

from typing import Any

import attrs
import torch


@attrs.frozen
class Streams:
    """The side streams of one engine (None without CUDA)."""

    h2d: Any = None  # torch.cuda.Stream: host-to-device copies
    d2h: Any = None  # torch.cuda.Stream: device-to-host copies

    @classmethod
    def for_device(cls, device: torch.device) -> Streams:
        if device.type != "cuda":
            return cls()
        return cls(h2d=torch.cuda.Stream(device), d2h=torch.cuda.Stream(device))


def record_event(stream: Any = None) -> Any:
    """An event recorded now on ``stream`` (the current stream when None); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event
