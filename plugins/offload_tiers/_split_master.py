"""Split masters: a group's fp32 master kept as the low half beside its bf16 parameter shard.

[Note: split masters in the tiers] `zkernel.platform.split_master` keeps an
fp32 master as its bf16 rounding (the parameter) plus 2.125 bytes an element
([Note: the master's low half]). The host tiers use it where a group's
parameter shard is a bf16 tensor in memory (the GPU, or host memory under the
``cpu`` params tier; not a swap file): between steps the group holds only its
low half and tie bits (``group.master`` is None, as an ``nvme`` group's is; with
``split_master = true`` the ``nvme`` tier's swap files hold the same two parts in
place of the master, 10.1 bytes an element with Adam's moments instead of 12,
rebuilt from the block; ``"auto"`` keeps them whole, as the 15.4 B runs measured);
`lend` rebuilds the fp32 master into a buffer lent for the step, from the
shard as it is then, and `take_back` stores the stepped master's low half and
gives the buffer back. The step pipeline rounds every update into the shard
(``copy_out`` reaches it through the params tier's `commit`), so the shard
and the low half always describe one master. A host home whose shard is on
the GPU downloads the shard for each rebuild (2 bytes an element on the d2h
stream, after every upload queued on h2d, so a rollback's rebuild sees the
update it undoes); a home on the shard's own device reads it in place.

What it saves: 1.875 bytes an element wherever the master lives, host memory
for host-stepped groups and the GPU for the GPU share's, which lets more of a
large model's optimizer stay off the disk ([Note: spill] in ``nvme``).
What it costs each step: the download of the shard (host homes on CUDA), the
rebuild and the split (one pass each over the master, native on the CPU), and
one lent fp32 buffer as large as the largest group per group in flight.
Exact: the rebuilt master is the stored one, bit for bit.

Outside a step (main thread, between steps) `read` rebuilds a copy and `write`
stores a new master and rounds it into the shard first, so that anything that
rebuilds it next (the engine's `refresh_param_shard` reads the master back to
round it into the shard) sees the new one.
"""

from __future__ import annotations

import threading

import attrs
import torch

from zkernel.platform.host_memory import host_empty
from zkernel.platform.split_master import join_master, split_master, tie_bytes
from zkernel.platform.streams import record_event
from zkernel.spec import ConfigError, hookimpl, master_bytes
from zkernel.spec.tiers import ShardState

from ._state import write_optimizer_state
from .device import DeviceOptimizerTier, shares_storage

SPLIT_MASTER_CHOICES = ("auto", True, False)


def resolve_split(option, *, tier_default: bool) -> bool | None:
    """The tier's ``split_master`` option as a wish: True (asked for), None ("auto": where it applies,
    if ``tier_default``), False (never)."""
    if option == "auto":
        return None if tier_default else False
    return bool(option)


def why_not_split(group, compute_dtype: torch.dtype, numel: int | None = None) -> str | None:
    """Why ``group``'s master (of ``numel`` elements, default ``group.master``'s) cannot be kept
    split, or None when it can."""
    if compute_dtype != torch.bfloat16:
        return f"the run computes in {compute_dtype}, not bf16"
    shard = group.param_shard
    if shard is None:
        return "its parameter shard is not a tensor in memory (the params tier keeps it elsewhere, e.g. a swap file)"
    numel = group.master.numel() if numel is None else numel
    if shard.dtype != torch.bfloat16 or shard.numel() != numel or shares_storage(shard, group.master):
        return "its parameter shard is not a separate bf16 copy of the master"
    return None


def master_bytes_per_element(numel: int, split: bool | None, compute_dtype, shard_in_memory: bool) -> float:
    """Bytes per element of a host tier's ``numel`` master elements: 4, or a split master's where it
    applies (`zkernel.spec.master_bytes`; ``split`` as `resolve_split` gives it)."""
    applies = split is not False and compute_dtype == torch.bfloat16 and shard_in_memory and numel > 0
    return master_bytes(numel, applies) / numel if numel > 0 else 4.0


@attrs.define(eq=False)
class Halves:
    """A split master's stored parts: its low half (int16) and tie bits (uint8, `tie_bytes` of them)."""

    low: torch.Tensor
    ties: torch.Tensor
    numel: int


class SplitMasters:
    """Low halves of the masters of the groups a tier keeps split, on one device (see the module docstring).

    ``device`` is where the low halves and the lent masters live (the host for
    a host home, the GPU for the GPU share); ``pin`` page-locks host low halves
    and the download buffers. `keep` runs on the main thread at adoption;
    `lend` and `take_back` on the thread that steps the group; `read` and
    `write` on the main thread between steps.
    """

    def __init__(self, device: torch.device, *, pin: bool | None, streams) -> None:
        self.device = device
        self.pin = pin
        self.streams = streams
        self._halves: dict[int, Halves] = {}
        self._lent: dict[int, torch.Tensor] = {}  # group index -> the whole buffer its master is rebuilt in
        self._free: list[torch.Tensor] = []  # fp32 buffers of `_largest` elements, given back
        self._downloads: list[torch.Tensor] = []  # page-locked bf16 buffers a GPU shard is downloaded into
        self._largest = 0
        self.buffers = 0  # rebuild buffers allocated so far: the most masters lent at once
        self._lock = threading.Lock()
        self._stream = None  # the side stream shards are downloaded on (created on first use)
        self._written: dict[int, object] = {}  # group index -> event after this tier's last write of its shard

    def holds(self, group) -> bool:
        return group.index in self._halves

    def numel(self) -> int:
        """Elements of every master kept split."""
        return sum(h.numel for h in self._halves.values())

    # -- adoption (main thread) --------------------------------------------------------------------

    def keep(self, group) -> None:
        """Keep ``group.master`` (fp32) as its low half from now on; its shard takes the master's
        rounding (what it holds already, unless a caller changed one of them)."""
        master = group.master.detach().reshape(-1)
        numel = master.numel()
        halves = Halves(self._empty(numel, torch.int16), self._empty(tie_bytes(numel), torch.uint8), numel)
        split_master(master.to(self.device), halves.low, halves.ties)
        self._round_into_shard(group, master)
        self._halves[group.index] = halves
        self._largest = max(self._largest, numel)
        group.master = None

    @staticmethod
    def decide(group, wish: bool | None, compute_dtype: torch.dtype, tier: str) -> bool:
        """Whether ``group``'s master is kept split: where ``wish`` asks (True: or raise `ConfigError`
        where it cannot be; None: where it can be)."""
        if wish:
            check_split_possible(group, compute_dtype, tier)
            return True
        return wish is None and why_not_split(group, compute_dtype) is None

    def settle(self, group, wish: bool | None, compute_dtype: torch.dtype, tier: str) -> None:
        """Keep ``group``'s master split where `decide` says so."""
        if self.decide(group, wish, compute_dtype, tier):
            self.keep(group)

    def drop(self, group) -> torch.Tensor:
        """Stop keeping ``group`` split (it moves elsewhere): its fp32 master, rebuilt (main thread)."""
        master = self.read(group)
        del self._halves[group.index]
        return master

    # -- a step (the stepping thread) --------------------------------------------------------------

    def lend(self, group, halves: Halves | None = None) -> None:
        """Set ``group.master`` to its fp32 master rebuilt into a lent buffer (idempotent while lent), from
        its own halves, or from ``halves`` given (views of a swap file's block)."""
        if group.master is not None:
            return
        halves = halves or self._halves[group.index]
        with self._lock:
            buffer = self._free.pop() if self._free else None
        if buffer is None or buffer.numel() < halves.numel:  # (the GPU share's largest grows as groups move in)
            buffer = torch.empty(max(self._largest, halves.numel), dtype=torch.float32, device=self.device)
            self.buffers += 1
        out = buffer[: halves.numel]
        self._join(group, halves, out)
        self._lent[group.index] = buffer
        group.master = out

    def take_back(self, group, halves: Halves | None = None) -> None:
        """Store the stepped ``group.master``'s low half (into its own halves, or ``halves`` given) and take
        its buffer back."""
        if group.master is None:
            return
        halves = halves or self._halves[group.index]
        split_master(group.master, halves.low, halves.ties)
        self.forget(group)

    def forget(self, group) -> None:
        """Take back ``group``'s lent buffer without storing its master (a step not taken)."""
        group.master = None
        buffer = self._lent.pop(group.index, None)
        if buffer is None:
            return
        if buffer.device.type == "cuda":  # kernels queued on the stream may still read it
            buffer.record_stream(torch.cuda.current_stream(buffer.device))
        with self._lock:
            self._free.append(buffer)

    def expect(self, numel: int) -> None:
        """A group of ``numel`` elements will be rebuilt here (from halves kept elsewhere)."""
        self._largest = max(self._largest, numel)

    # -- outside a step (main thread) --------------------------------------------------------------

    def read(self, group, halves: Halves | None = None) -> torch.Tensor:
        """A copy of ``group``'s fp32 master, rebuilt from its shard as it is now (and its own halves, or
        ``halves`` given)."""
        if group.master is not None:  # lent
            return group.master.clone()
        halves = halves or self._halves[group.index]
        return self._join(group, halves, torch.empty(halves.numel, dtype=torch.float32, device=self.device))

    def write(self, group, master: torch.Tensor, halves: Halves | None = None) -> None:
        """Replace ``group``'s master with ``master`` (any device): its low half (into its own halves, or
        ``halves`` given), and its rounding in the shard."""
        halves = halves or self._halves[group.index]
        values = master.detach().reshape(-1).to(self.device, torch.float32)
        split_master(values, halves.low, halves.ties)
        self._round_into_shard(group, values)
        if group.master is not None:
            group.master.copy_(values)

    def tensors(self, group) -> list[torch.Tensor]:
        """What ``group``'s master takes between steps, for `zkernel_memory_tensors`: its low half and tie bits."""
        halves = self._halves[group.index]
        return [halves.low, halves.ties]

    def working(self) -> list[torch.Tensor]:
        """The buffers masters are rebuilt and shards downloaded into, lent or free (working memory)."""
        with self._lock:
            return [*self._free, *self._lent.values(), *self._downloads]

    def close(self) -> None:
        self._halves.clear()
        self._written.clear()
        with self._lock:
            self._lent.clear()
            self._free.clear()
            self._downloads.clear()

    # -- internals ---------------------------------------------------------------------------------

    def _empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self.device.type == "cpu":
            return host_empty(numel, dtype, pin=self.pin)
        return torch.empty(numel, dtype=dtype, device=self.device)

    def _join(self, group, halves: Halves, out: torch.Tensor) -> torch.Tensor:
        """Rebuild ``group``'s master into ``out`` from its shard (downloaded first when it is on the GPU
        and the halves on the host)."""
        shard = group.param_shard.reshape(-1)
        if shard.device == self.device:
            return join_master(shard, halves.low, halves.ties, out)
        if self.device.type != "cpu" or shard.device.type != "cuda":
            return join_master(shard.to(self.device), halves.low, halves.ties, out)
        with self._lock:
            buffer = self._downloads.pop() if self._downloads else None
        if buffer is None:
            buffer = host_empty(self._largest, torch.bfloat16, pin=True)
        try:
            high = buffer[: halves.numel]
            # [Note: the shard's download] Its own stream, not d2h: during backward d2h carries the
            # gradients, each queued behind the compute that makes it, and a speculative step's rebuild
            # would wait for the GPU to catch up. It waits for what may still write the shard: the
            # uploads of updates on h2d (a rollback rebuilds after the update it undoes) and this
            # tier's own last write (a checkpoint load, a folded write).
            if self._stream is None:
                self._stream = torch.cuda.Stream(shard.device)
            with torch.cuda.stream(self._stream):
                if self.streams.h2d is not None:
                    self._stream.wait_stream(self.streams.h2d)
                written = self._written.pop(group.index, None)
                if written is not None:
                    self._stream.wait_event(written)
                high.copy_(shard, non_blocking=True)
                done = record_event(self._stream)
            done.synchronize()
            return join_master(high, halves.low, halves.ties, out)
        finally:
            with self._lock:
                self._downloads.append(buffer)

    def _round_into_shard(self, group, master: torch.Tensor) -> None:
        shard = group.param_shard
        shard.reshape(-1).copy_(master.reshape(-1).to(shard.device).to(torch.bfloat16))
        if shard.device.type == "cuda":
            self._written[group.index] = record_event(torch.cuda.current_stream(shard.device))


def check_split_possible(group, compute_dtype: torch.dtype, tier: str) -> None:
    """An explicit ``split_master = true`` for a group that cannot be split is a configuration error."""
    why = why_not_split(group, compute_dtype)
    if why is not None:
        raise ConfigError(
            f"offload.optimizer_options.split_master = true, but group {group.name!r}'s master cannot be kept as "
            f"a low half beside its parameters: {why}; valid: \"auto\" (split where possible) or false ({tier} tier)"
        )


class SplitDeviceOptimizerTier(DeviceOptimizerTier):
    """The GPU share's inner device tier ([Note: GPU share]), keeping its masters split where asked.

    ``split``: True (asked for), None (where possible) or False (never). A group
    it adopts keeps its master as a low half on the GPU beside its bf16 shard;
    `acquire` (main thread, the device step) rebuilds it into a lent buffer and
    `release` stores it back, both on the compute stream.
    """

    def __init__(self, context, split: bool | None = False, tier: str = "cpu") -> None:
        super().__init__(context)
        self.split_wish = split
        self.tier = tier
        self.split = SplitMasters(context.device, pin=None, streams=context.streams) if split is not False else None

    def splits(self, group) -> bool:
        return self.split is not None and self.split.holds(group)

    def split_numel(self) -> int:
        """Elements of the masters kept split."""
        return self.split.numel() if self.split is not None else 0

    def adopt(self, group, master, state):
        super().adopt(group, master, state)
        if self.split is not None:
            self.split.settle(group, self.split_wish, self.compute_dtype, self.tier)

    def acquire(self, group):
        if self.splits(group):
            self.split.lend(group)
        super().acquire(group)

    def release(self, group):
        if self.splits(group):
            self.split.take_back(group)

    def read_master(self, group):
        return self.split.read(group) if self.splits(group) else group.master

    def read_state(self, group):
        return ShardState(master=self.read_master(group), state=dict(group.optim_state))

    def write_state(self, group, state):
        if not self.splits(group):
            return super().write_state(group, state)
        self.split.write(group, state.master)
        write_optimizer_state(group, state.state, self.split.device)

    @hookimpl
    def zkernel_memory_tensors(self, group):
        tensors = super().zkernel_memory_tensors(group)
        if tensors is not None and self.splits(group):
            tensors["master_weights"] = [*self.split.tensors(group), *self.split.working()]
        return tensors


class SplitMasterStats:
    """Split masters in a host tier (``_home`` a `HostPlacement`, ``_share`` a `GpuShare`): how the
    tier learns whether parameter shards are tensors, and what it reports of its split masters."""

    _shard_in_memory = True

    def pair(self, params_tier) -> None:
        self._shard_in_memory = params_tier.shard_in_memory

    @property
    def split_master_numel(self) -> int:
        """Master elements kept as low halves beside their parameter shard now ([Note: split masters in the
        tiers]), host-stepped and on the GPU."""
        return self._home.split_numel() + self._share.tier.split_numel() + self._stored_split_numel()

    def _stored_split_numel(self) -> int:
        """Split master elements kept elsewhere (the nvme tier's swap files)."""
        return 0

    @property
    def split_master_buffers(self) -> int:
        """fp32 buffers split masters have been rebuilt in so far: the most host groups lent at once."""
        return self._home.split.buffers if self._home.split is not None else 0
