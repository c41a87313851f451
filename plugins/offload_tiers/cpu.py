"""Tier ``cpu``: fp32 masters, optimizer state and gradient landing buffers in host memory.

This module is the optimizer role (`CpuTier`) and the tier's registration;
the params role is `CpuParamsTier` (``_cpu_params``).

Algorithm (ZeRO-Offload). Each trainable group gets, in page-locked host
memory allocated once at `initialize` (plain memory, with a warning, where
page-locking is unavailable, as on CPU-only torch): its fp32 master, its
declared optimizer state and an fp32 landing buffer for its gradient; in
bf16/fp16 runs the updated parameters are rounded into a staging buffer lent
for the step (or straight into the parameters' home when it is in host
memory). The compute device keeps only the compute-dtype parameters,
transient gradient buckets and activations.

* Gradients: as soon as the partitioner reduced a group (during backward), its
  shard is copied device-to-host on the engine's d2h stream, without blocking
  the host; later micro-batches of a window add up on the host's accumulation
  thread or on the GPU; the window's squared norm is taken as it lands
  (`HostLanding`).
* Step: the optimizer runs on the host (the engine's worker thread), reading
  the landing buffer, and writes rounded parameters into the staging copy (or
  straight into the parameter shard when the params tier keeps it in host
  memory); the params tier then takes them home (`ParamsTier.commit`: an
  upload on the h2d stream whose event the next use of the shard waits for).

The tier is a composition of parts with one job each: `HostPlacement`
(``_host_home``: masters and state in host memory), `HostLanding`
(``_host_landing``: landing buffers, downloads, norms; it holds the
accumulation thread, `HostAccumulation` in ``_host_grad``, and the device
arena, `DeviceAccumulation` in ``_device_accumulation``), `HostUpdates`
(``_staging``: where rounded updates go) and `GpuShare` (``_gpu_share``: the
groups whose optimizer stays on the GPU, [Note: GPU share]). `CpuTier` routes
each per-group call to them; the ``nvme`` tier composes the same parts with
its swap files.
"""

from __future__ import annotations

import attrs

from zkernel.spec import hookimpl
from zkernel.spec.tiers import SPECULATE_POLICIES, OptimizerTier, Resource

from ._cpu_params import CpuParamsOptions, CpuParamsTier
from ._gpu_share import SHARE_BYTES, SIZED_FRACTION, GpuShare, ShareRouting, unused_device_bytes
from ._host_home import HostPlacement
from ._host_landing import HostLanding
from ._split_master import SPLIT_MASTER_CHOICES, SplitMasterStats, master_bytes_per_element, resolve_split
from ._staging import HostUpdates


@attrs.frozen(kw_only=True)
class CpuTierOptions:
    """``offload.optimizer_options`` of the ``cpu`` tier."""

    # Page-lock the host buffers: None = where CUDA is available; True = required (error without CUDA).
    pin_memory: bool | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.instance_of(bool)))
    # Start host steps before the global norm is known and roll them back when clipping or an
    # fp16 overflow applies: "auto" (when the previous step needed neither), "always", "never".
    speculate: str = attrs.field(default="auto", validator=attrs.validators.in_(SPECULATE_POLICIES))
    # Page-locked compute-dtype buffers the host step rounds updated parameters into before their
    # upload, shared by all groups (each as large as the largest group); as many again carry later
    # micro-batches' gradients down for accumulation on the host.
    staging_buffers: int = attrs.field(default=4, validator=attrs.validators.ge(1))
    # Dtype gradients cross to the host in: "fp32" (as reduced), or "bf16" (half the bytes over the
    # link and in host memory, and a shorter host step; the gradient is rounded to bf16 before the
    # optimizer reads it, as DeepSpeed's offload does; the norm is still taken in fp32). With
    # gradient accumulation the landing buffer stays fp32 and the host adds in fp32.
    grad_dtype: str = attrs.field(default="fp32", validator=attrs.validators.in_(("fp32", "bf16")))
    # Fraction of trainable elements whose optimizer stays on the GPU ([Note: GPU share]), or "auto":
    # sized after the first step from the GPU memory it left, 0 without CUDA ([Note: a share by default]).
    gpu_share: float | str = attrs.field(default="auto", validator=lambda _i, _a, v: _check_share(v, "gpu_share"))
    # With gradient accumulation: fraction of host-stepped elements whose gradient adds up on the GPU
    # over a window and crosses once ([Note: device accumulation]), or "auto".
    device_accumulation: float | str = attrs.field(
        default="auto", validator=lambda _i, _a, v: _check_share(v, "device_accumulation")
    )
    # Keep each master as its low half beside the bf16 parameter shard, 2.125 bytes an element
    # instead of 4, rebuilt for each step ([Note: split masters in the tiers]): true, false, or
    # "auto" (false for this tier: it is chosen where host memory holds everything, and the split
    # costs a download of the shard and two passes over the master each step).
    split_master: bool | str = attrs.field(default="auto", validator=attrs.validators.in_(SPLIT_MASTER_CHOICES))


def _check_share(value, key: str) -> None:
    if value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"offload.optimizer_options.{key} must be a number in [0, 1] or \"auto\", got {value!r}")


class CpuTier(SplitMasterStats, ShareRouting, OptimizerTier):
    """Masters, optimizer state and gradients in host memory; the step runs on the host.

    A thin composition (see the module docstring): groups the GPU share holds
    are answered by its inner device tier, every other group by the host
    parts. Each call runs on the thread [Note: tier threads] names.
    """

    masters_on_compute_device = False

    def __init__(self, context, role: str = "optimizer") -> None:
        self.options = context.options or CpuTierOptions()
        self.speculate = self.options.speculate
        self.cuda = context.device.type == "cuda"
        self.device = context.device
        pin = self.options.pin_memory
        self.compute_dtype = context.compute_dtype
        self._split = resolve_split(self.options.split_master, tier_default=False)
        self._home = HostPlacement(pin, split=self._split, compute_dtype=context.compute_dtype, streams=context.streams)
        self._landing = HostLanding(
            context,
            pin=pin,
            grad_dtype=self.options.grad_dtype,
            staging_buffers=self.options.staging_buffers,
            device_accumulation=self.options.device_accumulation,
        )
        self._updates = HostUpdates(self.options.staging_buffers, context.compute_dtype, pin, context.streams)
        self._share = GpuShare(context, self.options.gpu_share, split=self._split)

    # -- placement (main thread) -----------------------------------------------------------

    def demand(self, numel, state, compute_dtype):
        self._share.planned_numel = numel
        share = self._share.adopt_time_fraction()
        master = master_bytes_per_element(numel, self._split, compute_dtype, self._shard_in_memory)
        host = int(int(numel * (1 - share)) * (master + self._landing.element_size)) + int(sum(s.nbytes for s in state) * (1 - share))
        device = int(int(numel * share) * (SHARE_BYTES - 4 + master))
        return {Resource.HOST: host, Resource.DEVICE: device} if device else {Resource.HOST: host}

    def adopt(self, group, master, state):
        if self._share.takes(group, master.numel()):
            self._share.adopt(group, master, state)
            return
        self._home.adopt(group, master, state)
        self._updates.adopt(group)
        self._landing.adopt(group, master.numel())
        self._share.remember(group, state)
        self._home.settle(group)

    def after_first_step(self, order):
        if self.cuda:
            self.rebalance(order, int(SIZED_FRACTION * unused_device_bytes(self.device)))

    def rebalance(self, order, room: int) -> None:
        """Place the GPU share and the accumulation arena within ``room`` bytes of the compute device
        (`after_first_step` on CUDA: [Note: GPU share], [Note: device accumulation])."""
        taken = 0
        if self.options.gpu_share != 0.0:
            arena = self._landing.sums.fraction()
            moved = self._share.place(order, room, host_numel=self._landing.numel(), arena_fraction=arena, load=self._home.unsplit)
            for group in moved:
                self._landing.drop(group)
                taken += self._share.numel_of(group) * self._share.bytes_per_element(group)
        self._landing.place_device_accumulation(order, room - taken)

    # (gradients: `ShareRouting`, on autograd's thread and the main thread)

    # -- the step (the host worker for host groups) ------------------------------------------

    def acquire(self, group):
        if self._share.holds(group):
            return self._share.tier.acquire(group)
        self._home.acquire(group)
        self._landing.acquire(group)
        self._updates.lend(group)

    def release(self, group):
        if self._share.holds(group):
            return self._share.tier.release(group)
        self._updates.take_back(group)
        self._home.release(group)

    def end_window(self, group):
        if self._share.holds(group):
            return self._share.tier.end_window(group)
        self._landing.end_window(group)

    # -- state outside a step (main thread) ---------------------------------------------------

    def read_master(self, group):
        if self._share.holds(group):
            return self._share.tier.read_master(group)
        return self._home.read_master(group)

    def read_state(self, group):
        if self._share.holds(group):
            return self._share.tier.read_state(group)
        return self._home.read_state(group)

    def write_state(self, group, state):
        if self._share.holds(group):
            return self._share.tier.write_state(group, state)
        self._home.write_state(group, state)

    def close(self):
        self._landing.close()
        self._share.close()
        self._updates.close()
        self._home.close()

    @hookimpl
    def zkernel_memory_tensors(self, group):
        if self._share.holds(group):
            return self._share.tier.zkernel_memory_tensors(group)
        grads = self._landing.tensors(group)
        if grads is None:
            return None
        return {"params": self._updates.buffers(group), "grads": grads, **self._home.tensors(group)}


def cpu_tier(context, role: str):
    return CpuTier(context, role) if role == "optimizer" else CpuParamsTier(context, role)


@hookimpl
def zkernel_register_offload_tiers(registry) -> None:
    registry.add(
        "cpu",
        cpu_tier,
        description="optimizer: fp32 masters, state and gradients in page-locked host memory, CPU step overlapping the GPU; params: shards in host memory, uploaded per gather",
        options_cls={"optimizer": CpuTierOptions, "params": CpuParamsOptions},
    )


@hookimpl
def zkernel_size_offload_tier(name, role, options, device):
    from ._footprint import cpu_footprint

    return cpu_footprint(role, options) if name == "cpu" else None
