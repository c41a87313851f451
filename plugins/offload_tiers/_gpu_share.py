"""The GPU share of a host tier: the optimizer of the groups the next forward needs first stays on the GPU.

[Note: GPU share] The next forward needs the first layers first, and their
gradients land last in backward, so their host steps finish last: on a PCIe
machine the host step is as long as a whole GPU step, and the forward stalls
on it. ``gpu_share`` keeps the optimizer of the groups the next forward needs
first on the GPU (Twin-Flow): they step there, in milliseconds, while the host
steps the rest. A numeric share is placed as groups are adopted (module-bound
groups come in module order, the next forward's order), so their host buffers
never exist; after the first step (when the landing order, and so the
forward's need order, and the step's peak GPU memory are known) the ``cpu``
tier moves more groups' masters and optimizer state to the GPU. Either way
they are handed to an inner ``none`` tier (`DeviceOptimizerTier`), which
then answers every call for them. ``gpu_share`` is the fraction of
trainable elements to keep there, or ``"auto"`` (the ``cpu`` tier's
default): as many as fit in 80% of the GPU memory the first step left
(`device_room`), at 16 bytes per element (master, two moments, gradient;
two more where the updated parameters must be rounded into a device buffer of
their own), beside the arena of [Note: device accumulation]. Without CUDA
``"auto"`` places nothing.

[Note: a share by default] ``"auto"`` is the default because the share is
what makes an offloaded optimizer fast (GPT-6.7B, optimizer on the CPU, one
H200: 7,435 tokens/s with no share, 10,913 with ``"auto"``, issue 46), and it
never takes memory a step needs: it is placed once the first step has run,
from what that step left, measured as the device's free memory plus what the
caching allocator holds beyond its peak (so other processes on the GPU, the
CUDA context and memory outside the allocator are left alone), and only 80%
of that, so a later step may peak a little higher (kernels choosing other
workspaces, the allocator splitting blocks differently). A group whose move
runs out of memory stays on the host, and so do the groups after it. What
cannot be known from the first step is a later step that needs more than it
did (longer sequences than the first batch's, an evaluation pass with a
larger batch between steps): give such a run a number (``0`` keeps every
group on the host).
"""

from __future__ import annotations

import torch

from zkernel.spec import master_bytes
from zkernel.telemetry.log import get_logger

from ._split_master import SplitDeviceOptimizerTier, why_not_split
from .device import shares_storage

log = get_logger()

# Bytes per element of a group kept on the GPU: master, two moments, gradient.
SHARE_BYTES = 16
# The part of the room the first step left (`device_room`) that "auto" shares and arenas take.
SIZED_FRACTION = 0.8


def device_room(free: int, reserved: int, peak_reserved: int) -> int:
    """Bytes a tier may still take on the GPU and leave every step the memory the steps so far took.

    ``free``: the device's free memory now (every process's allocations and the CUDA context
    excluded); ``reserved``: what this process's caching allocator holds now; ``peak_reserved``:
    the most it has held. A step that peaked at ``peak_reserved`` needs the allocator to grow back
    to it, so the room is what would be free then ([Note: a share by default])."""
    return max(0, free + reserved - peak_reserved)


def unused_device_bytes(device: torch.device) -> int:
    """`device_room` of ``device`` now; called by the host tiers at `OptimizerTier.after_first_step`."""
    free, _total = torch.cuda.mem_get_info(device)
    return device_room(free, torch.cuda.memory_reserved(device), torch.cuda.max_memory_reserved(device))


def auto_share_bytes(group, device: torch.device, compute_dtype: torch.dtype, *, split: bool = False, numel: int | None = None) -> float:
    """GPU bytes per element of ``group`` (of ``numel`` elements) once the share holds it: master, two
    moments and gradient (`SHARE_BYTES`; the master 2.125 instead of 4 where ``split`` keeps it as a
    low half, [Note: split masters in the tiers]), and a compute-dtype buffer for its updated
    parameters when their home is not on ``device`` (`update_target` allocates one)."""
    shard = group.param_shard
    numel = group.master.numel() if numel is None else numel
    per_element = float(SHARE_BYTES)
    if split and numel and why_not_split(group, compute_dtype, numel) is None:
        per_element -= 4 - master_bytes(numel, True) / numel
    if shard is None or compute_dtype == torch.float32 or shard.device == device or shares_storage(shard, group.master):
        return per_element
    return per_element + torch.empty((), dtype=compute_dtype).element_size()


def auto_share(groups, room: int, *, host_numel: int, arena_fraction: float, bytes_per_element, numel_of=None) -> list:
    """The groups of ``groups`` (in the next forward's order) that ``"auto"`` moves to the GPU within
    ``room`` bytes, beside the accumulation arena.

    The arena takes 4 bytes for ``arena_fraction`` of the ``host_numel`` host-stepped elements; a
    group moved costs ``bytes_per_element(group)`` per element and gives its 4 bytes of arena back.
    Groups are taken in order while they fit; one that does not is skipped (a later, smaller one
    may fit), as a numeric share's are. ``numel_of(group)``: its elements (default: its master's)."""
    numel_of = numel_of or (lambda g: g.master.numel())
    arena = 4 * arena_fraction
    left = room - arena * host_numel
    chosen = []
    for group in groups:
        cost = numel_of(group) * (bytes_per_element(group) - arena)
        if cost <= left:
            chosen.append(group)
            left -= cost
    return chosen


class GpuShare:
    """Which groups a host tier keeps on the GPU, and the inner device tier that holds them.

    The tier asks `holds` on every per-group call (any thread) and hands the
    call to `tier` for those groups. `takes` and `adopt` run on the main thread
    at `OptimizerTier.adopt`; `remember` records a host group's declared state
    in case `place` (main thread, `OptimizerTier.after_first_step`) moves it.
    """

    def __init__(self, context, option: float | str, *, split: bool | None = False, tier: str = "cpu") -> None:
        self.tier = SplitDeviceOptimizerTier(context, split, tier)
        self.split = split is not False and context.compute_dtype == torch.bfloat16  # (else never split)
        self.option = option
        self.compute_dtype = context.compute_dtype
        self.device = context.device
        self.cuda = self.device.type == "cuda"
        self.numel = 0  # elements held on the GPU
        self.planned_numel = 0  # all trainable elements of this rank (`OptimizerTier.demand`)
        self._held: set[int] = set()
        self._state: dict[int, tuple] = {}  # declared optimizer state of host groups, to move them
        self._numel: dict[int, int] = {}  # their elements (an nvme group's master is not in memory)

    def adopt_time_fraction(self) -> float:
        """A numeric share is placed as groups are adopted; "auto" (and no CUDA) places nothing then."""
        return self.option if self.cuda and self.option != "auto" else 0.0

    def holds(self, group) -> bool:
        return group.index in self._held

    def takes(self, group, numel: int) -> bool:
        """Module-bound groups come in module order, the next forward's order: the first ones
        within a numeric share stay on the GPU from the start."""
        budget = int(self.adopt_time_fraction() * self.planned_numel)
        return group.module is not None and numel <= budget - self.numel

    def adopt(self, group, master: torch.Tensor, state) -> None:
        self.tier.adopt(group, master, state)
        self._held.add(group.index)
        self._numel[group.index] = master.numel()  # (a split master is not in memory between steps)
        self.numel += master.numel()

    def remember(self, group, state) -> None:
        """``group`` steps on the host with this declared ``state``; `place` may move it later."""
        self._state[group.index] = tuple(state)
        self._numel[group.index] = group.master.numel()

    def numel_of(self, group) -> int:
        """Elements of ``group``'s master, wherever it is (every group this share adopted or was told of)."""
        return self._numel[group.index]

    def place(self, order, room: int, *, host_numel: int, arena_fraction: float, load=None) -> list:
        """Move the first-needed host groups within the share to the GPU; returns those moved now.

        ``"auto"`` fits the share and the accumulation arena into ``room`` together (`auto_share`):
        an element moved costs 16 bytes and frees its 4 in the arena (``arena_fraction`` of the
        ``host_numel`` host-stepped elements), which pays more per byte (it saves 16 bytes of host
        traffic per element and micro-batch, the share 30 per step). A move that runs out of GPU
        memory leaves that group and the rest on the host ([Note: a share by default]). ``load(group)``,
        when given, brings a group's master and state into host memory before it moves (the ``nvme``
        tier's groups on disk)."""
        total = sum(self.numel_of(g) for g in order)
        waiting = [g for g in order if not self.holds(g)]  # the next forward's order: first-needed first
        if self.split and waiting:  # the buffer a split master is rebuilt into for its step
            room -= 4 * max(self.numel_of(g) for g in waiting)
        if self.option == "auto":
            wanted = auto_share(
                waiting, room, host_numel=host_numel, arena_fraction=arena_fraction,
                bytes_per_element=self.bytes_per_element, numel_of=self.numel_of,
            )
        else:
            left, wanted = int(self.option * total) - self.numel, []
            for group in waiting:
                if self.numel_of(group) <= left:
                    wanted.append(group)
                    left -= self.numel_of(group)
        moved = []
        for group in wanted:
            try:
                if load is not None:
                    load(group)
                self._move(group)
            except torch.OutOfMemoryError:
                log.warning("zkernel.cpu_tier.gpu_share_stopped", group=group.index, moved=len(moved), reason="out of GPU memory")
                break
            self.numel += self.numel_of(group)
            moved.append(group)
        log.info(
            "zkernel.cpu_tier.gpu_share",
            groups=len(self._held),
            numel=self.numel,
            fraction=round(self.numel / max(1, total), 4),
        )
        return moved

    def bytes_per_element(self, group) -> float:
        """GPU bytes per element ``group`` takes once the share holds it (`auto_share_bytes`)."""
        return auto_share_bytes(group, self.device, self.compute_dtype, split=self.split, numel=self.numel_of(group))

    def _move(self, group) -> None:
        """Master and state of a host group copied to the GPU and handed to the inner tier. Every
        device buffer is allocated before the group changes hands, so running out of memory
        leaves it on the host as it was."""
        state = {k: v.to(self.device) for k, v in group.optim_state.items()}
        master = group.master.to(self.device)
        host_master, host_state = group.master, group.optim_state
        try:
            self.tier.adopt(group, master, self._state[group.index])
        except torch.OutOfMemoryError:
            group.master, group.optim_state = host_master, host_state
            raise
        for name, value in state.items():
            group.optim_state[name].copy_(value)
        self._held.add(group.index)
        group.grad = None

    def close(self) -> None:
        self._state.clear()
        self._numel.clear()


class ShareRouting:
    """The gradient side of a host tier with a GPU share, the same for the ``cpu`` and ``nvme`` tiers.

    A tier that holds a `GpuShare` as ``_share`` and a `HostLanding` as
    ``_landing`` takes these methods: a group the share holds is answered by
    the share's inner device tier, every other one by the host landing. They
    carry no state of their own (the parts do), so the tiers still compose
    their parts; this only keeps the routing in one place. ``land`` runs on
    autograd's thread, ``flush`` and ``grad_sq_norm`` on the main thread.
    """

    @property
    def gpu_share_numel(self) -> int:
        """Trainable elements whose optimizer is on the GPU ([Note: GPU share])."""
        return self._share.numel

    def land(self, group, reduced, final):
        if self._share.holds(group):
            return self._share.tier.land(group, reduced, final)
        self._landing.land(group, reduced, final)

    def flush(self):
        self._landing.flush()
        self._share.tier.flush()

    def grad_sq_norm(self, groups):
        out = self._share.tier.grad_sq_norm([g for g in groups if self._share.holds(g)])
        return self._landing.sq_norms(groups, out)

    def steps_on_host(self, group):
        return not self._share.holds(group)

    def read_grad(self, group):
        if self._share.holds(group):
            return self._share.tier.read_grad(group)
        return self._landing.read(group)
