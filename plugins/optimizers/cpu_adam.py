"""Optimizer ``cpu_adam``: the native SIMD, multi-threaded Adam/AdamW over CPU shards.

Each group's master shard is one flat fp32 CPU tensor, so a step is one call
(one per run of parameters at one step count and hyperparameters, see [Note: per-parameter steps]
in ``_adam_state``) into `zkernel.platform.native.adam_step`, which in a single pass over memory widens a
bf16 gradient (or reads an fp32 one), multiplies it by the step's gradient
coefficient (unscale times clip), applies Adam or AdamW, writes the moments and
the fp32 master, and rounds the new master into ``group.copy_out`` (bf16/fp16)
when there is one. That pass moves about 28 bytes per parameter (bf16 in and
out), against about 48 for torch's sequence of upcast, scale, fused AdamW and
down-cast. ``group.grad`` is only read, never scaled in place.

A group whose master the tier keeps on the GPU (the GPU share of an
offloaded optimizer) is stepped with torch's fused AdamW there: the same math.

State per group (``group.optim_state``): ``exp_avg`` and ``exp_avg_sq`` fp32
CPU tensors and ``step``, one fp32 count per parameter (see [Note: per-parameter
steps] in ``_adam_state``), the same keys and types as the ``adamw`` optimizer
keeps, so a checkpoint of one resumes with the other.
"""

from __future__ import annotations

import attrs
import torch

from zkernel.spec import PER_PARAM_HYPER, hookimpl
from zkernel.platform import native
from zkernel.spec.options import boolean, integer
from zkernel.telemetry.log import get_logger

from ._adam_state import (
    StepCounts,
    adam_declaration,
    init_state,
    kernel_arguments,
    rollback_group,
    rollback_possible,
    step_group,
)
from .adamw import torch_adam_step

log = get_logger()


@attrs.frozen(kw_only=True)
class CpuAdamOptions:
    """Extra keys of ``[optimizer]`` for ``cpu_adam``."""

    # False gives Adam with L2 regularisation instead of decoupled weight decay.
    decoupled_weight_decay: bool = attrs.field(default=True, validator=boolean())
    # Threads of the native kernel; None uses every usable core (or ZKERNEL_NATIVE_THREADS).
    threads: int | None = attrs.field(default=None, validator=integer(minimum=1, optional=True))


class CpuAdam:
    """Steps each group's CPU master shard with the native Adam kernel."""

    def __init__(self, context) -> None:
        self.options = (context.options if context is not None else None) or CpuAdamOptions()
        native.load()  # fail at selection time, naming the build step, if unbuilt
        self._step_counts = StepCounts()

    @hookimpl
    def zkernel_declare_optimizer(self, numel, param_count):
        return adam_declaration(numel, param_count, can_rollback=True)

    @hookimpl
    def zkernel_can_rollback_step(self, group, options):
        return rollback_possible(group, options, self.options.decoupled_weight_decay)

    @hookimpl
    def zkernel_rollback_optimizer(self, group, options):
        rollback_group(group, options, self.options.decoupled_weight_decay, native_kernel=True, counts=self._step_counts)
        return True

    @hookimpl
    def zkernel_step_optimizer(self, group, options) -> bool:
        master = group.master
        if master.device.type == "cuda":
            torch_adam_step(group, options, self._step_counts, "auto", self.options.decoupled_weight_decay)
            return True
        if master.device.type != "cpu":
            raise RuntimeError(
                f"cpu_adam steps master shards on the CPU (natively) or on a GPU (with torch's fused "
                f"AdamW), but group {group.name!r} keeps its master shard on {master.device}; "
                'use offload.optimizer = "cpu" or optimizer name "adamw"'
            )
        if not group.optim_state:
            init_state(group)
            log.debug("zkernel.cpu_adam.state_created", group=group.name, numel=master.numel())

        def update(run, t) -> None:
            native.adam_step(
                t["master"],
                t["grad"],
                t["exp_avg"],
                t["exp_avg_sq"],
                **kernel_arguments(run, options, self.options.decoupled_weight_decay),
                copy_out=t["copy_out"],
                threads=self.options.threads,
            )

        grad = group.grad
        step_group(group, options, self._step_counts, update, grad if grad.device.type == "cpu" else grad.to("cpu"))
        return True


@hookimpl
def zkernel_register_optimizers(registry) -> None:
    registry.add(
        "cpu_adam",
        CpuAdam,
        description="native SIMD multi-threaded Adam/AdamW on CPU shards (fused bf16 grads in, bf16 params out)",
        options_cls=CpuAdamOptions,
        capabilities=(PER_PARAM_HYPER,),
    )
