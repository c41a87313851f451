"""The state both Adam optimizers keep, declared the same way so a checkpoint of one resumes with the other."""

from __future__ import annotations

import torch

from zkernel import adam_math, native
from zkernel.adam_math import check_rollback_possible
from zkernel.groups import OptimizerDeclaration, StateSpec


def adam_declaration(numel: int, can_rollback: bool) -> OptimizerDeclaration:
    """``exp_avg`` and ``exp_avg_sq`` (fp32, per element) and ``step`` (a 0-dim fp32 count)."""
    return OptimizerDeclaration(
        state=(
            StateSpec("exp_avg", torch.float32, (numel,)),
            StateSpec("exp_avg_sq", torch.float32, (numel,)),
            StateSpec("step", torch.float32, ()),
        ),
        can_rollback=can_rollback,
    )


def rollback_possible(config, decoupled: bool) -> bool:
    """Whether a step with the configured hyperparameters can be undone (see `zkernel.adam_math`)."""
    opt = config.optimizer
    try:
        check_rollback_possible(lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay, adamw=decoupled)
    except ValueError:
        return False
    return True


def rollback_group(group, options, decoupled: bool, native_kernel: bool) -> None:
    """Undo the last step of ``group`` and its step count: with the native kernel for a CPU master the
    native step updated (``native_kernel``), else in torch arithmetic (as torch's kernels stepped)."""
    state = group.optim_state
    step = int(state["step"].item())
    kwargs = dict(
        step=step,
        lr=options.lr,
        betas=options.betas,
        eps=options.eps,
        weight_decay=options.weight_decay,
        grad_scale=options.grad_scale,
        adamw=decoupled,
    )
    grad = group.grad
    if native_kernel and group.master.device.type == "cpu":
        if grad.device.type != "cpu":
            grad = grad.cpu()
        native.adam_rollback(group.master, grad, state["exp_avg"], state["exp_avg_sq"], **kwargs)
    else:
        adam_math.adam_rollback(
            group.master, grad.to(group.master.device, group.master.dtype), state["exp_avg"], state["exp_avg_sq"], **kwargs
        )
    state["step"].sub_(1)
