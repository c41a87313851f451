"""Sizing: how components answer for their own bytes before anything is allocated.

[Note: components answer for their bytes] `zkernel.estimate`, ``zkernel
estimate`` and the planners never model a partitioner, tier or optimizer
themselves: they ask the components the config selects, through the sizing
hooks in `zkernel.spec.hookspecs` (and the optimizer's own
``zkernel_declare_optimizer``), for a model given by its shapes (a module on
the meta device), a config and a world size:

* the partitioner (``zkernel_size_partition``) lays the model out as it would
  (`PartitionSizing`: its groups, each group's shard and padded extent, the
  per-rank buffers it keeps for a group where the tiers put them, what it
  gathers or reduces at once); alignment, bucketing and units live only in its
  code;
* each offload tier (``zkernel_size_offload_tier``) says where the buffers of
  the roles it owns go (`TierSizing`: its own placement, the fractions of its
  groups it keeps elsewhere, `Spill`, its staging pool, the page-locked pools
  it streams files through, whether it keeps its masters split);
* the optimizer declares its state per group exactly as at `initialize`.

A service (`zkernel.sizing.estimator`) puts the answers together into
``memory_report``'s categories by place; a planner gets that service as a
`SizingService` in its `zkernel.spec.planner.PlanRequest`, so a third party's
tier is estimated and planned with exactly like a builtin one.

Places are ``memory_report``'s: `DEVICE` (the compute device, named in a
report by the device's type), ``"cpu"`` (host memory) and ``"nvme"`` (swap
files under ``offload.nvme_path``).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from zkernel.platform.split_master import tie_bytes

DEVICE = "device"  # the compute device, before a report names it ("cuda", "cpu")
PLACES = (DEVICE, "cpu", "nvme")  # fastest first
CATEGORIES = ("params", "grads", "master_weights", "optimizer_state")


class Role(enum.Enum):
    """What a per-rank buffer is for; decides its `memory_report` category and which tier places it."""

    PARAM_FULL = "param_full"  # whole compute-dtype parameters kept on the device
    PARAM_SHARD = "param_shard"  # this rank's compute-dtype slice, owned by offload.params
    STAGING = "staging"  # compute-dtype copy of the updated slice kept by an optimizer tier (bf16/fp16)
    MASTER = "master"  # fp32 slice the optimizer updates, owned by offload.optimizer
    GRAD_REDUCE = "grad_reduce"  # fp32 whole gradient accumulated over a window on the device
    GRAD_LANDING = "grad_landing"  # fp32 gradient slice the step reads, owned by offload.optimizer
    OPTIMIZER_STATE = "optimizer_state"  # the optimizer's declared state, owned by offload.optimizer

    @property
    def category(self) -> str:
        """The `memory_report` category the buffer counts under."""
        return _CATEGORY[self]

    @property
    def owner(self) -> str | None:
        """The offload role (``"optimizer"``, ``"params"``) whose tier places it; None: the compute device."""
        return _OWNER[self]


_CATEGORY = {
    Role.PARAM_FULL: "params",
    Role.PARAM_SHARD: "params",
    Role.STAGING: "params",
    Role.MASTER: "master_weights",
    Role.GRAD_REDUCE: "grads",
    Role.GRAD_LANDING: "grads",
    Role.OPTIMIZER_STATE: "optimizer_state",
}
_OWNER = {
    Role.PARAM_FULL: None,
    Role.PARAM_SHARD: "params",
    Role.STAGING: "optimizer",
    Role.MASTER: "optimizer",
    Role.GRAD_REDUCE: None,
    Role.GRAD_LANDING: "optimizer",
    Role.OPTIMIZER_STATE: "optimizer",
}
# The roles each offload role's tier places.
OWNED_ROLES = {owner: tuple(r for r in Role if r.owner == owner) for owner in ("optimizer", "params")}

# [Note: sizing a split master] An optimizer tier that keeps its fp32 masters
# split ([Note: the master's low half] in `zkernel.platform.split_master`: a
# 16-bit low half and a tie bit beside the bf16 parameter, 2.125 bytes an
# element instead of 4) names the places where it does (`TierSizing.split_master`:
# the builtin tiers split masters on the device and in host memory, and the nvme
# tier in its swap files too, rebuilt in host memory). It can only where the parameter is the master rounded to
# bf16 and in memory when the master is rebuilt: a bf16 run whose parameter
# shards are on the device or in host memory, not in swap files.
# `master_kept_split` is that rule, for the estimator's `Placement` and for a
# planner alike; a partitioner asks `Placement.master_bytes` for its master
# buffers (one that still counts 4 bytes an element stays correct, only
# pessimistic). Each step rebuilds a split master into a buffer the tier lends:
# per place holding split masters, `TierSizing.split_buffers` fp32 buffers as
# large as the largest there and, in host memory beside parameters on a
# separate compute device, as many compute-dtype buffers the parameter is
# downloaded into; the estimator counts them with the masters (``memory_report``
# names them there). They can cost more than small shares save, so a tier names
# the option that keeps every master whole (`TierSizing.split_option`) for a
# planner to turn the split off where a placement does not fit with it.
SPLIT_PRECISION = "bf16"  # the one precision whose parameter is the master's upper half, rounded
_IN_MEMORY = (DEVICE, "cpu")


def master_kept_split(places: Sequence[str], precision: str, params: Mapping[Role, str | None], where: str | None) -> bool:
    """Whether an optimizer tier that splits masters in ``places`` keeps one that lives in ``where``
    split, in a run of ``precision`` whose params tier places the parameter shard as ``params`` says
    ([Note: sizing a split master]). The estimator (through `Placement`) and planners call it."""
    in_memory = params.get(Role.PARAM_SHARD, DEVICE) in _IN_MEMORY
    return where in places and precision == SPLIT_PRECISION and in_memory


def master_bytes(numel: int, split: bool) -> int:
    """Bytes of an fp32 master of ``numel`` elements: 4 each, or kept split a 16-bit low half each
    and a packed tie bit each ([Note: sizing a split master])."""
    return 2 * numel + tie_bytes(numel) if split else 4 * numel


@attrs.frozen
class Buffer:
    """One per-rank buffer of a group, and where its tier keeps it (`DEVICE`, ``"cpu"``, ``"nvme"``)."""

    role: Role
    nbytes: int
    where: str = DEVICE


# -- what a tier answers -----------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Spill:
    """A fraction of an optimizer tier's groups whose optimizer roles it keeps elsewhere.

    [Note: optimizer spill] A tier may keep the optimizer roles of some of its
    groups in another place: the first groups in the next forward's order, each
    taken whole by the first spill whose budget, ``int(share * total)``
    elements (``total``: this rank's trainable elements over the shards,
    rounded up), still holds it; a group no budget holds stays in the tier's
    own placement. Shares that add up to 1 leave nothing in the own placement
    (the last spill takes what the others did not).
    """

    option: str  # the tier's option giving the fraction, e.g. "gpu_share"
    share: float  # the fraction the options give (0: none; a value the tier sizes at run time counts 0)
    where: Mapping[Role, str | None]  # where the taken groups' optimizer roles live
    cuda_only: bool = False  # the tier ignores the option without CUDA
    # The tier places the groups as it adopts them (its fp32 master on the device may be the
    # partitioner's own tensor); False: only module-bound groups at adopt, the others are moved
    # after the first step, as copies.
    at_adopt: bool = True


@attrs.frozen(kw_only=True)
class TierSizing:
    """What a tier answers for one offload role (``zkernel_size_offload_tier``)."""

    role: str  # "optimizer" or "params"
    # Where the buffers of the roles it owns live (`OWNED_ROLES`; None: not kept).
    where: Mapping[Role, str | None]
    spills: tuple[Spill, ...] = ()
    # How many buffers its staging copies in host memory are lent from (one pool for all its
    # host-stepped groups, each as large as the largest); None: one staging copy per group.
    staging_pool: int | None = None
    # Where the optimizer step runs for the groups in its own placement (`DEVICE` or "cpu").
    steps_on: str = DEVICE
    # (params role) it lends the optimizer a buffer for each update, so no staging copy is kept.
    lends_update_buffer: bool = False
    # Page-locked host bytes it streams its files through, given the bytes of each group's
    # file image of its own place (None: it keeps no such pool).
    pool_bytes: Callable[[Sequence[int]], int] | None = None
    # (optimizer role) The places (`PLACES`) where it keeps its fp32 masters split, where the run
    # allows ([Note: sizing a split master]); empty: 4 bytes an element everywhere.
    split_master: tuple[str, ...] = ()
    # (optimizer role) Buffers it rebuilds split masters into for a step, per place holding some
    # (fp32, each as large as the largest split master there; as many compute-dtype ones for the
    # parameter's download where it is on another device).
    split_buffers: int = 1
    # (optimizer role) Its option that keeps every master whole when set false (a planner sets it
    # where the split's rebuild buffers cost more than it saves); None: the split cannot be turned off.
    split_option: str | None = None

    @property
    def home(self) -> str:
        """Where the first of its owned roles' buffers live: the master (optimizer) or the shard (params)."""
        key = Role.MASTER if self.role == "optimizer" else Role.PARAM_SHARD
        return self.where.get(key) or DEVICE

    @property
    def level(self) -> int:
        """How far from the compute device its state lives (`PLACES` order): 0 device, 1 host, 2 disk."""
        return max(PLACES.index(w) for w in self.where.values() if w is not None) if any(self.where.values()) else 0


# -- what a partitioner answers ----------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Placement:
    """Where the selected tiers put one group's buffers (asked by `PartitionSizing.buffers`)."""

    optimizer: Mapping[Role, str | None]  # this group's placement of the optimizer roles (own, or a spill's)
    params: Mapping[Role, str | None]  # the params tier's placement
    tier: Mapping[Role, str | None]  # the optimizer tier's own placement, for choices made for every group
    copied_master: bool = False  # moved to the device after the first step: the fp32 master is a copy
    # Backwards per optimizer step (gradient_accumulation_steps): with 1, a gradient accumulated
    # over the window is reduced by the backward that made it, and never held after one.
    accumulation_steps: int = 1
    # The optimizer tier's `TierSizing.split_master`, and the run's precision ("fp32", "bf16",
    # "fp16"): with ``params`` and where the master lives they decide `splits_master`.
    split_master: tuple[str, ...] = ()
    precision: str = "fp32"

    def where(self, role: Role) -> str | None:
        owner = role.owner
        return DEVICE if owner is None else getattr(self, owner).get(role)

    def on_device(self, role: Role) -> bool:
        return self.where(role) == DEVICE

    def kept(self, role: Role) -> bool:
        return self.where(role) is not None

    def buffer(self, role: Role, nbytes: int) -> Buffer:
        return Buffer(role, nbytes, self.where(role))

    def master_is_params(self, compute_bytes: int) -> bool:
        """An fp32 master on the device is the parameters' own slice (nothing of its own)."""
        return compute_bytes == 4 and self.on_device(Role.MASTER) and not self.copied_master

    @property
    def splits_master(self) -> bool:
        """The group's master is kept split where it lives ([Note: sizing a split master])."""
        return master_kept_split(self.split_master, self.precision, self.params, self.where(Role.MASTER))

    def master_bytes(self, numel: int) -> int:
        """Bytes of the group's master buffer of ``numel`` elements (a partitioner's `buffers` asks):
        4 each, or 2.125 where `splits_master`."""
        return master_bytes(numel, self.splits_master)


@attrs.frozen(kw_only=True)
class SizedGroup:
    """One group as a partitioner lays it out on one rank."""

    numel: int  # its flat extent (alignment gaps included)
    shard: int  # elements of this rank's slice
    padded: int  # elements of the whole flat buffer (shard x shards)
    trainable: bool
    elements: int  # of its parameters alone
    params: int  # how many parameters it holds
    # Bound to a module whose forward gathers it (placed by tiers in the next forward's order).
    module_bound: bool = False


class PartitionSizing(abc.ABC):
    """A partitioner's layout of one model (``zkernel_size_partition``)."""

    groups: Sequence[SizedGroup]  # in the order it makes them
    # Its groups' indices in the next forward's order (the order tiers place spills in).
    forward_order: Sequence[int]
    # How many ways each group is divided (1: every rank holds all of it).
    shards: int = 1
    # The params tier owns its parameter shards (offload.params other than the compute device applies).
    shards_params: bool = False
    # Tiers that place at adopt see its groups bound to modules, in module order.
    binds_modules: bool = False
    # What it divides across ranks, of "optimizer_state", "grads", "params" (a planner tries the
    # partitioners that divide more later: they keep less, and communicate more).
    divides: tuple[str, ...] = ()
    # Each module's own parameters of at least this many elements are gathered at once (a layer
    # too large to gather is made smaller by tiling it); None: it gathers no module on its own.
    gather_threshold: int | None = None

    @abc.abstractmethod
    def buffers(self, group: SizedGroup, placement: Placement, compute_bytes: int) -> list[Buffer]:
        """The per-rank buffers of parameters, master and gradient it keeps for ``group`` where
        ``placement`` puts each role (the optimizer's state and staging copies are not its)."""

    @abc.abstractmethod
    def transient(self, group: SizedGroup, compute_bytes: int) -> tuple[int, int]:
        """(bytes it needs at once while it gathers or reduces ``group`` beyond its model states,
        of those the gathered parameters a prefetch may hold ahead)."""

    def frozen_buffers(self, compute_bytes: int) -> list[list[Buffer]]:
        """Buffers it keeps outside any group (frozen parameters kept whole): one list per tensor."""
        return []


# -- what a planner is handed ------------------------------------------------------------------


@attrs.frozen
class SpillCount:
    """What the spills take of one rank's trainable elements."""

    taken: dict[str, int]  # elements per spill option (the slices of the groups it takes)
    total: int  # what the fractions are of: this rank's trainable elements, unpadded
    groups: int  # its trainable groups


class SizingService(abc.ABC):
    """Bytes of a placement, put together from the components' answers (`zkernel.sizing.estimator`).

    Handed to a planner in `zkernel.spec.planner.PlanRequest.sizing`; ``config``
    arguments are concrete (no ``"auto"``) variants of the request's config.
    """

    @abc.abstractmethod
    def partition(self, config: Any, world_size: int, options: Any = None) -> PartitionSizing | None:
        """The selected partitioner's layout (None: it does not answer); ``options`` its validated options."""

    @abc.abstractmethod
    def tier(self, name: str, role: str, options: Mapping[str, Any] | None = None) -> TierSizing | None:
        """Tier ``name``'s answer for ``role`` with ``options`` (None: it does not answer or serve the role)."""

    @abc.abstractmethod
    def groups(
        self, config: Any, world_size: int, options: Any = None, *, shares: Mapping[str, float] | None = None
    ) -> list[list[Buffer]]:
        """Every group's per-rank buffers (then frozen tensors kept outside groups); ``shares`` the
        optimizer tier's spill fractions by option (none when None), instead of its options'."""

    @abc.abstractmethod
    def tally(
        self, groups: Sequence[Sequence[Buffer]], config: Any, device: str, staging_pool: int | None = None
    ) -> dict[str, dict[str, int]]:
        """Bytes by category and place (`DEVICE` named ``device``); ``staging_pool``: count host
        staging copies as that many buffers as large as the largest (None: as the config's
        optimizer tier lends them, its `TierSizing.staging_pool`), so every caller counts a
        placement's bytes alike."""

    @abc.abstractmethod
    def spill_count(
        self, config: Any, world_size: int, options: Any = None, *, shares: Mapping[str, float]
    ) -> SpillCount:
        """What each spill of ``shares`` takes ([Note: optimizer spill])."""


def totals(report: Mapping[str, Mapping[str, int]]) -> dict[str, int]:
    """Bytes by place, over every category of an estimate (or a `memory_report`)."""
    out: dict[str, int] = {}
    for by_place in report.values():
        for where, nbytes in by_place.items():
            out[where] = out.get(where, 0) + nbytes
    return out
