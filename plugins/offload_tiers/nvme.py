"""Tier ``nvme``: optimizer state (fp32 masters and declared state) and parameter shards in swap files.

The optimizer role is `NvmeTier` (below), the params role `NvmeParamsTier`
(``_nvme_params``); each holds a `SwapTraffic` (``_swap_traffic``): the
engine's one run directory under ``offload.nvme_path``, which both roles
share (``_swap_dir``), and its own native async I/O engine with a reaper
thread (``_io_queue``); both stage
their files in a bounded pool of page-locked blocks (``_arena``) and check
every read against the CRC32C of what was written (``_swap_file``). Each role
has its own options (``_nvme_options``).

`NvmeTier` is a composition: the gradient side is the ``cpu`` tier's parts
(`HostLanding`, `HostUpdates`, `GpuShare`, `HostPlacement`), without
speculation, and the groups on disk are `OptimizerSwap`'s
(``_nvme_optimizer``: the swap files and the pipeline of reads, step and
writes through the pool). Each per-group call goes to the part that holds the
group: the GPU share's inner device tier, the host placement, or the disk.

[Note: no speculation on disk] Steps whose coefficient is known before
backward ends (no clipping, no fp16 scale) start during backward as with the
cpu tier (`prepare` then comes from autograd's thread); such a step is rolled
back (its state read back) only when the step is not taken after all (a
gradient not finite, a write that failed). A *speculative* step
is declined (``speculate = "never"``): its state is written back at
`release`, so a rollback would first read it back from disk, and a clipped
window would move every group's state twice. `acquire` is idempotent while a
group steps (the pipeline acquires again when it leaves a step untaken).

[Note: spill] A box's capacity is its GPU, host memory and disk together: the
optimizer of a model that fits in none of them alone may fit across all
three. ``gpu_share`` and ``host_share`` split the trainable elements in module
order (the next forward's order), group by group: the first ``gpu_share`` keep
master, state and gradient on the GPU and step there (the cpu tier's [Note: GPU
share], placed at `adopt`), the next ``host_share`` keep master and state in
host memory and step on the host like the cpu tier's groups, and the rest,
the last layers, live in swap files. That order is also the fast one: the
step runs in the next forward's order, so the pool reads the first disk
groups while the GPU and host groups step, and the disk groups, which the
next forward needs last, are written back behind it. Only the disk part
crosses the disk. ``gpu_share = "auto"`` (the default) places none at
adoption; after the first step (`rebalance`) the first-needed groups that fit
the GPU memory that step left move there, those on disk read back and off
the disk from then on ([Note: a share by default] in `_gpu_share`), so what
crosses the disk only shrinks.
"""

from __future__ import annotations

from zkernel.spec import ConfigError, hookimpl
from zkernel.spec.tiers import OptimizerTier, Resource
from zkernel.telemetry.log import get_logger

from ._gpu_share import SHARE_BYTES, SIZED_FRACTION, GpuShare, ShareRouting, unused_device_bytes
from ._host_home import HostPlacement
from ._host_landing import HostLanding
from ._nvme_optimizer import DEFAULT_BUFFER_BYTES, OptimizerSwap
from ._nvme_options import NvmeParamsOptions, NvmeTierOptions
from ._nvme_params import NvmeParamsTier
from ._split_master import SplitMasterStats, master_bytes_per_element, resolve_split
from ._staging import HostUpdates
from ._swap_traffic import SwapStats, SwapTraffic

__all__ = ["NvmeParamsOptions", "NvmeParamsTier", "NvmeTier", "NvmeTierOptions", "nvme_tier"]

log = get_logger()


class NvmeTier(SplitMasterStats, SwapStats, ShareRouting, OptimizerTier):
    """Masters and optimizer state in swap files, streamed through a bounded pinned pool for each step.

    Every call runs on the thread [Note: tier threads] names; `prepare` on the
    main thread (autograd's for a step started during backward).
    """

    masters_on_compute_device = False
    speculate = "never"  # [Note: no speculation on disk]

    def __init__(self, context, role: str = "optimizer") -> None:
        self.options = options = context.options or NvmeTierOptions()
        self.cuda = context.device.type == "cuda"
        self.device = context.device
        self._traffic = SwapTraffic(
            context.config.offload.nvme_path, context.host_worker, threads=options.aio_threads,
            block_size=options.aio_block_size, timeline=context.timeline, name="nvme-optimizer",
        )
        self.run_dir = self._traffic.run_dir
        self._split = resolve_split(options.split_master, tier_default=True)
        self._home = HostPlacement(
            options.pin_memory, split=self._split, compute_dtype=context.compute_dtype, streams=context.streams, tier="nvme"
        )
        # Swap files keep split masters too, rebuilt through the host home's buffers.
        self._disk = OptimizerSwap(options, self._traffic, context.streams, self.cuda, split=self._home.split)
        self._landing = HostLanding(
            context,
            pin=options.pin_memory,
            grad_dtype=options.grad_dtype,
            staging_buffers=options.staging_buffers,
            device_accumulation=options.device_accumulation,
        )
        self._updates = HostUpdates(options.staging_buffers, context.compute_dtype, options.pin_memory, context.streams)
        self._share = GpuShare(context, options.gpu_share, split=self._split, tier="nvme")  # placed at adopt ([Note: spill])
        self.host_share_numel = 0
        self._placement_logged = False
        self._closed = False

    # -- placement (main thread) ------------------------------------------------------------------

    def demand(self, numel, state, compute_dtype):
        self._share.planned_numel = numel
        gpu, host = self._share.adopt_time_fraction(), self.options.host_share
        states = sum(s.nbytes for s in state)
        master = master_bytes_per_element(numel, self._split, compute_dtype, self._shard_in_memory)  # in memory
        kept = master * numel + states  # master and state of every group in memory
        image = (master if self._split is True else 4) * numel + states  # ... and as a file holds them
        disk = int(image * max(0.0, 1.0 - gpu - host))
        pool = (self.options.buffer_bytes or min(disk, DEFAULT_BUFFER_BYTES)) if disk else 0
        self._disk.plan(disk)
        landing = self._landing.element_size
        need = {Resource.HOST: int(numel * (1 - gpu)) * landing + int(kept * host) + pool, Resource.DISK: disk}
        if gpu:
            need[Resource.DEVICE] = int(int(numel * gpu) * (SHARE_BYTES - 4 + master))  # master, two moments, gradient
        return need

    def adopt(self, group, master, state):
        numel = master.numel()
        if self._share.takes(group, numel):
            self._share.adopt(group, master, state)
            return
        host = self.options.host_share
        everything = host > 0 and self._share.adopt_time_fraction() + host >= 1.0 - 1e-9  # shares summing to 1: no disk
        on_host = everything or numel <= int(host * self._share.planned_numel) - self.host_share_numel
        if on_host:
            self.host_share_numel += numel
            self._home.adopt(group, master, state)
        self._updates.adopt(group)  # (reads the initial ``group.master``)
        self._landing.adopt(group, numel)
        self._share.remember(group, state)
        if on_host:
            self._home.settle(group)  # (a split master empties ``group.master`` between steps)
        else:
            # (empties ``group.master`` until the group steps)
            self._disk.adopt(group, master, state, split=self._home.splits_on_disk(group))

    def after_first_step(self, order):
        if self.cuda:
            self.rebalance(order, int(SIZED_FRACTION * unused_device_bytes(self.device)))

    def rebalance(self, order, room: int) -> None:
        """Place what is sized at run time within ``room`` bytes of the compute device
        (`after_first_step` on CUDA): a numeric GPU share was placed at adoption ([Note: spill]);
        ``"auto"`` moves the first-needed groups that fit there now, from host memory or from disk
        (read back, and off the disk from then on); then the accumulation arena takes what is left."""
        taken = 0
        if self.options.gpu_share == "auto":
            evicted = set()

            def load(group) -> None:
                if self._disk.holds(group):
                    state = self._disk.evict(group)
                    group.master, group.optim_state = state.master, dict(state.state)
                    evicted.add(group.index)
                else:
                    self._home.unsplit(group)

            arena = self._landing.sums.fraction()
            for group in self._share.place(order, room, host_numel=self._landing.numel(), arena_fraction=arena, load=load):
                self._landing.drop(group)
                taken += self._share.numel_of(group) * self._share.bytes_per_element(group)
                if group.index not in evicted:
                    self.host_share_numel -= self._share.numel_of(group)
            # A group read back whose move ran out of GPU memory steps on the host from now on.
            for group in order:
                if group.index in evicted and not self._share.holds(group):
                    self.host_share_numel += self._share.numel_of(group)
        self._landing.place_device_accumulation(order, room - taken)

    # (gradients: `ShareRouting`, on autograd's thread and the main thread)

    # -- the step ---------------------------------------------------------------------------------

    may_fail_writes = True

    def take_write_failures(self, wait=False):
        # [Note: write failures]: the step pipeline decides each step's outcome from these; none is
        # raised from `prepare` (during backward, some groups of the step may have stepped by then).
        if wait:
            self._traffic.wait_writes()
        return self._traffic.take_failures()

    def prepare(self, group):
        self._disk.finish_layout()
        if not self._placement_logged:
            self._placement_logged = True
            log.info(
                "zkernel.nvme_tier.placement",
                gpu_numel=self.gpu_share_numel,
                host_numel=self.host_share_numel,
                disk_numel=self._disk.numel(),
                disk_bytes=self._disk.nbytes(),
                split_master_numel=self.split_master_numel,
            )
        if self._disk.holds(group):
            self._disk.prepare(group)

    def acquire(self, group):
        if self._share.holds(group):
            return self._share.tier.acquire(group)
        if self._disk.holds(group):
            self._disk.acquire(group)
        else:
            self._home.acquire(group)
        self._landing.acquire(group)
        self._updates.lend(group)  # (reads ``group.master``)

    def release(self, group):
        if self._share.holds(group):
            return self._share.tier.release(group)
        if self._disk.holds(group):
            self._disk.release(group)
        else:
            self._home.release(group)
        self._updates.take_back(group)  # once its upload is queued

    def end_window(self, group):
        if self._share.holds(group):
            return self._share.tier.end_window(group)
        self._landing.end_window(group)
        if self._disk.holds(group):
            self._disk.end_window(group)

    def _stored_split_numel(self) -> int:
        return self._disk.split_numel()

    @property
    def nbytes_on_disk(self) -> int:
        """Bytes of the optimizer's swap files (masters and state of the groups on disk)."""
        return self._disk.nbytes()

    @property
    def read_ahead_bytes(self) -> int:
        """Bytes of the next step's state read into the pool ahead of it, now ([Note: read-ahead] in
        ``_nvme_optimizer``); tests and benches read it between steps."""
        return self._disk.read_ahead_bytes()

    @property
    def read_ahead_evictions(self) -> int:
        """How many read-ahead blocks a group wanted for a step took the room of, so far."""
        return self._disk.evictions

    # -- state outside a step (main thread) -------------------------------------------------------

    def read_master(self, group):
        if self._share.holds(group):
            return self._share.tier.read_master(group)
        return self._disk.read_master(group) if self._disk.holds(group) else self._home.read_master(group)

    def read_state(self, group):
        if self._share.holds(group):
            return self._share.tier.read_state(group)
        return self._disk.read_state(group) if self._disk.holds(group) else self._home.read_state(group)

    def write_state(self, group, state):
        if self._share.holds(group):
            return self._share.tier.write_state(group, state)
        if self._disk.holds(group):
            return self._disk.write_state(group, state)
        self._home.write_state(group, state)

    def close(self):
        if self._closed:
            return
        self._closed = True
        self._disk.finish_layout()
        try:
            self._landing.close()
            self._share.close()
            self._updates.close()
            self._home.close()
        finally:
            self._disk.close()

    @hookimpl
    def zkernel_memory_tensors(self, group):
        if self._share.holds(group):
            return self._share.tier.zkernel_memory_tensors(group)
        disk = self._disk.holds(group)
        grads = self._landing.tensors(group, device_sum=not disk)
        if grads is None:
            return None
        stored = self._disk.tensors(group) if disk else self._home.tensors(group)
        return {"params": self._updates.buffers(group), "grads": grads, **stored}


def check_nvme_config(config, slot) -> None:
    """Either role keeps its swap files under ``offload.nvme_path``: it must be set."""
    if config.offload.nvme_path is None:
        raise ConfigError("offload.nvme_path is required when offload.optimizer or offload.params is 'nvme'")


def nvme_tier(context, role: str):
    return NvmeTier(context, role) if role == "optimizer" else NvmeParamsTier(context, role)


@hookimpl
def zkernel_register_offload_tiers(registry) -> None:
    registry.add(
        "nvme",
        nvme_tier,
        description="optimizer: fp32 masters and state in swap files under offload.nvme_path, streamed through the "
        "CPU step with read-ahead and write-behind; params: shards in swap files, read ahead per stage",
        options_cls={"optimizer": NvmeTierOptions, "params": NvmeParamsOptions},
        check=check_nvme_config,
    )


@hookimpl
def zkernel_size_offload_tier(name, role, options, device):
    from ._footprint import nvme_footprint

    return nvme_footprint(role, options) if name == "nvme" else None
