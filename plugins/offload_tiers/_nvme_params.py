"""Tier ``nvme``, params role: compute-dtype parameter shards in swap files, read ahead through pinned blocks.

Algorithm (ZeRO-Infinity's parameter swapping, bandwidth-centric: each rank
moves only its own shard over its own disk and PCIe link; the all-gather
assembles the unit over the GPU interconnect). Each group's shard lives in
one swap file of the engine's run directory (see [Note: run directories]);
nothing of it is in memory between uses. The scheduler moves it through the
stages of [Note: parameter stages], each with its own look-ahead in the
traced module order:

* `prefetch_host` (furthest ahead, ``lookahead_host_bytes``) takes a block
  from a bounded pool of page-locked memory (``buffer_bytes``) and starts the
  reads (each checked against the CRC32C of its last write, [Note: swap-file
  integrity]); with the pool full it does nothing (the prefetcher retries as
  the model runs);
* `to_device` (nearer, ``prefetch_device_bytes``) uploads the block on the h2d
  stream once its reads landed and records an event (``block=False``: returns
  False while they are in flight; ``block=True``, a fetch: waits for them);
  the block goes back to the pool when the upload is done. Without CUDA the
  block itself is the "device" copy the gather reads, returned to the pool at
  `drop_device`;
* `drop_device` frees the device copy once the gather consumed it.

After a step, `commit` writes the updated shard: an optimizer stepping on the
host writes its rounded update straight into a block this tier lent it for
the step as ``group.copy_out`` (`before_update`), which `commit` then writes
to the file, so the update reaches the disk without another pass over
memory; an update computed on the device (or an fp32 master) is first copied
into a block. While that write is in flight the block is the group's host
copy: a fetch uploads from it and never reads a file that is being written.

A blocking fetch finds room in the pool as `ParamBlocks` (``_param_blocks``)
says.

[Note: write failures] apply as for the optimizer role: a failed write
leaves the newest shard in host memory (the rescue copy), the file's extents
unreadable, and later uses read the rescue copy; the next successful write of
the shard (the group's next commit) drops it. The error is never raised from a
read-ahead, a fetch or a commit: those run on one rank in the middle of a
forward or a step, and one rank raising there would leave the others waiting
in the next all-gather. It is handed to the step pipeline instead
(`take_write_failures`, at the end of the next boundary backward), which has
every rank agree that the next step is not taken and raise it ([Note: a step
is all-or-nothing] in `zkernel.kernel.step_outcome`): the step whose writes
failed stays taken (its values are in memory), the one after it is run again
once there is room. A failure after the last step is logged when it happens
(``zkernel.nvme.write_failed``); `Engine.close` gives the model back from the
masters and rescue copies, so nothing is lost.
"""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import Future

import attrs
import torch

from zkernel.spec import hookimpl
from zkernel.platform.aio import aligned_empty
from zkernel.platform.streams import record_event
from zkernel.spec.tiers import ParamsTier, Resource, StoredBytes
from zkernel.telemetry.timeline import SpanKind

from ._arena import aligned
from ._nvme_options import NvmeParamsOptions
from ._param_blocks import HostCopy, ParamBlocks
from ._progress import Preallocation
from ._swap_file import SwapFile, extents_of
from ._swap_traffic import SwapStats, SwapTraffic


@attrs.define(eq=False)
class _ParamSlot:
    group: weakref.ref
    name: str
    file: SwapFile
    numel: int
    dtype: torch.dtype
    host: HostCopy | None = None
    device: tuple | None = None  # (device tensor, upload event) with CUDA
    lent: HostCopy | None = None  # the block lent as ``copy_out`` for a step
    given: HostCopy | None = None  # without CUDA: the copy handed to a gather as ``device_shard``
    rescue: torch.Tensor | None = None  # the newest image, when its last write failed
    ahead: int = 0  # read-ahead order (larger = asked later), for giving room back

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


class NvmeParamsTier(SwapStats, ParamsTier):
    """Compute-dtype parameter shards in swap files, staged through a bounded pinned pool."""

    on_compute_device = False
    shard_in_memory = False  # (a swap file)

    def __init__(self, context, role: str = "params") -> None:
        self.options = context.options or NvmeParamsOptions()
        self.lookahead_host_bytes = self.options.lookahead_host_bytes
        self.lookahead_device_bytes = self.options.prefetch_device_bytes
        self.device = context.device
        self.cuda = self.device.type == "cuda"
        self.streams = context.streams
        self.timeline = context.timeline
        self.compute_dtype = context.compute_dtype
        self._traffic = SwapTraffic(
            context.config.offload.nvme_path, context.host_worker, threads=self.options.aio_threads,
            block_size=self.options.aio_block_size, timeline=context.timeline, name="nvme-params",
        )
        self.run_dir, self.io = self._traffic.run_dir, self._traffic.io
        self._cv = threading.Condition(threading.RLock())
        self._slots: dict[int, _ParamSlot] = {}
        self._blocks = ParamBlocks(self.options, self._slots, self._cv)
        self._layout = Preallocation("parameter")
        self._ahead = 0
        self._closed = False

    # -- placement ---------------------------------------------------------------------------------

    def demand(self, numel, compute_dtype):
        disk = numel * torch.empty((), dtype=compute_dtype).element_size()
        pool = self.options.buffer_bytes or min(disk, self.options.lookahead_host_bytes)
        self._layout.plan(disk)
        return {Resource.DISK: disk, Resource.HOST: pool}

    def adopt(self, group, shard):
        numel = shard.numel()
        nbytes = numel * shard.element_size()
        extent_bytes = self.options.sub_group_size * shard.element_size()
        file = SwapFile(self.run_dir.file(f"params-{group.index:05d}.swap"), aligned(nbytes), extents_of([(0, nbytes)], extent_bytes))
        file.preallocate(f"the parameter shard of group {group.name!r}")
        slot = _ParamSlot(weakref.ref(group), group.name, file, numel, shard.dtype)
        self._slots[group.index] = slot
        self._write_image(slot, shard)
        self._layout.advance(file.nbytes)
        return None  # the home is the file: ``param_shard`` stays None

    def _write_image(self, slot: _ParamSlot, values: torch.Tensor) -> None:
        """Write ``values`` (the whole shard) to ``slot``'s file now, and wait."""
        image = aligned_empty(aligned(slot.nbytes), torch.uint8, pin=False)
        image[: slot.nbytes].view(slot.dtype).copy_(values.detach().reshape(-1))
        image[slot.nbytes :].zero_()
        try:
            slot.file.write_now(self.io, image, kind=SpanKind.NVME_WRITE, label=f"params {slot.name}")
        except OSError as error:
            slot.rescue = image  # [Note: write failures]: the newest values stay in memory
            error.add_note(f"writing the parameter shard of group {slot.name!r} to its swap file")
            raise
        slot.rescue = None

    # -- reads ----------------------------------------------------------------------------------------

    def _read(self, slot: _ParamSlot, *, wait: bool) -> bool:
        copy = self._blocks.allocate(slot.nbytes, wait=wait)
        if copy is None:
            return False
        slot.host = copy
        self._ahead += 1
        slot.ahead = self._ahead
        if slot.rescue is not None:
            copy.block.data[: slot.rescue.numel()].copy_(slot.rescue)
            return True
        indices, zeros = slot.file.plan_read()
        for extent in zeros:
            copy.block.data[extent.offset : extent.offset + extent.nbytes].zero_()
        copy.reading = len(indices)
        for i in indices:
            slot.file.read(self.io, i, copy.block.data, kind=SpanKind.PARAM_NVME_READ, label=slot.name,
                           done=lambda f, copy=copy, slot=slot: self._on_read(slot, copy, f))
        return True

    def _on_read(self, slot: _ParamSlot, copy: HostCopy, future: Future) -> None:
        with self._cv:
            error = future.exception()
            if error is not None and copy.error is None:
                error.add_note(f"reading the parameter shard of group {slot.name!r} from its swap file")
                copy.error = error
            copy.reading -= 1
            if copy.reading == 0 and not copy.current:
                self._blocks.collect_uploads(query=False)
            self._cv.notify_all()

    def prefetch_host(self, group):
        self._layout.finish()
        with self._cv:
            slot = self._slots[group.index]
            self._blocks.collect_uploads()
            if slot.host is None and slot.device is None:
                self._read(slot, wait=False)

    def to_device(self, group, *, consume, block):
        self._layout.finish()
        with self._cv:
            slot = self._slots[group.index]
            self._blocks.collect_uploads()
            while not (self.cuda and slot.device is not None):
                if slot.host is None and not self._read(slot, wait=block):
                    return False
                copy = slot.host
                if copy.reading:
                    if not block:
                        return False
                    copy.waiters += 1
                    try:
                        while copy.reading:
                            self._cv.wait()
                    finally:
                        copy.waiters -= 1
                    self._blocks.collect_uploads()
                    continue  # a step's commit may have replaced it meanwhile: look again
                if copy.error is not None:
                    error = copy.error
                    slot.host = None
                    self._blocks.retire(copy)
                    raise error
                view = copy.block.view(slot.dtype, 0, slot.numel)
                if not self.cuda:
                    if consume:
                        self._give(slot, copy)
                        group.device_shard = view
                    return True
                self._upload(slot, copy, view)
            tensor, event = slot.device
            if consume:
                torch.cuda.current_stream(self.device).wait_event(event)
                group.device_shard = tensor
            return True

    def _give(self, slot: _ParamSlot, copy: HostCopy) -> None:
        """Without CUDA: ``copy`` is what a gather reads, until `drop_device`."""
        if slot.given is not copy:
            self._take_back(slot)
            copy.in_use = True
            slot.given = copy

    def _take_back(self, slot: _ParamSlot) -> None:
        copy, slot.given = slot.given, None
        if copy is None:
            return
        copy.in_use = False
        if copy is slot.host and copy.writing == 0:  # gathered: read it again when it is needed again
            slot.host = None
            self._blocks.retire(copy)
        self._blocks.collect_uploads()

    def _upload(self, slot: _ParamSlot, copy: HostCopy, view: torch.Tensor) -> None:
        h2d = self.streams.h2d
        with torch.cuda.stream(h2d), self.timeline.span(SpanKind.PARAM_H2D, stream=h2d, label=slot.name, nbytes=slot.nbytes):
            tensor = torch.empty(view.shape, dtype=view.dtype, device=self.device)
            tensor.copy_(view, non_blocking=True)
        event = record_event(h2d)
        slot.device = (tensor, event)
        copy.uploads.append(event)
        if copy.writing == 0:  # the device has it now; a copy being written stays until it is on disk
            slot.host = None
            self._blocks.retire(copy)

    def drop_device(self, group):
        with self._cv:
            slot = self._slots.get(group.index)
            group.device_shard = None
            if slot is None:
                return
            if self.cuda:
                entry, slot.device = slot.device, None
                if entry is not None:
                    entry[0].record_stream(torch.cuda.current_stream(self.device))
                    if self.streams.gather is not None:
                        entry[0].record_stream(self.streams.gather)
                return
            self._take_back(slot)

    # -- after a step -----------------------------------------------------------------------------------

    def before_update(self, group):
        master = group.master
        if master is None or master.device.type != "cpu" or self.compute_dtype == torch.float32:
            return  # the update is the fp32 master, or it is computed on the device: `commit` copies it
        with self._cv:
            slot = self._slots[group.index]
            if group.copy_out is not None and slot.lent is None:
                return  # the optimizer tier writes the update elsewhere
            if slot.lent is None:
                slot.lent = self._blocks.allocate(slot.nbytes, wait=True)
            group.copy_out = slot.lent.block.view(slot.dtype, 0, slot.numel)

    def commit(self, group):
        with self._cv:
            slot = self._slots[group.index]
            self._drop_old_copies(slot)
            copy, slot.lent = slot.lent, None
            if copy is not None:
                group.copy_out = None
            else:
                copy = self._blocks.allocate(slot.nbytes, wait=True)
                self._fill(copy, slot, group.copy_out if group.copy_out is not None else group.master)
            slot.host = copy
            self._ahead += 1
            slot.ahead = self._ahead
            copy.writing = len(slot.file.extents)
            copy.write_error = None
            for i in range(len(slot.file.extents)):
                slot.file.write(self.io, i, copy.block.data, kind=SpanKind.NVME_WRITE, label=f"params {slot.name}",
                                done=lambda f, copy=copy, slot=slot: self._on_write(slot, copy, f))
        return None  # a failed write is the step pipeline's to raise ([Note: write failures])

    def _fill(self, copy: HostCopy, slot: _ParamSlot, source: torch.Tensor) -> None:
        """The update computed elsewhere (the device, or an fp32 master) into ``copy``'s block."""
        view = copy.block.view(slot.dtype, 0, slot.numel)
        if source.device.type == "cpu" or not self.cuda:
            view.copy_(source.reshape(-1))
            return
        d2h = self.streams.d2h
        d2h.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(d2h):
            view.copy_(source.reshape(-1), non_blocking=True)
            source.record_stream(d2h)
        record_event(d2h).synchronize()

    def _on_write(self, slot: _ParamSlot, copy: HostCopy, future: Future) -> None:
        with self._cv:
            error = future.exception()
            if error is not None and copy.write_error is None:
                copy.write_error = error
            copy.writing -= 1
            if copy.writing:
                return
            if copy.write_error is not None:
                slot.rescue = copy.block.data[: aligned(slot.nbytes)].clone()  # [Note: write failures]
                self._traffic.write_failed(
                    copy.write_error, slot.name, slot.file.path,
                    f"writing the parameter shard of group {slot.name!r} to its swap file; the newest values are "
                    "kept in host memory and written again after the group's next step",
                )
            else:
                slot.rescue = None
            if slot.host is copy and not copy.in_use:
                slot.host = None  # on disk now: read again when it is needed (the pool stays free)
                self._blocks.retire(copy)
            self._blocks.collect_uploads(query=False)
            self._cv.notify_all()

    may_fail_writes = True

    def take_write_failures(self, wait=False):
        if wait:
            self._traffic.wait_writes()
        return self._traffic.take_failures()

    # -- checkpoints (between steps) ----------------------------------------------------------------------

    def read_shard(self, group):
        slot = self._slots[group.index]
        self.io.wait_idle()  # no write of it in flight: the file (or the rescue copy) is the newest
        with self._cv:
            copy = slot.host
            if slot.rescue is not None:
                return slot.rescue[: slot.nbytes].view(slot.dtype).clone()
            if copy is not None and copy.error is None and not copy.reading:
                return copy.block.view(slot.dtype, 0, slot.numel).clone()
        image = aligned_empty(aligned(slot.nbytes), torch.uint8, pin=False)
        try:
            slot.file.read_now(self.io, image, kind=SpanKind.PARAM_NVME_READ, label=slot.name)
        except (OSError, EOFError) as error:
            error.add_note(f"reading the parameter shard of group {slot.name!r} from its swap file")
            raise
        return image[: slot.nbytes].view(slot.dtype)

    def write_shard(self, group, values):
        slot = self._slots[group.index]
        self.io.wait_idle()  # reads of the old values done, and no write of them still in flight
        with self._cv:
            self._drop_old_copies(slot)
        self._write_image(slot, values)

    def _drop_old_copies(self, slot) -> None:
        """New values are coming: the host and device copies of the old ones are not used again (``_cv`` held)."""
        old, slot.host = slot.host, None
        if old is not None:
            self._blocks.retire(old)
        if slot.device is not None:
            tensor, _ = slot.device
            slot.device = None
            if self.cuda:
                tensor.record_stream(torch.cuda.current_stream(self.device))

    # -- shutdown and accounting --------------------------------------------------------------------------

    def close(self):
        if self._closed:
            return
        self._closed = True
        self._layout.finish()
        try:
            self.io.wait_idle()
            if self.cuda:
                torch.cuda.current_stream(self.device).synchronize()
                if self.streams.h2d is not None:
                    self.streams.h2d.synchronize()
            with self._cv:
                for slot in self._slots.values():
                    slot.device = slot.given = None
                    for copy in (slot.host, slot.lent):
                        if copy is not None:
                            copy.uploads, copy.in_use = [], False
                            self._blocks.retire(copy)
                    slot.host = slot.lent = None
                    group = slot.group()
                    if group is not None:
                        group.device_shard = None
                        group.copy_out = None
                for copy in self._blocks.retired:
                    copy.uploads, copy.in_use, copy.waiters = [], False, 0
                self._blocks.collect_uploads()
        finally:
            self._traffic.close(self._blocks.arena)

    @hookimpl
    def zkernel_memory_tensors(self, group):
        slot = self._slots.get(group.index)
        if slot is None:
            return None
        return {"params": [StoredBytes("nvme", (str(slot.file.path),), slot.nbytes)]}
