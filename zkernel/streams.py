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
        self.gather.wait_stream(torch.cuda.current_stream(self.gather.device))
        return torch.cuda.stream(self.gather)


def record_event(stream: Any = None) -> Any:
    """An event recorded now on ``stream`` (the current stream when None); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event
