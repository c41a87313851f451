"""Partitioner ``zero3``: parameters, gradients, masters and optimizer state partitioned.

Algorithm. Every module that directly owns parameters is one unit; its
parameters (trainable and frozen in separate groups) are flattened and each
rank keeps one contiguous 1/N slice in the compute dtype (see [Note: flat
layout] in `_flat`). Between uses a parameter's ``.data`` is an empty tensor.

* fetch(FORWARD/BACKWARD): give the unit's flat buffer its storage back,
  all-gather the slices into it and point each parameter's ``.data`` at its
  view. A prefetch starts the same all-gather asynchronously (on NCCL it runs
  on the communication stream); the fetch then only waits.
* release(FORWARD/BACKWARD): point ``.data`` back at the empty tensor and
  resize the flat buffer's storage to zero bytes.

[Note: storage-level release] Autograd keeps what an op saved for backward:
the parameter object itself (whose ``.data`` we swap), but often also a view
of it (``linear`` saves ``weight.t()``). Dropping our reference would leave
such views holding the whole gathered weight until backward, so ZeRO-3 would
save nothing. Instead the flat buffer object lives as long as the group and
only its storage is freed (``resize_(0)``) and re-allocated and re-filled
before backward; saved views see the re-gathered values. Writes into the
buffer keep its version counter, since the values they restore are the ones
autograd saved.
* reduce: as ZeRO-2, the unit's gradients are reduce-scattered
  asynchronously and this rank's slice is handed to the optimizer tier.
* step: the optimizer updates the fp32 master shard, and the updated values
  reach the compute-dtype ``param_shard`` the next gather reads (the next
  fetch waits for that update only). In fp32 runs with the master on the
  compute device the master *is* the shard; in bf16/fp16 runs with master and
  parameters on the compute device no compute-dtype shard is kept: each gather
  casts the master on the way in (2 bytes per parameter and rank saved, for
  one shard-sized cast per gather), unless gathers go through peer memory,
  whose pool holds the compute-dtype shards. With the master offloaded the shard is
  its own slot, so a gather never reads fp32 over PCIe.

Where every rank's GPU can map the others' memory, the shards live in one
pool of symmetric memory and a gather copies them on the copy engines instead
of an NCCL kernel (see [Note: peer gathers] in `_peer_gather`;
``peer_gathers``), and those groups' gradients are reduced through peer memory
too (see [Note: peer reductions] in `_peer_reduce`; ``peer_reductions``).

Units smaller than ``persistence_threshold`` elements stay whole on every rank
(gathering them costs more in latency than their memory is worth), all in one
group: their gradients and optimizer state are still partitioned, reduced by
one reduce-scatter, and the whole copy is refreshed by one all-gather after
each step.

Partitioned construction: a model built on the meta device is materialised
one unit at a time (`_materialize`: storage on the device, then the model's
initialiser, ``init_fn`` or ``reset_parameters()``, under a per-unit seed
shared by all ranks; ties stay one parameter), sliced, and the whole unit
freed, so no rank ever holds more than one whole unit beyond its shards.
Buffers left on meta are built after the last unit by their module's
initialiser.
"""

from __future__ import annotations

import math

import attrs
import torch
import torch.distributed as dist
from torch import nn

from zkernel.spec import MATERIALIZES_META, PARAMS_ON_TIER, WholeParams, hookimpl
from zkernel.spec.config import ConfigError, str_tuple
from zkernel.spec.options import boolean, choice, integer
from zkernel.spec.groups import ParamGroup, Phase
from zkernel.params.param_writes import unbind, watch
from zkernel.telemetry.profiling import profiler_range
from zkernel.platform.sizes import format_bytes
from zkernel.params.released import mark_gathered, mark_released
from zkernel.platform.streams import current_stream, record_event
from zkernel.params.unit_modules import UNIT_POLICIES

from ._footprint import Zero3Footprint
from ._flat import FlatLayout, all_gather_flat, flatten_into, module_units
from ._peer_gather import PEER_GATHER_POLICIES, PeerGathers, open_pool, peer_access_everywhere, pool_threshold
from ._peer_reduce import PEER_REDUCTION_POLICIES, PeerReductions
from ._reduce import reduce_every_micro_batch
from ._materialize import materialized_units
from ._whole import gather_master


@attrs.frozen(kw_only=True)
class Zero3Options:
    """``partitioner_options`` of zero3."""

    # Units with fewer elements than this stay whole on every rank.
    persistence_threshold: int = attrs.field(default=100_000, validator=integer(minimum=0))
    # Seed from which each unit of a meta-device model is initialised (same on all ranks).
    init_seed: int = attrs.field(default=0, validator=integer())
    # "modules": each module with its own parameters is a unit; "blocks": each element
    # of a ModuleList/Sequential (and the root) is a unit with its whole subtree.
    units: str = attrs.field(default="modules", validator=choice(*UNIT_POLICIES))
    # Modules (class names or fnmatch patterns of module names) that are each one unit with their
    # whole subtree, whatever ``units`` says: a mixture-of-experts layer whose experts only some
    # ranks run ([Note: leaf modules] in `zkernel.params.unit_modules`; DeepSpeed's set_z3_leaf_modules).
    leaf_modules: tuple[str, ...] = attrs.field(default=(), converter=str_tuple("partitioner_options.leaf_modules"))
    # Each module holding a ModuleList/ModuleDict of experts (named "*experts") is a leaf module too
    # ([Note: expert layers] in `zkernel.params.unit_modules`).
    leaf_experts: bool = attrs.field(default=True, validator=boolean())
    # Gather shards with peer copies on the copy engines ([Note: peer gathers]): "auto" for every
    # shard where the gathered shards average at least 4 MiB, else for shards of at least 32 MiB,
    # where every rank's GPU can map the others' memory and the shards live on the
    # GPU (falling back to NCCL on every rank where one cannot map the pool); "always" every gathered
    # shard, and fails where that is not so; "never" gathers with NCCL.
    peer_gathers: str = attrs.field(default="auto", validator=choice(*PEER_GATHER_POLICIES))
    # Reduce the gradients of the groups gathered through peer memory the same way ([Note: peer
    # reductions]): "auto" does where peer gathers do, "never" reduce-scatters with NCCL.
    peer_reductions: str = attrs.field(default="auto", validator=choice(*PEER_REDUCTION_POLICIES))


@attrs.define(eq=False)
class Zero3State:
    """Per-group buffers of ZeRO-3 (``group.layout``); the shard itself is ``group.param_shard``."""

    flat: FlatLayout
    persistent: bool
    full: torch.Tensor  # flat buffer the parameters are views of; storage freed while released
    gathering: object = None  # all-gather in flight (a Work, or True when done synchronously), or None
    contributed: bool = False  # this window already handed a gradient to the optimizer tier
    peer_offset: int | None = None  # where the shard sits in the peer-gather pool, when it does
    # The parameters' views into ``full`` (made once: a view stays valid while its storage is freed
    # and re-allocated), with the buffer they were made from.
    views: tuple[torch.Tensor, list[torch.Tensor]] | None = None

    @property
    def numel(self) -> int:
        return self.flat.numel


class Zero3:
    """Sharded parameters gathered per module around its forward and backward."""

    def __init__(self, context) -> None:
        self.context = context
        self.options = context.options or Zero3Options()
        self._empty: dict[tuple, torch.Tensor] = {}
        self._peer: PeerGathers | None = None
        self._peer_reduce: PeerReductions | None = None
        self._pool_min_bytes = math.inf  # the smallest shard the pool holds (see [Note: peer gathers])

    # -- partition ----------------------------------------------------------------

    def _placeholder(self, like: torch.Tensor) -> torch.Tensor:
        key = (like.dtype, like.device)
        if key not in self._empty:
            self._empty[key] = torch.empty(0, dtype=like.dtype, device=like.device)
        return self._empty[key]

    @hookimpl
    def zkernel_partition_params(self, module, context):
        return self._groups(module, context)

    def _groups(self, module, context):
        persistent: dict[bool, list] = {True: [], False: []}
        index = 0
        planned = module_units(module, self.options.units, self.options.leaf_modules, self.options.leaf_experts)
        self._peer = self._peer_pool(planned)
        units = materialized_units(
            module, planned, context.device, self.options.init_seed, context.init_fn, unset=context.left_unset
        )
        for unit_name, unit, named in units:
            for trainable, part in _parts(named):
                if self._stays_whole(part):
                    persistent[trainable].extend(part)
                else:
                    yield self._make_group(index, unit_name, unit, part, trainable)
                    index += 1
        # All small units share one always-whole group: one reduce-scatter, one
        # all-gather and one optimizer call per step instead of one per unit.
        for trainable in (True, False):
            if persistent[trainable]:
                yield self._make_group(index, "<persistent>", None, persistent[trainable], trainable)
                index += 1

    def _stays_whole(self, part) -> bool:
        return sum(p.numel() for _, p in part) < self.options.persistence_threshold

    def _peer_pool(self, planned) -> PeerGathers | None:
        """The pool of every gathered group's shard, when gathers go through peer memory."""
        ctx, policy = self.context, self.options.peer_gathers
        if policy == "never":
            return None
        if ctx.world_size == 1 or ctx.device.type != "cuda" or dist.get_backend() != "nccl":
            reason = "it needs CUDA devices and NCCL with more than one rank"
        elif ctx.placement is None or not ctx.placement.params_on_compute_device:
            reason = "the parameter shards are not on the GPU"
        else:
            ok, reason = peer_access_everywhere(ctx.device)
            if ok:
                gathered = [
                    FlatLayout.of([p for _, p in part], ctx.world_size, ctx.rank)
                    for _, _, named in planned
                    for _, part in _parts(named)
                    if not self._stays_whole(part)
                ]
                element = ctx.compute_dtype.itemsize
                self._pool_min_bytes = pool_threshold([flat.shard_size * element for flat in gathered], policy)
                pooled = [flat for flat in gathered if self._pooled_numel(flat)]
                if not pooled:
                    return None
                numel = sum(flat.shard_size for flat in pooled)
                pool = open_pool(numel, ctx.compute_dtype, ctx.device, required=policy == "always", timeline=ctx.timeline)
                if pool is not None and self.options.peer_reductions == "auto":
                    slot = max(flat.padded for flat in pooled)
                    self._peer_reduce = PeerReductions(slot, ctx.compute_dtype, ctx.device, ctx.timeline)
                return pool
        if policy == "always":
            raise ConfigError(f'partitioner_options.peer_gathers = "always", but {reason}; use "auto" or "never"')
        return None

    def _pooled_numel(self, flat: FlatLayout) -> int:
        """Elements of a gathered group's shard the peer-gather pool holds: all of it, or none."""
        return flat.shard_size if flat.shard_size * self.context.compute_dtype.itemsize >= self._pool_min_bytes else 0

    def _casts_master(self, trainable: bool) -> bool:
        """Whether gathers cast the fp32 master instead of reading a compute-dtype shard."""
        placement = self.context.placement
        return (
            trainable
            and self.context.compute_dtype != torch.float32
            and placement is not None
            and placement.masters_on_compute_device
            and placement.params_on_compute_device
        )

    def _make_group(self, index, unit_name, unit, named, trainable) -> ParamGroup:
        """One group over ``named``; ``unit`` None makes it persistent (whole on every rank)."""
        ctx = self.context
        device, dtype = ctx.device, ctx.compute_dtype
        params = tuple(p for _, p in named)
        flat = FlatLayout.of(params, ctx.world_size, ctx.rank)
        full = torch.empty(flat.padded, dtype=dtype, device=device)
        flatten_into(full, flat, [p.data.to(device) for p in params])
        master = None
        if trainable and dtype != torch.float32:
            full32 = torch.empty(flat.padded, dtype=torch.float32, device=device)
            flatten_into(full32, flat, [p.data.to(device, torch.float32) for p in params])
            if ctx.dist.distributed:
                dist.broadcast(full32, src=0)
            master = full32[flat.own].clone()
            del full32
        if ctx.dist.distributed:
            dist.broadcast(full, src=0)
        persistent = unit is None
        peer_offset = None
        if self._peer is not None and not persistent and self._pooled_numel(flat):
            peer_offset, shard = self._peer.take(flat.shard_size)
            shard.copy_(full[flat.own])
        else:
            shard = None if self._casts_master(trainable) else full[flat.own].clone()
        group = ParamGroup(
            index=index,
            name=unit_name or "<root>",
            params=params,
            param_names=tuple(n for n, _ in named),
            requires_grad=trainable,
            module=unit,
            grad_is_shard=True,
            param_shard=shard,
            layout=Zero3State(flat=flat, persistent=persistent, full=full, peer_offset=peer_offset),
        )
        self._point_at(group, full)
        if not persistent:
            self._free_full(group)
        if trainable:
            group.master = shard if master is None else master
        return group

    def _gather_source(self, group: ParamGroup) -> torch.Tensor:
        if group.device_shard is not None:
            return group.device_shard
        if group.master is None:
            raise RuntimeError(f"zero3 group {group.name!r} has neither a device shard nor a master to gather from")
        return group.master.to(self.context.compute_dtype)

    def _free_full(self, group: ParamGroup) -> None:
        self._point_at_placeholder(group)
        full = group.layout.full
        if full.is_cuda:
            # A prefetch allocated it on the gather stream: not reused before compute is done with it.
            full.record_stream(current_stream(full.device))
        full.untyped_storage().resize_(0)

    def _point_at(self, group: ParamGroup, full: torch.Tensor) -> None:
        state: Zero3State = group.layout
        if full is state.full:
            if state.views is None or state.views[0] is not full:
                state.views = (full, state.flat.views(full))
            views = state.views[1]
        else:  # a buffer of the user's (gathered_parameters) or a restore: its own views
            views = state.flat.views(full)
        for p, view, name in zip(group.params, views, group.param_names):
            mark_gathered(p)
            p.data = view
            watch(p, view, name)  # [Note: writes to gathered parameters] in `zkernel.params.param_writes`
        group.gathered = True

    def _point_at_placeholder(self, group: ParamGroup) -> None:
        """Between uses: empty ``.data``, and reads outside the engine raise (see `zkernel.params.released`)."""
        for p, name in zip(group.params, group.param_names):
            unbind(p)  # [Note: assignments keep the storage] in `zkernel.params.param_writes`
            p.data = self._placeholder(group.layout.full)
            mark_released(p, name)
        group.gathered = False

    # -- fetch / release ------------------------------------------------------------

    def _gather_into(self, group: ParamGroup, full: torch.Tensor, async_op: bool):
        """All-gather every rank's shard into ``full`` on the current stream: a Work when
        asynchronous, an event when one rank copied on a side stream, else True."""
        if self.context.world_size == 1:
            full.copy_(self._gather_source(group))
            return record_event() if async_op and full.is_cuda else True
        state: Zero3State = group.layout
        if state.peer_offset is not None:  # the shard is its slice of the pool (params on the GPU)
            event = self._peer.all_gather(
                full, state.peer_offset, state.flat.shard_size, reused=full is state.full, label=f"{group.name} all-gather"
            )
            if async_op:
                return event
            current_stream(full.device).wait_event(event)
            return True
        work = all_gather_flat(full, self._gather_source(group), async_op=async_op)
        return work if async_op else True

    def _start_gather(self, group: ParamGroup) -> None:
        state: Zero3State = group.layout
        full = state.full
        full.untyped_storage().resize_(full.numel() * full.element_size())
        with torch.autograd._unsafe_preserve_version_counter(full):
            state.gathering = self._gather_into(group, full, async_op=True)
        self.context.timeline.collective(state.gathering, f"{group.name} all-gather", nbytes=full.numel() * full.element_size())

    @staticmethod
    def _drop_prefetch(state: Zero3State) -> None:
        """Discard a gather the prefetcher started but nobody consumed: it would be stale after the step."""
        if state.gathering is not None:
            _wait(state.gathering)
            state.gathering = None
            if state.full.is_cuda:
                state.full.record_stream(current_stream(state.full.device))
            state.full.untyped_storage().resize_(0)

    @hookimpl
    def zkernel_prefetch_params(self, group, phase):
        state = group.layout
        if not group.gathered and state.gathering is None:
            with profiler_range("zkernel::prefetch"):
                self._start_gather(group)

    @hookimpl
    def zkernel_fetch_params(self, group, phase):
        state: Zero3State = group.layout
        if group.gathered:
            return
        if phase is Phase.USER:
            self._gather_for_user(group)
            return
        if state.gathering is None:
            self._start_gather(group)
        _wait(state.gathering)
        state.gathering = None
        self._point_at(group, state.full)

    def _gather_for_user(self, group: ParamGroup) -> None:
        """Gather into a fresh buffer: views the user keeps own their storage (see [Note: storage-level release])."""
        state: Zero3State = group.layout
        self._drop_prefetch(state)
        full = torch.empty(state.full.numel(), dtype=state.full.dtype, device=state.full.device)
        self._gather_into(group, full, async_op=False)
        self._point_at(group, full)

    @hookimpl
    def zkernel_release_params(self, group, phase):
        state: Zero3State = group.layout
        if state.persistent:
            return
        if phase is Phase.USER:
            if group.gathered:
                self._point_at_placeholder(group)
        elif group.gathered:
            self._free_full(group)
        elif phase is Phase.BACKWARD:
            self._drop_prefetch(state)

    @hookimpl
    def zkernel_reduce_gradients(self, group, boundary):
        peers = self._peer_reduce if group.layout.peer_offset is not None else None
        return reduce_every_micro_batch(group, self.context.world_size, boundary, peers)

    @hookimpl
    def zkernel_publish_params(self, group):
        state: Zero3State = group.layout
        if state.persistent:
            with torch.autograd._unsafe_preserve_version_counter(state.full):
                self._gather_into(group, state.full, async_op=False)

    @hookimpl
    def zkernel_restore_params(self, group, master, home):
        state: Zero3State = group.layout
        self._drop_prefetch(state)
        device, world = self.context.device, self.context.world_size
        if master is not None:
            full = gather_master(state.flat, master, device, world)
        else:
            full = torch.empty(state.full.numel(), dtype=state.full.dtype, device=device)
            self._gather_into(group, full, async_op=False)
        for p, view in zip(group.params, state.flat.views(full)):
            mark_gathered(p)
            if home.type == "meta":  # released ([Note: where a closed model goes]); .data cannot change type
                torch.utils.swap_tensors(p, nn.Parameter(torch.empty_like(view, device=home), p.requires_grad))
            else:
                p.data = view.to(home, copy=True)
        group.gathered = True
        state.full = full.new_empty(0)

    @hookimpl
    def zkernel_describe_shard(self, group):
        return group.layout.flat.shard_layout()

    @hookimpl
    def zkernel_restore_state(self, group):
        state: Zero3State = group.layout
        self._drop_prefetch(state)
        if state.persistent:
            with torch.autograd._unsafe_preserve_version_counter(state.full):
                self._gather_into(group, state.full, async_op=False)

    @hookimpl
    def zkernel_memory_tensors(self, group):
        state: Zero3State = group.layout
        return {"params": [t for t in (group.param_shard, state.full) if t is not None]}

    @hookimpl
    def zkernel_memory_whole(self, group):
        state: Zero3State = group.layout
        if state.full is None or state.full.untyped_storage().nbytes() == 0:
            return None
        nbytes = state.full.untyped_storage().nbytes()
        if state.persistent:
            threshold = self.options.persistence_threshold
            return WholeParams(
                params=len(group.params),
                nbytes=nbytes,
                why=f"units under persistence_threshold = {threshold:,} elements stay whole on every rank "
                "(gathering them would cost more than their memory)",
                setting="partitioner_options.persistence_threshold",
            )
        return WholeParams(
            params=len(group.params),
            nbytes=nbytes,
            why="units gathered now: in use, or gathered ahead of the next forward within prefetch_bytes = "
            f"{format_bytes(self.context.config.prefetch_bytes)} (released after their use)",
            setting="prefetch_bytes",
        )


def _parts(named):
    """A unit's trainable and frozen parameters, each a (trainable, [(name, param)]) when it has any."""
    for trainable in (True, False):
        part = [(n, p) for n, p in named if p.requires_grad == trainable]
        if part:
            yield trainable, part


def _wait(gathering) -> None:
    """The current stream (and, for gloo, the host) waits for a gather started earlier."""
    if gathering is True or gathering is None:
        return
    if isinstance(gathering, torch.cuda.Event):
        current_stream().wait_event(gathering)
    else:
        gathering.wait()


@hookimpl
def zkernel_register_partitioners(registry) -> None:
    registry.add(
        "zero3",
        Zero3,
        description="ZeRO-3: parameters, gradients, masters and optimizer state partitioned; gathered per module",
        options_cls=Zero3Options,
        capabilities=(PARAMS_ON_TIER, MATERIALIZES_META),
    )




@hookimpl
def zkernel_size_partition(name, module, world_size, options):
    return Zero3Footprint(module, world_size, options) if name == "zero3" else None
