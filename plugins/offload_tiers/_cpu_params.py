"""Tier ``cpu``, params role: compute-dtype parameter shards in (page-locked) host memory."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from zkernel.spec import hookimpl
from zkernel.platform.host_memory import host_empty
from zkernel.platform.streams import record_event
from zkernel.spec.tiers import ParamsTier, Resource
from zkernel.telemetry.timeline import SpanKind

from .device import shares_storage

@attrs.frozen(kw_only=True)
class CpuParamsOptions:
    """``offload.params_options`` of the ``cpu`` tier."""

    # Page-lock the host shards: None = where CUDA is available; True = required (error without CUDA).
    pin_memory: bool | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.instance_of(bool)))
    # Bytes of shards ahead of the running unit, in the traced order, to upload to the device
    # (the nearest `prefetch_bytes` of them are also gathered ahead).
    prefetch_device_bytes: int = attrs.field(default=1 << 30, validator=attrs.validators.ge(0))


class CpuParamsTier(ParamsTier):
    """Compute-dtype parameter shards in (page-locked) host memory, uploaded to the device per gather.

    Each group's shard lives on the host; a gather needs it on the device, so
    `to_device` uploads it on the h2d stream into a transient device buffer
    (allocated from that stream's pool) and records an event; the consumer (the
    compute stream for a fetch, the gather stream for a prefetch) waits for that
    event only. The buffer is freed once the gather consumed it. An optimizer
    step on the host writes its rounded result straight into the home shard
    (zero copy); one on the device is downloaded on the d2h stream. Each rank
    moves only its own shard over its own link, so host bandwidth adds up with
    the number of GPUs (bandwidth-centric partitioning).
    """

    on_compute_device = False

    def __init__(self, context, role: str = "params") -> None:
        self.options = context.options or CpuParamsOptions()
        self.lookahead_device_bytes = self.options.prefetch_device_bytes
        self.device = context.device
        self.cuda = self.device.type == "cuda"
        self.streams = context.streams
        self.timeline = context.timeline
        # group index -> (device copy, its upload event); reads of the home in flight: group -> event
        self._device: dict[int, tuple[torch.Tensor, Any]] = {}
        self._home_reads: dict[int, Any] = {}
        self._downloads: dict[int, Any] = {}

    def demand(self, numel, compute_dtype):
        return {Resource.HOST: numel * torch.empty((), dtype=compute_dtype).element_size()}

    def adopt(self, group, shard):
        home = host_empty(shard.numel(), shard.dtype, pin=self.options.pin_memory)
        home.copy_(shard)
        return home

    def to_device(self, group, *, consume, block):
        home = group.param_shard
        if not self.cuda:
            if consume:
                group.device_shard = home
            return True
        entry = self._device.get(group.index)
        if entry is None:
            h2d = self.streams.h2d
            download = self._downloads.get(group.index)
            if download is not None:
                # An update stepped on the GPU (a GPU share) is still being copied into the home on
                # d2h: the upload must read what it writes, not the values before the step.
                h2d.wait_event(download)
            nbytes = home.numel() * home.element_size()
            with torch.cuda.stream(h2d), self.timeline.span(SpanKind.PARAM_H2D, stream=h2d, label=group.name, nbytes=nbytes):
                copy = torch.empty(home.shape, dtype=home.dtype, device=self.device)
                copy.copy_(home, non_blocking=True)
            entry = (copy, record_event(h2d))
            self._device[group.index] = entry
            self._home_reads[group.index] = entry[1]
        if consume:
            torch.cuda.current_stream(self.device).wait_event(entry[1])
            group.device_shard = entry[0]
        return True

    def drop_device(self, group):
        entry = self._device.pop(group.index, None)
        group.device_shard = None
        if entry is not None:
            copy = entry[0]
            copy.record_stream(torch.cuda.current_stream(self.device))
            if self.streams.gather is not None:
                copy.record_stream(self.streams.gather)

    def before_update(self, group):
        for pending in (self._home_reads, self._downloads):
            event = pending.pop(group.index, None)
            if event is not None:
                event.synchronize()

    def commit(self, group):
        home = group.param_shard
        source = group.copy_out if group.copy_out is not None else group.master
        stale = self._device.pop(group.index, None)  # a device copy of the old values
        if stale is not None:
            stale[0].record_stream(torch.cuda.current_stream(self.device))
        if shares_storage(source, home):
            return None
        if source.device.type == "cpu" or not self.cuda:
            home.copy_(source)
            return None
        d2h = self.streams.d2h
        d2h.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(d2h):
            home.copy_(source, non_blocking=True)
            source.record_stream(d2h)
        event = record_event(d2h)
        self._downloads[group.index] = event
        return event

    def write_shard(self, group, values):
        self.before_update(group)
        stale = self._device.pop(group.index, None)
        if stale is not None:
            stale[0].record_stream(torch.cuda.current_stream(self.device))
        group.param_shard.copy_(values)

    def close(self):
        for event in (*self._home_reads.values(), *self._downloads.values()):
            event.synchronize()
        self._device.clear()
        self._home_reads.clear()
        self._downloads.clear()

    @hookimpl
    def zkernel_memory_tensors(self, group):
        return {"params": [group.param_shard]} if group.param_shard is not None else None
