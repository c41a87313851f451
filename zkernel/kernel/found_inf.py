"""A step's non-finite check kept on the device: a flag the optimizer honours there, the host reads one step late.

[Note: a non-finite flag read one step late] Where the host does not read the
global gradient norm at a boundary ([Note: non-finite gradients] in
`zkernel.kernel.step_scaling`: every group steps on a GPU, clipping off, no fp16),
a NaN or inf gradient is still never applied. One path does it:

1. at the end of a boundary backward the step pipeline sums the groups'
   squared gradient norms on the device (as the norm would be) and turns the
   sum into a one-element (0-dim) fp32 flag, 1.0 where it is not finite
   (`DeviceFlag`); with sharded gradients it is all-reduced (MAX) across
   ranks asynchronously: on NCCL the compute stream waits for the collective,
   the host does not (whole gradients are the same on every rank after their
   all-reduce, a NaN included);
2. every group's step gets the flag (``StepOptions.found_inf``); the optimizer
   (one that declared ``takes_found_inf``, as torch's fused Adam does with its
   ``found_inf``) makes its update a no-op on the device where it is set;
3. after the step the flag is copied, non-blocking, to pinned host memory,
   with an event (`LateRead`); the host waits for that event only when it
   next needs the answer: before the next step (whose learning rate follows
   the applied steps, ``global_steps - skipped_steps``, and whose Adam step
   counts follow the steps taken), and before anything reads the counters or
   the state (``skipped_steps``, ``lr`` under a schedule, ``state_dict``,
   checkpoints, `Engine.close`). Before the next step the device has long
   finished the one before, so the wait stalls nothing: the next forward and
   backward are queued behind it. (A script that reads ``skipped_steps``, or
   ``lr`` under a schedule, right after every ``step()`` brings the wait
   forward to there, the host sync the flag avoids; read them every few steps.)
4. a set flag then counts the step as skipped on every rank (``skipped_steps``,
   ``zkernel.step.nonfinite``) and each group's optimizer forgets the step's
   host bookkeeping (`zkernel_uncount_step`: its step counts go back), so
   every value and counter comes out as if the step had been skipped when it
   was taken; ``global_steps`` counts it either way, as a skipped step.

An optimizer that cannot honour the flag says so (``takes_found_inf`` False)
and the engine reads the norm instead, a host wait per step but exact. On a
CPU device the norm is free, so there the flag is used only where a test asks
for it (``engine.scaling.norm_is_free`` False), which runs this same path with a
synchronous copy and no event.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zkernel.spec.groups import ParamGroup, StepOptions

__all__ = ["DeviceFlag", "LateRead", "host_buffer"]


class DeviceFlag:
    """This boundary's flag on the device: 1.0 where some gradient on some rank is not finite.

    Built by `zkernel.kernel.step_pipeline.StepPipeline.end_backward` from the device sum of squared
    gradient norms; ``reduce``: all-reduce it (MAX: torch's fused kernels skip at exactly 1.0) across
    ranks, without a host wait."""

    def __init__(self, sq_norm: torch.Tensor, reduce: bool, device: torch.device) -> None:
        # ``device``: where the groups step (a window with no gradient at all sums to a host zero).
        sq_norm = sq_norm.to(device, non_blocking=True)
        self._tensor = torch.isfinite(sq_norm.reshape(()).float()).logical_not().float()
        self._work = dist.all_reduce(self._tensor, op=dist.ReduceOp.MAX, async_op=True) if reduce else None

    def ready(self) -> torch.Tensor:
        """The flag, to hand to the steps: the current stream waits for its all-reduce (on gloo the host)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._tensor


class LateRead:
    """The host's copy of a step's flag, and what to undo when it says the step was not applied.

    Made by the step pipeline after the step (``stepped``: each group given the flag, with its options);
    `is_set` waits for the copy only then ([Note: a non-finite flag read one step late]). ``host``: a
    pinned one-element fp32 buffer the copy lands in (reused: one read is pending at a time)."""

    def __init__(self, flag: torch.Tensor, stepped: list[tuple[ParamGroup, StepOptions]], host: torch.Tensor) -> None:
        self.stepped = stepped
        self._host = host
        self._event = None
        if flag.device.type == "cuda":
            host.copy_(flag, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            host.copy_(flag)

    def is_set(self) -> bool:
        """Whether the step's flag was set (waits for the copy's event, long done when asked for late)."""
        if self._event is not None:
            self._event.synchronize()
        return bool(self._host.item() != 0)


def host_buffer(device: torch.device) -> torch.Tensor:
    """A one-element fp32 host buffer for `LateRead`, pinned where the flag lives on a GPU."""
    return torch.zeros((), dtype=torch.float32, pin_memory=device.type == "cuda")
