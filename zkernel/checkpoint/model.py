"""The plain model as a checkpoint sees it: canonical names, state-dict keys, where each value lives.

A parameter tied under several names is stored once, under its first name in
``named_parameters()`` (its canonical name); the state dict's keys, in the
plain model's order, map each key to the canonical parameter or buffer it
shows, so a consolidated state dict has every key ``load_state_dict(strict=True)``
expects, tied ones included.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from torch import nn

from zkernel.checkpoint.format import CheckpointError
from zkernel.groups import ParamGroup, ShardLayout

PARAM, BUFFER, EXTRA = "param", "buffer", "extra"


@attrs.frozen
class ModelView:
    params: dict[str, nn.Parameter]  # canonical name -> parameter
    names: dict[int, str]  # id(parameter) -> canonical name
    buffers: dict[str, torch.Tensor]  # canonical name -> persistent buffer
    # (state-dict key, PARAM | BUFFER | EXTRA, canonical name or the key itself for EXTRA)
    keys: tuple[tuple[str, str, str], ...]
    extra: dict[str, Any]  # state-dict values that are neither (``get_extra_state``)


def view_of(module: nn.Module) -> ModelView:
    params = dict(module.named_parameters())
    names = {id(p): n for n, p in params.items()}
    buffer_names = {id(b): n for n, b in module.named_buffers()}
    keys, buffers, extra = [], {}, {}
    # keep_vars: the parameter objects themselves, read without any torch operation on them
    for key, value in module.state_dict(keep_vars=True).items():
        if isinstance(value, torch.Tensor) and id(value) in names:
            keys.append((key, PARAM, names[id(value)]))
        elif isinstance(value, torch.Tensor) and id(value) in buffer_names:
            name = buffer_names[id(value)]
            buffers[name] = value
            keys.append((key, BUFFER, name))
        else:
            extra[key] = value
            keys.append((key, EXTRA, key))
    return ModelView(params=params, names=names, buffers=buffers, keys=tuple(keys), extra=extra)


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
