"""The tier interfaces: where each per-rank buffer of a group lives and how it moves.

DESIGN.md "Placement": the partitioner decides who owns which slice; the tier
selected for a buffer's role decides where that slice lives. Two roles:

* ``offload.optimizer`` -> an `OptimizerTier`: the fp32 master, the optimizer
  state and the landing buffer of the gradient, for every trainable group;
* ``offload.params`` -> a `ParamsTier`: the compute-dtype parameter shard.

A tier is a component like any other (factory ``factory(context, role)``
registered through ``zkernel_register_offload_tiers``), so a third party's
tier plugs in by name; the kernel calls the methods below directly (exactly
one tier per role), and the tier object also joins the runtime plugin manager
so it can implement hooks such as ``zkernel_memory_tensors``.

[Note: tier threads] `OptimizerTier.land` is called from autograd's thread
during backward, `grad_sq_norm` from the main thread at the end of backward
(and from the worker for a group a speculative early step acquired),
the step stages (`acquire`, `release`) from whichever thread steps the group:
the main thread for groups the tier steps on the compute device, the engine's
host worker thread for groups it steps on the host (`steps_on_host`). The
worker is one thread running jobs in submission order, so work a tier submits
to it from `land` (e.g. host-side accumulation) always precedes the step of
the same group, which the kernel submits after the window's last landing.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import attrs
import torch

from zkernel.spec.config import ConfigError
from zkernel.spec.groups import ParamGroup, ReducedGradient, StateSpec
from zkernel.platform.machine import Capacity  # the one capacity type, re-exported for tiers
from zkernel.platform.sizes import format_bytes


@attrs.frozen
class StoredBytes:
    """Bytes a tier holds outside memory (a swap file's region), for `zkernel_memory_tensors`.

    `Engine.memory_report` counts ``nbytes`` under ``place`` (e.g. ``"nvme"``),
    once per ``key`` as it counts a tensor once per storage.
    """

    place: str
    key: Any
    nbytes: int


@attrs.frozen(kw_only=True)
class WholeParams:
    """Parameters a partitioner holds whole on this rank, and why, for `zkernel_memory_whole`.

    `Engine.memory_report` lists them (`MemoryReport.whole`, summed over the
    groups with the same ``why`` and ``setting``), so a report whose ``params``
    exceed a shard says what the rest is.
    """

    params: int  # how many parameters
    nbytes: int  # bytes of their whole copy on this rank (already in the report's ``params``)
    why: str  # for people, e.g. "units under persistence_threshold = 100,000 elements stay whole on every rank"
    setting: str | None = None  # the config key that changes it, e.g. "partitioner_options.persistence_threshold"


@attrs.frozen
class ShardState:
    """A trainable group's fp32 master and optimizer state on this rank (checkpoints, state dicts).

    ``master`` has the shard's numel; ``state`` maps each optimizer state name
    to a tensor of the same numel (per-element, e.g. Adam's moments) or a 0-dim
    one (e.g. a step count). Tensors may be on any device.
    """

    master: torch.Tensor
    state: Mapping[str, torch.Tensor]


class Resource(enum.Enum):
    """What a tier's buffers consume, for the capacity check at `initialize`."""

    DEVICE = "compute device memory"
    HOST = "host memory"
    DISK = "disk at offload.nvme_path"


# How an optimizer tier's steps may start before the gradient norm is known (`OptimizerTier.speculate`).
SPECULATE_POLICIES = ("auto", "always", "never")


class OptimizerTier(abc.ABC):
    """Holds the fp32 master, optimizer state and gradient landing buffer of trainable groups."""

    #: True when every master this tier places stays on the compute device, so a
    #: partitioner may gather by casting the master instead of keeping a compute-dtype shard.
    masters_on_compute_device: bool = False
    #: Whether the step pipeline may start this tier's steps before the gradient norm and
    #: overflow are known, rolling back where clipping or an overflow applies: one of
    #: `SPECULATE_POLICIES` ("auto": where the tier steps off the compute device; "never" for a
    #: tier that steps on the device, where waiting for the norm costs nothing).
    speculate: str = "never"
    #: Whether writes of master and state back to where they live can fail (a disk): then the
    #: step pipeline asks `take_write_failures` at every boundary.
    may_fail_writes: bool = False

    def pair(self, params_tier: ParamsTier) -> None:
        """Meet the params tier selected beside this one (e.g. to learn whether it keeps parameter
        shards as tensors in memory, `ParamsTier.shard_in_memory`). Called once by `initialize`,
        before `demand` and any `adopt`. Default: nothing."""

    @abc.abstractmethod
    def demand(self, numel: int, state: Sequence[StateSpec], compute_dtype: torch.dtype) -> dict[Resource, int]:
        """Bytes this tier will allocate for ``numel`` master elements (all trainable groups of
        this rank together) with per-element ``state``; called once by `initialize` before any
        group is placed, for the capacity check."""

    @abc.abstractmethod
    def adopt(self, group: ParamGroup, master: torch.Tensor, state: Sequence[StateSpec]) -> None:
        """Place a new trainable group: set ``group.master`` from ``master`` (initial fp32 values
        on the compute device, possibly a view of ``group.param_shard``), allocate
        ``group.optim_state`` (zeros, as declared), the gradient landing buffer and
        ``group.copy_out``. Called by `initialize` once per group, as the partitioner builds them."""

    @abc.abstractmethod
    def land(self, group: ParamGroup, reduced: ReducedGradient, final: bool) -> None:
        """Take a reduced gradient of ``group`` (see `ReducedGradient`); ``final`` when it is the
        window's last. Must not block on the collective: later stages wait for it."""

    @abc.abstractmethod
    def flush(self) -> None:
        """Complete every landing started so far (called at the end of every backward)."""

    @abc.abstractmethod
    def grad_sq_norm(self, groups: Sequence[ParamGroup]) -> list[torch.Tensor | Future | float]:
        """Parts of the squared L2 norm of ``groups``' landed gradients for the window, which the
        caller sums: 0-dim tensors on the compute device (no synchronisation), `Future`s of
        floats computed on the host, or floats; a group without a landed gradient adds nothing.

        Called by the step pipeline at an accumulation boundary after `flush` (main thread), and
        from the host worker for the one group a speculative early step has just acquired, to see
        whether its own gradient already shows the window will clip: that call must not wait for
        the compute stream, which still runs the rest of backward (return a host value)."""

    @abc.abstractmethod
    def steps_on_host(self, group: ParamGroup) -> bool:
        """Whether ``group``'s optimizer step runs on the host (then on the engine's worker
        thread, overlapping device work) rather than on the compute device."""

    def prepare(self, group: ParamGroup) -> None:
        """Start bringing ``group``'s master and state to where it steps, without waiting.

        Called by the step pipeline on the main thread (or autograd's, for a step started
        during backward) for every host-stepped group, in the order their steps will run,
        before those steps are submitted; a tier with bounded buffers queues what it has no
        room for yet and starts it as earlier groups are released. Default: they are resident."""

    def acquire(self, group: ParamGroup) -> None:
        """Block until ``group.master``, ``group.grad`` and ``group.optim_state`` are ready for the
        optimizer in the calling thread. Idempotent until `release`: the step pipeline acquires again
        a group whose early step it left untaken. Default: wait for nothing."""

    def release(self, group: ParamGroup) -> None:
        """After the optimizer updated ``group`` and the params tier took the updated parameters
        (`ParamsTier.commit`, whose transfers are queued by now): start writing master and state
        back where they live, and take back what `acquire` lent (e.g. a staging buffer, once the
        transfers queued on it are done). Default: nothing."""

    @abc.abstractmethod
    def end_window(self, group: ParamGroup) -> None:
        """After the step (or its skip): the next window's first landing starts from zero."""

    @abc.abstractmethod
    def read_master(self, group: ParamGroup) -> torch.Tensor:
        """The current fp32 master values of ``group`` (for `Engine.close` and state dicts)."""

    def after_first_step(self, order: Sequence[ParamGroup]) -> None:
        """Called once by the step pipeline after the first optimizer step, when every update of
        it finished, with the trainable groups in the order the next forward needs them, and the
        peak memory of a whole step known: a tier may now move groups between places (e.g. keep
        the first-needed groups' optimizer on the GPU). Default: nothing."""

    def read_state(self, group: ParamGroup) -> ShardState:
        """``group``'s current master and optimizer state, to be saved or gathered.

        Called by `zkernel.checkpoint` (a checkpoint being written,
        `Engine.state_dict`) on the main thread between steps, after every
        pending step finished, one trainable group at a time in group order. A
        tier that keeps them on disk reads them into host buffers. The caller
        only reads the tensors (they may be the tier's own) and is done with
        them before it asks for the next group, so a tier may reuse one staging
        buffer. Default: not supported (checkpoints then raise, naming the tier).
        """
        raise NotImplementedError(
            f"offload tier {type(self).__name__} does not implement read_state, so it cannot be checkpointed"
        )

    def write_state(self, group: ParamGroup, state: ShardState) -> None:
        """Replace ``group``'s master and optimizer state with ``state`` (a checkpoint being loaded).

        Called by `Engine.load_checkpoint` on the main thread between steps, one
        trainable group at a time in group order, with host tensors the caller
        owns (copy them). ``state.state`` holds every name the optimizer declared
        (and the names already in ``group.optim_state``). The engine then brings
        the parameter shard to the new master (`ParamsTier.write_shard`). Default:
        not supported (loading raises, naming the tier).
        """
        raise NotImplementedError(
            f"offload tier {type(self).__name__} does not implement write_state, so checkpoints cannot be loaded with it"
        )

    def read_grad(self, group: ParamGroup) -> torch.Tensor | None:
        """``group``'s gradient of the accumulation window so far, as the optimizer will read it: the
        shard's reduced gradient (averaged over ranks, summed over the window's micro-batches, times
        the fp16 loss scale), the master's numel, in the dtype it landed in; None where no gradient
        landed in this window (before a backward, after the step).

        Called on the main thread after a backward and before its `Engine.step`, to inspect it
        (`zkernel.deepspeed.utils.safe_get_full_grad`): waits for the landings started so far and
        returns the tier's own buffer, which the caller only reads, before the step. A step that
        started during backward reads the same buffer and does not change it. Default: not
        supported (the caller's error names the tier)."""
        raise NotImplementedError(f"offload tier {type(self).__name__} does not implement read_grad")

    def take_write_failures(self, wait: bool = False) -> list[BaseException]:
        """The failures of writes back (disk full, an I/O error) since the last call, taken.

        Called by the step pipeline on the main thread (``may_fail_writes`` tiers only) at the
        end of every boundary backward, and, with ``wait`` (first wait for every write started
        so far), when that step is not taken ([Note: a step is all-or-nothing] in
        `zkernel.kernel.step_outcome`). A write's failure must not be raised from `prepare`,
        `acquire` or `release`: the tier keeps the group's newest values (in host memory) and
        steps from them, so every group of a step steps and the step's outcome is decided once,
        on every rank. Default: none."""
        return []

    def close(self) -> None:
        """Free buffers and files. Called once by `Engine.close` (and at interpreter exit)."""


class ParamsTier(abc.ABC):
    """Holds the compute-dtype parameter shard of every group and moves it to the compute device.

    [Note: parameter stages] A shard whose home is off the compute device
    passes through stages before a gather: its home (disk) -> page-locked host
    memory (`prefetch_host`) -> the compute device (`to_device`, which sets
    ``group.device_shard``) -> the partitioner's all-gather. The kernel's
    scheduler starts each stage ahead of time, each with its own look-ahead in
    the traced module order (`lookahead_bytes`: furthest for reads, nearer for
    uploads; the all-gather's is ``prefetch_bytes``), and frees the device copy
    once the gather consumed it (`drop_device`). After an optimizer step the
    updated values reach the home through `commit`.
    """

    #: True when shards stay on the compute device.
    on_compute_device: bool = True
    #: True when `adopt` keeps each shard as a tensor in memory (device or host) that holds the
    #: current values between steps, so an optimizer tier may read it (split masters,
    #: [Note: the master's low half] in `zkernel.platform.split_master`); False for a home that
    #: is not a tensor (a swap file).
    shard_in_memory: bool = True

    #: Bytes of shards ahead of the running group to bring to the host / to the device.
    lookahead_host_bytes: int = 0
    lookahead_device_bytes: int = 0
    #: Whether writes of shards to their home can fail (a disk): then the step pipeline asks
    #: `take_write_failures` at every boundary, as it asks the optimizer tier.
    may_fail_writes: bool = False

    @abc.abstractmethod
    def demand(self, numel: int, compute_dtype: torch.dtype) -> dict[Resource, int]:
        """Bytes this tier will allocate for ``numel`` shard elements (see `OptimizerTier.demand`)."""

    @abc.abstractmethod
    def adopt(self, group: ParamGroup, shard: torch.Tensor) -> torch.Tensor | None:
        """Place ``group``'s initial compute-dtype shard (on the compute device); return the tensor
        the group keeps as ``param_shard`` (its home, or None when the home is not a tensor, such
        as a swap file: the optimizer tier then allocates no update buffer of its own, and
        `before_update` lends one per step). Called by `initialize` before the optimizer tier
        adopts the group."""

    def prefetch_host(self, group: ParamGroup) -> None:
        """Start bringing the shard to host memory without waiting (a disk tier reads it)."""

    @abc.abstractmethod
    def to_device(self, group: ParamGroup, *, consume: bool, block: bool) -> bool:
        """Start copying ``group``'s shard to the compute device unless it is there or on its way.

        ``consume``: a gather reads it next on the current stream: set ``group.device_shard``
        and make the current stream wait for the copy. ``block=False`` (prefetch) must not
        block the host: return False when the shard cannot move yet (e.g. its read from disk
        is still in flight); ``block=True`` waits for that. Returns whether the copy is issued."""

    def drop_device(self, group: ParamGroup) -> None:
        """The gather consumed ``group.device_shard`` (in the current stream's order, and on the
        gather stream for a prefetch): free it unless it is the home itself."""

    def before_update(self, group: ParamGroup) -> None:
        """Called in the stepping thread after `OptimizerTier.acquire` and before the optimizer writes
        ``group.copy_out``: wait for any transfer still reading the buffer it is about to overwrite.

        A tier whose home is not a tensor (``param_shard`` None, e.g. a file) may lend here the
        buffer the optimizer writes the rounded update into, as ``group.copy_out`` (only where the
        optimizer tier left it None, see `update_target`), and takes it back in `commit`, so the
        update reaches the home without another pass over memory."""

    @abc.abstractmethod
    def commit(self, group: ParamGroup) -> Any:
        """After a step: move the updated compute-dtype values (``group.copy_out``, or the fp32
        ``group.master`` when there is no low-precision copy) to the shard's home. Returns a CUDA
        event after which the home holds them, or None when they are there in stream order."""

    def read_shard(self, group: ParamGroup) -> torch.Tensor:
        """The current values of a *frozen* group's parameter shard, to be saved or gathered.

        Called like `OptimizerTier.read_state` (trainable groups' shards are derived from their
        masters and never read here). Default: ``group.param_shard``, for tiers that keep it
        resident; a tier that keeps it elsewhere reads it into a host buffer.
        """
        return group.param_shard

    def take_write_failures(self, wait: bool = False) -> list[BaseException]:
        """The failures of shard writes to the home (disk full, an I/O error) since the last call, taken.

        Called like `OptimizerTier.take_write_failures` (``may_fail_writes`` tiers only): at the end
        of every boundary backward, so a write of step k that failed makes step k+1 not taken on
        every rank ([Note: a step is all-or-nothing] in `zkernel.kernel.step_outcome`). A write's
        failure must not be raised from `prefetch_host`, `to_device` or `commit` (one rank would
        leave the others' collectives): the tier keeps the newest shard in host memory and serves
        reads from it until a later write succeeds. Default: none."""
        return []

    def write_shard(self, group: ParamGroup, values: torch.Tensor) -> None:
        """Replace ``group``'s parameter shard with ``values`` (the shard's numel, in its dtype)
        after a checkpoint load: a frozen group's from the checkpoint, a trainable one's from its
        newly loaded master; complete on return, and no device copy of the old values is used
        again. Default: copy into ``group.param_shard``."""
        if group.param_shard is not None:
            group.param_shard.copy_(values)

    def close(self) -> None:
        """Free buffers and files."""


# ---------------------------------------------------------------------------
# Placement: what `initialize` does with each group the partitioner yields
# ---------------------------------------------------------------------------


@attrs.frozen
class PlacementInfo:
    """What a partitioner may know about placement (``context.placement``)."""

    # The fp32 master of every group stays on the compute device (no separate compute-dtype
    # shard is needed when a gather can cast it).
    masters_on_compute_device: bool
    # Parameter shards stay on the compute device.
    params_on_compute_device: bool


# Host memory the capacity check leaves to everything else (the process, the OS, other ranks'
# transient use): a tenth of what is available.
HOST_MARGIN = 0.1


def check_capacity(
    demands: Mapping[Resource, int],
    capacity: Capacity,
    world_size_local: int,
    alternatives: Callable[[], Sequence[str]] | None = None,
) -> None:
    """Raise `ConfigError` with the numbers when ``demands`` (per rank) exceed what is free
    (``capacity``: the calling rank's, `Capacity.measure`).

    Host memory and disk are shared by the ``world_size_local`` ranks of this machine.
    ``alternatives``, asked only when something does not fit, gives config settings that would
    keep more state away from the device and host (``offload.optimizer = 'name'``), named in the error.
    """
    free_by = {Resource.DEVICE: capacity.device_bytes, Resource.HOST: capacity.host_bytes, Resource.DISK: capacity.disk_bytes}
    short = []
    for resource, need in demands.items():
        free = free_by.get(resource)
        if free is None or need <= 0:
            continue
        if resource is Resource.DEVICE:
            total, usable = need, free
        else:
            total = need * world_size_local
            usable = int(free * (1 - HOST_MARGIN)) if resource is Resource.HOST else free
        if total > usable:
            short.append(f"{resource.value}: needs {format_bytes(total)} ({format_bytes(need)} per rank), {format_bytes(usable)} usable")
    if short:
        raise ConfigError(
            "the selected offload tiers do not fit: "
            + "; ".join(short)
            + ". Use more ranks, a partitioner that shards more, offload tiers with more room ("
            + ", ".join([*(alternatives() if alternatives is not None else ()), "`zkernel plugins` lists them"])
            + "), or free memory"
        )
