"""Optimizer ``adamw``: torch's AdamW over each group's flat master shard, where it lives.

One `torch.optim.AdamW` functional call per group (the shard is one flat fp32
tensor), using the fused kernel where the device supports it, foreach
otherwise. The gradient coefficient (unscale times clip) is applied to the
gradient in place first; the fp32 result is copied into ``group.copy_out``
when the partitioner asked for a low-precision copy.
"""

from __future__ import annotations

import attrs
import torch
from torch.optim import adamw as torch_adamw

from zkernel import hookimpl
from zkernel.config import boolean, choice


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

    def _flags(self, device: torch.device) -> dict[str, bool]:
        impl = self.options.implementation
        if impl == "auto":
            impl = "fused" if _fused_supported(device) else "foreach"
        return {"fused": impl == "fused", "foreach": impl == "foreach"}

    @hookimpl
    def zkernel_step_optimizer(self, group, options) -> bool:
        master, grad = group.master, group.grad
        if grad.dtype != master.dtype or grad.device != master.device:
            grad = grad.to(device=master.device, dtype=master.dtype)
        if options.grad_scale != 1.0:
            grad.mul_(options.grad_scale)  # the partitioner zeroes group.grad after the step
        state = group.optim_state
        if not state:
            state["exp_avg"] = torch.zeros_like(master)
            state["exp_avg_sq"] = torch.zeros_like(master)
            state["step"] = torch.zeros((), dtype=torch.float32, device=master.device)
        beta1, beta2 = options.betas
        adam = torch_adamw.adamw if self.options.decoupled_weight_decay else _adam
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
            **self._flags(master.device),
        )
        if group.copy_out is not None:
            group.copy_out.copy_(master)
        return True


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
