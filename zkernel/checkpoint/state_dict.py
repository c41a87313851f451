"""`Engine.state_dict`: the plain model's full state dict, from wherever the shards live. Collective.

Group by group (the same order on every rank), each rank writes the fragments
it holds (the fp32 master of a trainable group, from the optimizer tier; the
values of a frozen one, from the params tier) into a zeroed buffer laid out as
the group's parameters end to end, and one all-reduce (a sum: every element
comes from exactly one rank) makes it whole everywhere; a replicated group
needs none. Each tensor is then cast to the dtype the model had at
`zkernel.initialize` and copied to the CPU, so the result has the plain
model's keys (tied ones included, sharing one tensor), shapes and dtypes, and
loads with ``load_state_dict(strict=True)``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from zkernel.checkpoint.model import EXTRA, view_of
from zkernel.checkpoint.shards import check_between_steps, describe_groups, whole_params
from zkernel.param_map import ParamMap


def full_state_dict(engine) -> dict[str, Any]:
    check_between_steps(engine, "state_dict", boundary=False)
    view = view_of(engine.module)
    groups = engine.groups
    layouts = describe_groups(engine.hook, groups, engine.config.partitioner)
    original = engine.original_tensors
    distributed = engine.dist.distributed
    device = engine.device if distributed and dist.get_backend() == "nccl" else torch.device("cpu")
    values: dict[str, torch.Tensor] = {}

    def finish(name: str, tensor: torch.Tensor) -> None:
        shape, dtype = original.get(name, (tensor.shape, tensor.dtype))
        values[name] = tensor.detach().reshape(shape).to(device="cpu", dtype=dtype, copy=True)

    for group, layout in zip(groups, layouts):
        if layout is None:
            continue
        names = [view.names[id(p)] for p in group.params]
        numels = [_numel(original[n][0]) for n in names]
        offsets = [sum(numels[:i]) for i in range(len(numels))]
        if group.requires_grad:
            source = engine.optimizer_tier.read_state(group).master
        else:
            source = engine.params_tier.read_shard(group)
        dtype = torch.float32 if source.is_floating_point() else source.dtype
        flat = torch.zeros(sum(numels), dtype=dtype, device=device)
        source = source.reshape(-1)
        for frag in layout.fragments:
            at = offsets[frag.param] + frag.start
            flat[at : at + frag.numel].copy_(source[frag.offset : frag.offset + frag.numel])
        if distributed and not layout.replicated:
            dist.all_reduce(flat)
        for name, offset, numel in zip(names, offsets, numels):
            finish(name, flat[offset : offset + numel])
    for name in whole_params(view, groups, layouts):
        finish(name, view.params[name])
    for name, buf in view.buffers.items():
        finish(name, buf)
    held = {key: (view.extra[key] if kind == EXTRA else values[source]) for key, kind, source in view.keys}
    # A transform's pieces as the user's parameters ([Note: composed parameters] in `zkernel.param_map`).
    return ParamMap.of(engine.module).assemble(held)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
