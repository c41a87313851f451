"""What each rank holds of a checkpoint's parameters, and when a checkpoint may be taken.

Shared by saving, loading and `Engine.state_dict`: every group's `ShardLayout`
from its partitioner, the parameters held whole, the optimizer state a group
keeps (declared, or created lazily by the optimizer), and the quiescence check
(a checkpoint is taken between steps; a load at an accumulation boundary).
"""

from __future__ import annotations

import attrs
import torch

from zkernel.checkpoint.format import CheckpointError
from zkernel.checkpoint.model import ModelView
from zkernel.spec.groups import ParamGroup, ShardLayout


def check_between_steps(engine, what: str, boundary: bool = True) -> None:
    """Raise unless training is quiescent: no parameters gathered and, with ``boundary``, the
    accumulation window ended (a checkpoint does not hold half-accumulated gradients). Then wait
    for pending steps."""
    engine._check_open()
    if boundary and engine.micro_steps % engine.config.gradient_accumulation_steps:
        raise CheckpointError(
            f"engine.{what} must be called at an accumulation boundary (after the engine.step() of a "
            f"window's last micro-batch); {engine.micro_steps % engine.config.gradient_accumulation_steps} "
            f"of {engine.config.gradient_accumulation_steps} micro-batches of this window are done"
        )
    if any(g.gathered for g in engine.scheduler.bound):
        raise CheckpointError(
            f"engine.{what} cannot run between a forward and its backward or inside "
            "engine.gathered_parameters(); call it after engine.step()"
        )
    if not boundary and engine._backward_done:
        # At a boundary the optimizer may already be stepping groups (its steps start during backward).
        raise CheckpointError(
            f"engine.{what} cannot run between a backward and its engine.step(); call it after engine.step()"
        )
    engine.pipeline.wait_all()


def describe_error(exc: BaseException) -> str:
    """One line for another rank's error message (an `OSError` keeps its file name)."""
    text = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
    if isinstance(exc, OSError) and exc.filename and str(exc.filename) not in text:
        text += f" ({exc.filename})"
    return text


def describe_groups(hook, groups: list[ParamGroup], partitioner: str) -> list[ShardLayout | None]:
    """Each group's `ShardLayout` from the partitioner (None: a frozen group whose parameters stay whole)."""
    layouts = []
    for group in groups:
        layout = hook.zkernel_describe_shard(group=group)
        if layout is None and group.requires_grad:
            raise CheckpointError(
                f"partitioner {partitioner!r} does not describe its shard of group {group.name!r} "
                "(hook zkernel_describe_shard), so it cannot be checkpointed"
            )
        layouts.append(layout)
    return layouts


def whole_params(view: ModelView, groups: list[ParamGroup], layouts: list[ShardLayout | None]) -> list[str]:
    """Canonical names of parameters held whole on every rank: in no group, or in a group without a layout."""
    sharded = {id(p) for group, layout in zip(groups, layouts) if layout is not None for p in group.params}
    return [name for name, p in view.params.items() if id(p) not in sharded]


@attrs.frozen
class StateSpecs:
    """The optimizer state a trainable group keeps: per-element tensors and scalars, with dtypes.

    A checkpoint stores a scalar per parameter: a 0-dim state's value for each parameter of the
    group, a ``per_param`` state's (named in ``per_param``, also in ``scalars``) each its own."""

    per_element: dict[str, torch.dtype]
    scalars: dict[str, torch.dtype]
    per_param: frozenset[str] = frozenset()


def state_specs(engine, group: ParamGroup, numel: int) -> StateSpecs:
    """What the optimizer declared for a shard of ``numel`` elements, plus what it created lazily."""
    declared = engine.hook.zkernel_declare_optimizer(numel=numel, param_count=len(group.params))
    per_element, scalars, per_param = {}, {}, set()
    for spec in declared.state if declared is not None else ():
        (per_element if spec.per_element else scalars)[spec.name] = spec.dtype
        if spec.per_param:
            per_param.add(spec.name)
    for name, value in group.optim_state.items():
        if name in per_element or name in scalars or not isinstance(value, torch.Tensor):
            continue
        if value.dim() == 0:
            scalars[name] = value.dtype
        elif tuple(value.shape) == (numel,):
            per_element[name] = value.dtype
        else:
            raise CheckpointError(
                f"optimizer state {name!r} of group {group.name!r} has shape {tuple(value.shape)}: a checkpoint "
                f"re-shards only per-element state (shape ({numel},)), scalars and declared per-parameter state"
            )
    return StateSpecs(per_element, scalars, frozenset(per_param))
