"""Optimizer ``adamw``: torch's AdamW over each group's flat master shard, where it lives.

One `torch.optim.AdamW` functional call per group (the shard is one flat fp32
tensor), using the fused kernel where the device supports it, foreach
otherwise, on the GPU or on the CPU (with an offloaded master: a valid, slower
choice than ``cpu_adam``). The gradient is multiplied by the step's
coefficient (unscale times clip) into a temporary, never in place, so a step
can be rolled back from the same gradient; the fp32 result is copied into
``group.copy_out`` when the tier asked for a low-precision copy.
"""

from __future__ import annotations

import attrs
import torch
from torch.optim import adamw as torch_adamw

from zkernel import hookimpl
from zkernel.config import boolean, choice

from ._adam_state import adam_declaration, rollback_group, rollback_possible


@attrs.frozen(kw_only=True)
class AdamWOptions:
    """Extra keys of ``[optimizer]`` for ``adamw``."""

    # "auto" picks fused where the device supports it, else foreach.
    implementation: str = attrs.field(default="auto", validator=choice("auto", "fused", "foreach", "for_loop"))
    # False gives Adam with L2 regularisation instead of decoupled weight decay.
    decoupled_weight_decay: bool = attrs.field(default=True, validator=boolean())


def _fused_supported(device: torch.device) -> bool:
    return device.type in ("cuda", "cpu") and hasattr(torch, "_fused_adamw_")


class TorchAdamW:
    """Steps each group's master shard with torch's AdamW kernels."""

    def __init__(self, context) -> None:
        self.options = context.options or AdamWOptions()
        self._can_rollback = rollback_possible(context.config, self.options.decoupled_weight_decay)

    @hookimpl
    def zkernel_declare_optimizer(self, numel):
        return adam_declaration(numel, can_rollback=self._can_rollback)

    @hookimpl
    def zkernel_rollback_optimizer(self, group, options):
        rollback_group(group, options, self.options.decoupled_weight_decay, native_kernel=False)
        return True

    @hookimpl
    def zkernel_step_optimizer(self, group, options) -> bool:
        torch_adam_step(group, options, self.options.implementation, self.options.decoupled_weight_decay)
        return True


def torch_adam_step(group, options, implementation: str = "auto", decoupled: bool = True) -> None:
    """One torch Adam/AdamW update of ``group.master`` (any device), ``group.grad`` read only."""
    master, grad = group.master, group.grad
    if grad.dtype != master.dtype or grad.device != master.device:
        grad = grad.to(device=master.device, dtype=master.dtype)
    if options.grad_scale != 1.0:
        grad = grad * options.grad_scale
    state = group.optim_state
    if not state:  # a tier that does not allocate declared state
        state["exp_avg"] = torch.zeros_like(master)
        state["exp_avg_sq"] = torch.zeros_like(master)
        state["step"] = torch.zeros((), dtype=torch.float32, device=master.device)
    if implementation == "auto":
        implementation = "fused" if _fused_supported(master.device) else "foreach"
    beta1, beta2 = options.betas
    adam = torch_adamw.adamw if decoupled else _adam
    adam(
        [master],
        [grad],
        [state["exp_avg"]],
        [state["exp_avg_sq"]],
        [],
        [state["step"]],
        amsgrad=False,
        beta1=beta1,
        beta2=beta2,
        lr=options.lr,
        weight_decay=options.weight_decay,
        eps=options.eps,
        maximize=False,
        fused=implementation == "fused",
        foreach=implementation == "foreach",
    )
    if group.copy_out is not None:
        group.copy_out.copy_(master)


def _adam(*args, **kwargs):
    from torch.optim import adam as torch_adam

    return torch_adam.adam(*args, **kwargs)


@hookimpl
def zkernel_register_optimizers(registry) -> None:
    registry.add(
        "adamw",
        TorchAdamW,
        description="torch AdamW (fused/foreach) on the device where the master shard lives",
        options_cls=AdamWOptions,
    )
