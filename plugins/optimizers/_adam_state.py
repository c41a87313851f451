"""The state both Adam optimizers keep, declared the same way so a checkpoint of one resumes with the other."""

from __future__ import annotations

import torch

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


def rollback_possible(betas: tuple[float, float]) -> bool:
    """Adam's moments can be undone only when neither beta is 0 (the old moment is divided by it)."""
    return betas[0] > 0.0 and betas[1] > 0.0
