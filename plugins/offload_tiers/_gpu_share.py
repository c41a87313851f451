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
trainable elements to keep there, or ``"auto"`` (``cpu`` tier only): as many
as fit in 80% of the GPU memory the first step left unused, at 16 bytes per
element (master, two moments, gradient), beside the arena of [Note: device
accumulation].
"""

from __future__ import annotations

import torch

from zkernel.telemetry.log import get_logger

from .device import DeviceOptimizerTier

log = get_logger()

# Bytes per element of a group kept on the GPU: master, two moments, gradient.
SHARE_BYTES = 16


def unused_device_bytes(device: torch.device) -> int:
    """GPU memory the steps so far never reserved."""
    total = torch.cuda.get_device_properties(device).total_memory
    return max(0, total - torch.cuda.max_memory_reserved(device))


class GpuShare:
    """Which groups a host tier keeps on the GPU, and the inner device tier that holds them.

    The tier asks `holds` on every per-group call (any thread) and hands the
    call to `tier` for those groups. `takes` and `adopt` run on the main thread
    at `OptimizerTier.adopt`; `remember` records a host group's declared state
    in case `place` (main thread, `OptimizerTier.after_first_step`) moves it.
    """

    def __init__(self, context, option: float | str) -> None:
        self.tier = DeviceOptimizerTier(context)
        self.option = option
        self.device = context.device
        self.cuda = self.device.type == "cuda"
        self.numel = 0  # elements held on the GPU
        self.planned_numel = 0  # all trainable elements of this rank (`OptimizerTier.demand`)
        self._held: set[int] = set()
        self._state: dict[int, tuple] = {}  # declared optimizer state of host groups, to move them

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
        self.numel += master.numel()

    def remember(self, group, state) -> None:
        """``group`` steps on the host with this declared ``state``; `place` may move it later."""
        self._state[group.index] = tuple(state)

    def place(self, order, room: int, *, host_numel: int, arena_fraction: float) -> list:
        """Move the first-needed host groups within the share to the GPU; returns those moved now.

        ``"auto"`` fits the share and the accumulation arena into ``room`` together: an element moved
        costs 16 bytes and frees its 4 in the arena (``arena_fraction`` of the ``host_numel``
        host-stepped elements), which pays more per byte (it saves 16 bytes of host traffic per
        element and micro-batch, the share 30 per step)."""
        total = sum(g.master.numel() for g in order)
        if self.option == "auto":
            arena = 4 * arena_fraction
            budget = self.numel + int(max(0, room - arena * host_numel) // (SHARE_BYTES - arena))
        else:
            budget = int(self.option * total)
        moved = []
        for group in order:  # the next forward's order: the first-needed groups first
            numel = group.master.numel()
            if self.holds(group) or numel > budget - self.numel:
                continue
            self._move(group)
            self.numel += numel
            moved.append(group)
        log.info(
            "zkernel.cpu_tier.gpu_share",
            groups=len(self._held),
            numel=self.numel,
            fraction=round(self.numel / max(1, total), 4),
        )
        return moved

    def _move(self, group) -> None:
        """Master and state of a host group copied to the GPU and handed to the inner tier."""
        state = {k: v.to(self.device) for k, v in group.optim_state.items()}
        self.tier.adopt(group, group.master.to(self.device), self._state[group.index])
        for name, value in state.items():
            group.optim_state[name].copy_(value)
        self._held.add(group.index)
        group.grad = None

    def close(self) -> None:
        self._state.clear()


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
