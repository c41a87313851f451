"""The unit of dispatch: a group of parameters, and the values that cross hooks and threads."""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

import attrs
import torch
from torch import nn


class Phase(enum.Enum):
    """Why a fetch or release hook fires (see `zkernel.spec.hookspecs`)."""

    FORWARD = "forward"
    BACKWARD = "backward"
    # User code reads the parameters (`Engine.gathered_parameters`): tensors handed
    # out must stay valid after the release.
    USER = "user"


@attrs.define(eq=False)
class ParamGroup:
    """Parameters that are fetched, released, reduced and stepped together.

    Built by the partitioner in `zkernel_partition_params`. The kernel reads
    ``params``, ``module`` and ``requires_grad`` to install hooks. The buffers of
    a trainable group have owners (DESIGN.md, "Placement"):

    * the partitioner sets ``param_shard`` (the compute-dtype shard this rank
      gathers from, or None when it gathers by casting a master that lives on
      the compute device) and hands the initial fp32 ``master`` values over;
      the params tier then decides where the shard lives (``param_shard``) and
      brings it to the compute device as ``device_shard`` when a gather needs it;
    * the optimizer tier then places ``master``, allocates ``optim_state`` from
      the optimizer's declaration, owns the landing buffer of ``grad``, and sets
      ``copy_out`` (or leaves it None for a params tier whose home is not a
      tensor, which lends one per step: `ParamsTier.before_update`);
    * the optimizer reads ``master``, ``grad``, ``optim_state`` and ``copy_out``.

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
    # Gradient for ``master``, same numel; complete once the window's last gradient landed.
    grad: torch.Tensor | None = None
    # True when ``grad`` is this rank's shard of the global gradient (so the
    # global norm needs an all-reduce); False when every rank holds it whole.
    grad_is_shard: bool = False
    # Low-precision tensor that receives the updated ``master``, or None.
    copy_out: torch.Tensor | None = None
    # Home of the compute-dtype shard, placed by the params tier (see the class docstring).
    param_shard: torch.Tensor | None = None
    # The shard on the compute device, ready in the current stream's order, while the params
    # tier has it there (set by the kernel before a gather; the partitioner reads it).
    device_shard: torch.Tensor | None = None
    optim_state: dict[str, Any] = attrs.field(factory=dict)
    # What this rank's shard holds, set by the kernel from `zkernel_describe_shard` when the group
    # is placed (None for a partitioner that does not describe it); optimizers read it to step
    # some parameters of the group and not others (``StepOptions.skip_params``).
    shard_layout: ShardLayout | None = None
    # Positions in ``params`` of the parameters stepped with hyperparameters of their own, set by the
    # kernel when the group is placed ([Note: per-parameter hyperparameters] in `zkernel.kernel.param_hyper`).
    param_hyper: dict[int, ParamHyper] = attrs.field(factory=dict)
    layout: Any = None

    @property
    def numel(self) -> int:
        """Elements of the group, unsharded: its parameters' and, in a partitioner's flat layout,
        the alignment gaps between them."""
        return sum(p.numel() for p in self.params) if self.layout is None else self.layout.numel


class ReducedGradient(NamedTuple):
    """A gradient shard the partitioner reduced, handed to the optimizer tier.

    Returned by `zkernel_reduce_gradients`; the tier must not read ``tensor``
    before ``work`` completed (``work.wait()``: on NCCL a stream dependency, on
    gloo a host wait) and must keep ``keepalive`` referenced until then.
    """

    tensor: torch.Tensor  # fp32, same numel as the group's master, on the compute device
    work: Any  # a collective's handle, or None when ``tensor`` is ready in stream order
    accumulate: bool  # add to the window's earlier contributions; False for the window's first
    keepalive: Any = None  # the collective's inputs


@attrs.frozen
class StateSpec:
    """One tensor of optimizer state, declared up front (`zkernel_optimizer_state`)."""

    name: str
    dtype: torch.dtype
    # () for a scalar, (numel,) for per-element state, (len(group.params),) for per-parameter state.
    shape: tuple[int, ...]
    # One value per parameter of the group (a step count, as torch keeps one per parameter): a
    # checkpoint stores each parameter's own value, so it loads into any grouping.
    per_param: bool = False

    @property
    def per_element(self) -> bool:
        return self.shape != () and not self.per_param

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * torch.empty((), dtype=self.dtype).element_size()


@attrs.frozen
class OptimizerDeclaration:
    """What an optimizer declares up front for a group (`zkernel_declare_optimizer`)."""

    state: tuple[StateSpec, ...]
    # Whether `zkernel_rollback_optimizer` can undo a step (enables speculative steps).
    can_rollback: bool = False
    # Whether the optimizer leaves the parameters in ``StepOptions.skip_params`` as they are itself
    # (keeping per-parameter state such as step counts); otherwise the kernel puts their elements
    # of the master, the per-element state and the copy-out back after the step.
    skips_params: bool = False
    # Whether the optimizer steps the parameters in ``ParamGroup.param_hyper`` with their own learning
    # rate scale, weight decay, betas and eps; `zkernel.initialize` refuses ``[optimizer] param_groups``
    # and ``no_weight_decay`` for one that does not.
    per_param_hyper: bool = False
    # Whether `zkernel_step_optimizer` honours ``StepOptions.found_inf`` (a step that is a no-op on the
    # device where the flag is set, never read on the host) and `zkernel_uncount_step` forgets such a
    # step's bookkeeping. Where an optimizer does not, the engine reads the global gradient norm on the
    # host at every boundary instead ([Note: a non-finite flag read one step late] in
    # `zkernel.kernel.found_inf`).
    takes_found_inf: bool = False


@attrs.frozen
class ParamHyper:
    """Hyperparameters of one parameter that differ from the step's (`StepOptions`).

    Set by `zkernel.kernel.param_hyper` from ``[[optimizer.param_groups]]``; an optimizer that declares
    ``per_param_hyper`` reads them through the accessors, which fall back to the step's values."""

    lr_scale: float = 1.0  # times the step's learning rate
    weight_decay: float | None = None  # None: the step's
    betas: tuple[float, float] | None = None  # None: the step's (a schedule's, when it sets them)
    eps: float | None = None  # None: the step's

    def lr(self, options: StepOptions) -> float:
        return options.lr * self.lr_scale

    def decay(self, options: StepOptions) -> float:
        return options.weight_decay if self.weight_decay is None else self.weight_decay

    def betas_for(self, options: StepOptions) -> tuple[float, float]:
        return options.betas if self.betas is None else self.betas

    def eps_for(self, options: StepOptions) -> float:
        return options.eps if self.eps is None else self.eps


@attrs.frozen(kw_only=True)
class StepOptions:
    """Hyperparameters of one optimizer step, passed to `zkernel_step_optimizer`."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    # Multiply the gradient by this before use (loss-scale inverse times clip coefficient).
    grad_scale: float = 1.0
    # Positions in ``group.params`` of parameters no rank gave a gradient in this window: their
    # elements and state stay as they are, as torch's optimizers skip a parameter whose ``grad`` is
    # None (see [Note: parameters without a gradient] in `zkernel.kernel.unused_params`).
    skip_params: frozenset[int] = frozenset()
    # None, or a one-element float32 tensor on the device the group steps on, computed there and not yet
    # known on the host: nonzero where some gradient of this step, on some rank, is not finite. Then the
    # step must change nothing (master, state, ``copy_out``), decided on the device, as torch's fused
    # Adam does with its ``found_inf``; the kernel tells the optimizer later, through
    # `zkernel_uncount_step`, to forget the step's host bookkeeping (step counts). Given only to an
    # optimizer that declared ``takes_found_inf``.
    found_inf: torch.Tensor | None = attrs.field(default=None, eq=False)


@attrs.frozen
class Fragment:
    """A run of one parameter's elements that a rank's flat shard of a group holds.

    The checkpoint keys data by parameter and element offset, never by group:
    elements ``[start, start + numel)`` of ``group.params[param]`` (flattened,
    row-major) sit at ``[offset, offset + numel)`` of this rank's shard tensors
    (the fp32 master, each per-element optimizer state, the parameter shard).
    """

    param: int  # index into ``group.params``
    start: int  # first element within the flattened parameter
    numel: int
    offset: int  # first element within this rank's shard


@attrs.frozen
class ShardLayout:
    """What this rank's shard of a group holds (`zkernel_describe_shard`)."""

    # Elements of the shard tensors (padding included), e.g. ``group.master.numel()``.
    numel: int
    # Every parameter element the shard holds, once; padding is in none of them.
    fragments: tuple[Fragment, ...]
    # Every rank holds the same shard (plain data parallel): only rank 0 writes it.
    replicated: bool = False
