"""The unit of dispatch: a group of parameters, and the values that cross hooks."""

from __future__ import annotations

import enum
from typing import Any

import attrs
import torch
from torch import nn


class Phase(enum.Enum):
    """Why a fetch or release hook fires (see `zkernel.hookspecs`)."""

    FORWARD = "forward"
    BACKWARD = "backward"
    GRADIENTS = "gradients"
    STEP = "step"
    # User code reads the parameters (`Engine.gathered_parameters`): tensors handed
    # out must stay valid after the release.
    USER = "user"


@attrs.define(eq=False)
class ParamGroup:
    """Parameters that are fetched, released, reduced and stepped together.

    Built by the partitioner in `zkernel_partition_params`. The kernel reads
    ``params``, ``module`` and ``requires_grad`` to install hooks, and
    ``master``/``grad``/``grad_is_shard`` to compute the gradient norm; the
    optimizer reads ``master``, ``grad``, ``optim_state`` and ``copy_out``.
    Everything under ``layout`` belongs to the partitioner that made the group.
    """

    index: int
    name: str
    params: tuple[nn.Parameter, ...]
    param_names: tuple[str, ...]
    requires_grad: bool
    # Module whose forward brackets fetch/release; None when the parameters stay whole.
    module: nn.Module | None = None
    # Whether ``params`` hold their whole values now (the partitioner keeps it current).
    gathered: bool = True
    # This rank's fp32 slice that the optimizer updates in place.
    master: torch.Tensor | None = None
    # Gradient for ``master``, same numel; complete once Phase.STEP was fetched.
    grad: torch.Tensor | None = None
    # True when ``grad`` is this rank's shard of the global gradient (so the
    # global norm needs an all-reduce); False when every rank holds it whole.
    grad_is_shard: bool = False
    # Low-precision tensor that receives the updated ``master``, or None.
    copy_out: torch.Tensor | None = None
    optim_state: dict[str, Any] = attrs.field(factory=dict)
    layout: Any = None

    @property
    def numel(self) -> int:
        """Elements of all parameters in the group, unsharded."""
        return sum(p.numel() for p in self.params) if self.layout is None else self.layout.numel


@attrs.frozen(kw_only=True)
class StepOptions:
    """Hyperparameters of one optimizer step, passed to `zkernel_step_optimizer`."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    # Multiply the gradient by this before use (loss-scale inverse times clip coefficient).
    grad_scale: float = 1.0
