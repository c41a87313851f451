"""Saved inputs of checkpointed regions moved to host memory, and brought back ahead of their backward.

[Note: saved-input offload] A non-reentrant ``torch.utils.checkpoint`` region
keeps only its inputs for backward, and it saves them through the
saved-tensor hooks active around the ``checkpoint`` call (inside the region
its own hooks take over and keep nothing). `SavedInputOffloader.region`
installs hooks there, so for each region:

* pack (when the region starts, on the forward's stream): copy each input
  into a fresh host tensor (page-locked where CUDA is available) on the
  engine's activation device-to-host stream ([Note: activation streams] in
  `zkernel.platform.streams`), after the work that produced it; the device tensor is
  marked as used by that stream, so the caching allocator hands its memory
  out again only after the copy, and the offloader keeps no reference to it:
  once the forward drops it, its memory is free.
* unpack (in backward, when the region's recomputation begins): first start
  bringing back the ``prefetch`` regions that ran just before this one in
  the forward (the order backward visits them next), then wait for this
  region's own copies (started by an earlier prefetch, else now). Copies in
  run on the activation host-to-device stream into memory allocated on the
  compute stream, after the compute stream's work so far; the compute stream
  waits on the copy's event before it reads, never the host.

So the compute device holds one region's inputs being recomputed plus
``prefetch`` regions arriving, instead of every region's. Tensors that are
parameters, empty, or not on the compute device are kept as they are.

[Note: shared inputs] A tensor every region receives (an attention mask,
rotary tables, a scalar made once per forward) is alive on the device for the
whole forward anyway, and offloading it per region would copy it out and back
once per region. So only the first region that saves it offloads it; a later
region that saves the very same tensor (same storage, view and version, its
first saver's reference still alive) keeps it as it is.
Without CUDA every copy is a plain copy in program order (the host is the
compute device then; the copies are still made, which keeps the behaviour
the same and observable, but buy nothing).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import itertools
import weakref
from collections.abc import Iterator
from typing import Any

import attrs
import torch
from torch import nn

from zkernel.spec.config import ConfigError
from zkernel.telemetry.profiling import profiler_range
from zkernel.platform.streams import record_event



class RegionState(enum.Enum):
    """Where a region's saved inputs are."""

    ON_HOST = "on host"  # copied out (or being copied out)
    ARRIVING = "arriving"  # copies back to the device started
    TAKEN = "taken"  # every input handed back to autograd


@attrs.define(eq=False)
class OffloadStats:
    """What the offloader did, for tests and reports."""

    regions: int = 0
    offloaded_tensors: int = 0
    offloaded_bytes: int = 0
    pinned_tensors: int = 0
    kept_tensors: int = 0  # saved as they are (parameters, empty, already off the device)
    restored_tensors: int = 0
    prefetched_regions: int = 0
    # Device copies the offloader brought back that are still alive, and the most at once.
    resident: int = 0
    max_resident: int = 0
    # (event, region sequence number) in the order they happened: "pack", "prefetch", "restore".
    events: list = attrs.field(factory=list)


@attrs.define(eq=False)
class _Saved:
    """What pack returns for one offloaded tensor: the region it belongs to and its host copy."""

    region: _Region
    host: torch.Tensor | None
    d2h_event: Any = None
    device_copy: torch.Tensor | None = None
    h2d_event: Any = None


@attrs.define(eq=False)
class _Region:
    """One checkpointed call's saved inputs (weakly: autograd owns the `_Saved` objects)."""

    seq: int
    items: list = attrs.field(factory=list)  # weakref.ref(_Saved)
    state: RegionState = RegionState.ON_HOST

    def alive(self) -> Iterator[_Saved]:
        for ref in self.items:
            saved = ref()
            if saved is not None:
                yield saved


class SavedInputOffloader:
    """Saved-tensor hooks that keep checkpointed regions' inputs on the host (see [Note: saved-input offload])."""

    def __init__(self, device: torch.device, streams, *, prefetch: int, pin_memory: bool | None, record_events: bool = False) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.d2h = streams.activation_d2h if self.cuda else None
        self.h2d = streams.activation_h2d if self.cuda else None
        self.prefetch = prefetch
        if pin_memory and not torch.cuda.is_available():
            raise ConfigError("activation_checkpointing.pin_memory = true needs CUDA (page-locked memory); valid here: false or unset")
        self.pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.record_events = record_events
        self.stats = OffloadStats()
        self._seq = itertools.count()
        # Regions by sequence number (forward order); entries vanish with their region.
        self._regions: weakref.WeakValueDictionary[int, _Region] = weakref.WeakValueDictionary()
        # Tensors saved by some region, to recognise one every region saves (a mask, say).
        self._seen: dict[tuple, tuple[weakref.ref, int]] = {}

    @contextlib.contextmanager
    def region(self):
        """Offload the tensors saved inside this block: one checkpointed call's inputs."""
        region = _Region(next(self._seq))
        self._regions[region.seq] = region
        self.stats.regions += 1
        with torch.autograd.graph.saved_tensors_hooks(functools.partial(self._pack, region), self._unpack):
            yield

    # -- forward ------------------------------------------------------------------------

    def _offloadable(self, tensor: torch.Tensor) -> bool:
        return (
            not isinstance(tensor, nn.Parameter)
            and tensor.numel() > 0
            and tensor.device.type == self.device.type
            and (self.device.index is None or tensor.device.index == self.device.index)
            and not tensor.is_sparse
        )

    def _shared(self, tensor: torch.Tensor) -> bool:
        """Whether an earlier region saved this very tensor too (see [Note: shared inputs])."""
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        seen = self._seen.get(key)
        if seen is not None and seen[0]() is not None and seen[1] == tensor._version:
            return True
        if len(self._seen) > 4096:
            self._seen = {k: v for k, v in self._seen.items() if v[0]() is not None}
        self._seen[key] = (weakref.ref(tensor), tensor._version)
        return False

    def _pack(self, region: _Region, tensor: torch.Tensor) -> Any:
        if not self._offloadable(tensor) or self._shared(tensor):
            self.stats.kept_tensors += 1
            return tensor
        with torch.no_grad(), profiler_range("zkernel::activation_offload"):
            source = tensor.detach()
            host = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=self.pin)
            if self.cuda:
                self.d2h.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.d2h):
                    host.copy_(source, non_blocking=True)
                source.record_stream(self.d2h)
                event = record_event(self.d2h)
            else:
                host.copy_(source)
                event = None
        saved = _Saved(region, host, d2h_event=event)
        region.items.append(weakref.ref(saved))
        stats = self.stats
        stats.offloaded_tensors += 1
        stats.offloaded_bytes += host.numel() * host.element_size()
        stats.pinned_tensors += int(host.is_pinned()) if self.pin else 0
        self._event("pack", region)
        return saved

    # -- backward -----------------------------------------------------------------------

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        region = packed.region
        self._prefetch_before(region)
        if packed.device_copy is None:
            self._bring_back(region)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(packed.h2d_event)
        tensor, packed.device_copy, packed.host = packed.device_copy, None, None
        self.stats.restored_tensors += 1
        self._event("restore", region)
        if not any(s.device_copy is not None or s.host is not None for s in region.alive()):
            region.state = RegionState.TAKEN
        return tensor

    def _prefetch_before(self, region: _Region) -> None:
        if self.prefetch <= 0:
            return
        earlier = sorted((s for s in list(self._regions.keys()) if s < region.seq), reverse=True)
        for seq in earlier[: self.prefetch]:
            other = self._regions.get(seq)
            if other is not None and other.state is RegionState.ON_HOST:
                self._bring_back(other)
                self.stats.prefetched_regions += 1
                self._event("prefetch", other)

    def _bring_back(self, region: _Region) -> None:
        """Start copying every input of ``region`` still on the host back to the device."""
        region.state = RegionState.ARRIVING
        pending = [s for s in region.alive() if s.host is not None and s.device_copy is None]
        if not pending:
            return
        with profiler_range("zkernel::activation_restore"):
            copies, event = self._copy_in(pending)
        for saved, copy in zip(pending, copies):
            saved.device_copy, saved.h2d_event = copy, event
            self._count_resident(copy)

    def _copy_in(self, pending: list[_Saved]) -> tuple[list[torch.Tensor], Any]:
        """Device copies of ``pending``'s host tensors, and the event after which they hold the values."""
        if not self.cuda:
            return [s.host.clone() for s in pending], None
        compute = torch.cuda.current_stream(self.device)
        copies = [torch.empty(s.host.shape, dtype=s.host.dtype, device=self.device) for s in pending]
        self.h2d.wait_stream(compute)  # the memory may have been in use by queued compute work
        for saved in pending:
            if saved.d2h_event is not None:
                self.h2d.wait_event(saved.d2h_event)
        with torch.cuda.stream(self.h2d):
            for saved, copy in zip(pending, copies):
                copy.copy_(saved.host, non_blocking=True)
        for copy in copies:  # freed unused (a backward cut short) only after the copy landed
            copy.record_stream(self.h2d)
        return copies, record_event(self.h2d)

    def _count_resident(self, tensor: torch.Tensor) -> None:
        stats = self.stats
        stats.resident += 1
        stats.max_resident = max(stats.max_resident, stats.resident)
        weakref.finalize(tensor, _release_resident, weakref.ref(stats))

    def _event(self, what: str, region: _Region) -> None:
        if self.record_events:
            self.stats.events.append((what, region.seq))


def _release_resident(stats_ref) -> None:
    stats = stats_ref()
    if stats is not None:
        stats.resident -= 1
