"""Optimizer ``adamw``: AdamW over each group's flat master shard, where it lives.

On a GPU with Triton, one kernel per group reads the gradient, scales it by
the step's coefficient (unscale times clip) in registers, updates the master
and moments and writes the low-precision copy the tier asked for
(``group.copy_out``) in the same pass (`_triton_adam`, [Note: Adam at
bandwidth]). Elsewhere, or with ``implementation`` set, one
`torch.optim.AdamW` functional call per group (the shard is one flat fp32
tensor): fused where the device supports it, foreach otherwise, on the GPU or
on the CPU (with an offloaded master: a valid, slower choice than
``cpu_adam``); there the gradient is multiplied by the coefficient into a
temporary and the result copied into ``copy_out`` after. The gradient is never
changed in place, so a step can be rolled back from it. A group whose
parameters are at different step counts or have hyperparameters of their own
(rate, weight decay, betas, eps), or some of which are skipped this step, takes
one call per run of the shard at one count with one set of hyperparameters
([Note: per-parameter steps] in ``_adam_state``).

A step given a device flag (``StepOptions.found_inf``, [Note: a non-finite
flag read one step late] in `zkernel.kernel.found_inf`) changes nothing where
the flag is set: torch's fused kernels take it as their ``found_inf``, the
Triton kernel masks every load and store with it. The foreach and for-loop
kernels cannot, so an ``adamw`` that would use them declares it does not take
the flag, and the engine reads the norm on the host instead.
"""

from __future__ import annotations

import attrs
import torch
from torch.optim import adamw as torch_adamw

from zkernel.spec import PER_PARAM_HYPER, hookimpl
from zkernel.spec.options import boolean, choice

from . import _triton_adam
from ._adam_state import (
    StepCounts,
    adam_declaration,
    init_state,
    kernel_arguments,
    rollback_group,
    rollback_possible,
    step_group,
    uncount_group,
)


@attrs.frozen(kw_only=True)
class AdamWOptions:
    """Extra keys of ``[optimizer]`` for ``adamw``."""

    # "auto" picks the Triton kernel on a GPU where Triton imports, else torch's fused where the
    # device supports it, else foreach.
    implementation: str = attrs.field(default="auto", validator=choice("auto", "triton", "fused", "foreach", "for_loop"))
    # False gives Adam with L2 regularisation instead of decoupled weight decay.
    decoupled_weight_decay: bool = attrs.field(default=True, validator=boolean())


def _fused_supported(device: torch.device) -> bool:
    return device.type in ("cuda", "cpu") and hasattr(torch, "_fused_adamw_")


class TorchAdamW:
    """Steps each group's master shard with torch's AdamW kernels."""

    def __init__(self, context) -> None:
        self.options = context.options or AdamWOptions()
        self._step_counts = StepCounts()
        self._device = context.dist.device if getattr(context, "dist", None) is not None else torch.device("cpu")

    @hookimpl
    def zkernel_declare_optimizer(self, numel, param_count):
        return adam_declaration(numel, param_count, can_rollback=True, takes_found_inf=self._takes_found_inf())

    def _takes_found_inf(self) -> bool:
        """Whether the kernel this optimizer runs on the compute device can honour a device flag."""
        implementation = self.options.implementation
        if implementation == "auto":
            return _triton_adam.available(self._device) or _fused_supported(self._device)
        return implementation in ("triton", "fused")

    @hookimpl
    def zkernel_uncount_step(self, group, options):
        uncount_group(group, options, self._step_counts)
        return True

    @hookimpl
    def zkernel_can_rollback_step(self, group, options):
        return rollback_possible(group, options, self.options.decoupled_weight_decay)

    @hookimpl
    def zkernel_rollback_optimizer(self, group, options):
        rollback_group(group, options, self.options.decoupled_weight_decay, native_kernel=False, counts=self._step_counts)
        return True

    @hookimpl
    def zkernel_step_optimizer(self, group, options) -> bool:
        implementation = self.options.implementation
        device = group.master.device
        if implementation == "triton" or (implementation == "auto" and _triton_adam.available(device)):
            if not _triton_adam.available(device):
                raise RuntimeError(
                    f'optimizer.implementation = "triton" needs a CUDA master and Triton; the master of '
                    f'{group.name!r} is on {device}; use "auto", "fused" or "foreach"'
                )
            self._triton_step(group, options)
        else:
            torch_adam_step(group, options, self._step_counts, implementation, self.options.decoupled_weight_decay)
        return True

    def _triton_step(self, group, options) -> None:
        if not group.optim_state:
            init_state(group)

        found_inf = options.found_inf
        if found_inf is not None:
            found_inf = found_inf.to(device=group.master.device, dtype=torch.float32, non_blocking=True)

        def update(run, t) -> None:
            _triton_adam.adam_step(
                t["master"],
                t["grad"],
                t["exp_avg"],
                t["exp_avg_sq"],
                **kernel_arguments(run, options, self.options.decoupled_weight_decay),
                copy_out=t["copy_out"],
                found_inf=found_inf,
            )

        grad = group.grad if group.grad.device == group.master.device else group.grad.to(group.master.device)
        step_group(group, options, self._step_counts, update, grad)


def torch_adam_step(group, options, counts: StepCounts, implementation: str = "auto", decoupled: bool = True) -> None:
    """One torch Adam/AdamW update of ``group.master`` (any device), ``group.grad`` read only, run by
    run (see [Note: per-parameter steps])."""
    master = group.master
    if not group.optim_state:
        init_state(group)
    if implementation == "auto":
        implementation = "fused" if _fused_supported(master.device) else "foreach"
    adam = torch_adamw.adamw if decoupled else _adam
    fused = implementation == "fused"
    found_inf = options.found_inf
    if found_inf is not None and not fused:
        raise RuntimeError(
            f"group {group.name!r} was given a non-finite flag (StepOptions.found_inf), which the "
            f"{implementation!r} AdamW kernels on {master.device} cannot honour; only the fused and Triton "
            "kernels can (the optimizer declares takes_found_inf only for those)"
        )
    if found_inf is not None:
        found_inf = found_inf.to(device=master.device, dtype=torch.float32, non_blocking=True)

    def update(run, t) -> None:
        beta1, beta2 = run.betas(options)
        grad = t["grad"]
        if grad.dtype != master.dtype or grad.device != master.device:
            grad = grad.to(device=master.device, dtype=master.dtype)
        if options.grad_scale != 1.0:
            grad = grad * options.grad_scale
        # torch counts the step itself: it adds one to this before the update (and takes the flag
        # back off after). Its fused kernels read the count on the device, the others on the host.
        step = torch.full((), run.step - 1, dtype=torch.float32, device=master.device if fused else "cpu")
        adam(
            [t["master"]],
            [grad],
            [t["exp_avg"]],
            [t["exp_avg_sq"]],
            [],
            [step],
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=run.lr(options),
            weight_decay=run.weight_decay(options),
            eps=run.eps(options),
            maximize=False,
            fused=fused,
            foreach=implementation == "foreach",
            found_inf=found_inf,
        )
        if t["copy_out"] is not None:
            t["copy_out"].copy_(t["master"])

    step_group(group, options, counts, update)


def _adam(*args, **kwargs):
    from torch.optim import adam as torch_adam

    return torch_adam.adam(*args, **kwargs)


@hookimpl
def zkernel_register_optimizers(registry) -> None:
    registry.add(
        "adamw",
        TorchAdamW,
        description="AdamW (Triton/fused/foreach) on the device where the master shard lives",
        options_cls=AdamWOptions,
        capabilities=(PER_PARAM_HYPER,),
    )
