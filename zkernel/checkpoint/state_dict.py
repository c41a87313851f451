"""`Engine.state_dict` and `Engine.load_state_dict`: the plain model's state dict, both ways. Collective.

Group by group (the same order on every rank), each rank writes the fragments
it holds (the fp32 master of a trainable group, from the optimizer tier; the
values of a frozen one, from the params tier) into a zeroed buffer laid out as
the group's parameters end to end, and one all-reduce (a sum: every element
comes from exactly one rank) makes it whole everywhere; a replicated group
needs none. Each tensor is then cast to the dtype the model had at
`zkernel.initialize` and copied to the CPU, so the result has the plain
model's keys (tied ones included, sharing one tensor), shapes and dtypes, and
loads with ``load_state_dict(strict=True)``.

[Note: loading weights into a live engine] The way back writes a plain
model's tensors (all of them, or some: one file of a sharded safetensors
checkpoint at a time) into the engine, as FSDP's ``set_model_state_dict`` or
DeepSpeed's ``load_module_only``: pretrained weights into a model built on
the meta device, or a consolidated checkpoint's weights under a new
optimizer. Every rank passes the same keys; each rank checks them against
the model (names, shapes) and the ranks compare their verdicts and key sets
before anything changes, so a bad dict raises on every rank and changes
nothing. Then, per group holding a given parameter, the rank writes its own
fragments into the fp32 master (the optimizer tier's state otherwise kept
as it is: moments, step counts) or a frozen group's values, the parameter
shard takes the new master, and the partitioner refreshes its whole copies
(`zkernel_restore_state`, collective, for the groups touched, the same on
every rank). A tiled layer is given as the user wrote it and cut here
(`zkernel.param_map`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.modules.module import _IncompatibleKeys

from zkernel.checkpoint import extra_state
from zkernel.checkpoint.collective import exchange_json
from zkernel.checkpoint.model import BUFFER, EXTRA, PARAM, ModelView, view_of
from zkernel.checkpoint.shards import (
    check_between_steps,
    describe_error,
    describe_groups,
    kept_optimizer_state,
    whole_params,
)
from zkernel.param_map import ParamMap
from zkernel.tiers import ShardState


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


def load_full_state_dict(engine, state_dict: Mapping[str, Any], strict: bool = True) -> _IncompatibleKeys:
    """Write ``state_dict`` (the plain model's keys) into ``engine`` (see [Note: loading weights into a
    live engine]); returns the missing and unexpected keys, as ``nn.Module.load_state_dict``."""
    check_between_steps(engine, "load_state_dict")
    view = view_of(engine.module)
    targets = _UserKeys(engine, view)
    error = None
    try:
        missing, unexpected = targets.check(state_dict, strict)
    except (ValueError, TypeError) as exc:  # every rank must hear of it, or the others would wait
        error, missing, unexpected = exc, [], []
    digest = hashlib.sha256("\n".join(sorted(map(str, state_dict))).encode()).hexdigest()
    statuses = exchange_json({"error": describe_error(error) if error else None, "keys": digest}, engine.dist)
    failures = [f"rank {r}: {s['error']}" for r, s in enumerate(statuses) if s["error"]]
    if not failures and len({s["keys"] for s in statuses}) > 1:
        failures = ["the ranks passed different keys; every rank must pass the same state dict's keys"]
    if failures:
        raise RuntimeError("engine.load_state_dict changed nothing: " + "; ".join(failures)) from error
    values = targets.held_values(state_dict)
    groups = engine.groups
    layouts = describe_groups(engine.hook, groups, engine.config.partitioner)
    touched = []
    for group, layout in zip(groups, layouts):
        names = [view.names[id(p)] for p in group.params]
        if layout is None or not any(n in values for n in names):
            continue
        touched.append(group)
        _write_group(engine, group, layout, names, values)
    with torch.no_grad():
        for name in whole_params(view, groups, layouts):
            if name in values:
                view.params[name].data.copy_(values[name].view(view.params[name].shape))
        for name, buf in view.buffers.items():
            if name in values:
                buf.copy_(values[name].view(buf.shape))
    extras = {key: state_dict[key] for key in view.extra if key in state_dict}
    if extras:
        extra_state.restore(engine.module, extras)
    with engine.scheduler.plugin_call():
        for group in touched:
            engine.params_tier.to_device(group, consume=True, block=True)
            engine.hook.zkernel_restore_state(group=group)
            engine.params_tier.drop_device(group)
    return _IncompatibleKeys(missing, unexpected)


def _write_group(engine, group, layout, names: list[str], values: dict[str, torch.Tensor]) -> None:
    """This rank's fragments of the given parameters into ``group``'s master (or frozen values)."""
    if group.requires_grad:
        state = engine.optimizer_tier.read_state(group)
        target = state.master.detach().to("cpu", copy=True).reshape(-1)
        kept = kept_optimizer_state(state)
    else:
        target = engine.params_tier.read_shard(group).detach().to("cpu", copy=True).reshape(-1)
    for frag in layout.fragments:
        value = values.get(names[frag.param])
        if value is not None:
            target[frag.offset : frag.offset + frag.numel].copy_(value[frag.start : frag.start + frag.numel])
    if group.requires_grad:
        engine.optimizer_tier.write_state(group, ShardState(master=target, state=kept))
        engine.refresh_param_shard(group)
    else:
        engine.params_tier.write_shard(group, target)


class _UserKeys:
    """The plain model's state-dict keys, each with the held tensors it gives values to."""

    def __init__(self, engine, view: ModelView) -> None:
        self.pmap = ParamMap.of(engine.module)
        self.extra = view.extra
        # user key -> [(PARAM | BUFFER | EXTRA, canonical held name, region of the user's tensor)]
        self.parts: dict[str, list[tuple[str, str, tuple]]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for key, kind, source in view.keys:
            user, index = self.pmap.user_name(key) if kind == PARAM else (key, ())
            self.parts.setdefault(user, []).append((kind, source, index))
            composed = self.pmap.composed.get(user)
            if composed is not None:
                self.shapes[user] = tuple(composed.shape)
            elif kind == PARAM:
                original = engine.original_tensors.get(source)
                self.shapes[user] = tuple(original[0]) if original else tuple(view.params[source].shape)
            elif kind == BUFFER:
                self.shapes[user] = tuple(view.buffers[source].shape)

    def check(self, state_dict: Mapping[str, Any], strict: bool) -> tuple[list[str], list[str]]:
        """(missing, unexpected) keys; a wrong shape, a non-tensor value, or with ``strict`` a missing or
        unexpected key, is a `ValueError` naming them."""
        missing = [k for k in self.parts if k not in state_dict]
        unexpected = [k for k in state_dict if k not in self.parts]
        problems = []
        for key, value in state_dict.items():
            if key not in self.shapes:
                continue
            if not isinstance(value, torch.Tensor):
                problems.append(f"{key}: a {type(value).__name__}, not a tensor")
            elif tuple(value.shape) != self.shapes[key]:
                problems.append(f"{key}: shape {tuple(value.shape)} given, {self.shapes[key]} in the model")
        if strict and missing:
            problems.append(f"missing keys {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if strict and unexpected:
            problems.append(f"unexpected keys {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
        if problems:
            raise ValueError("state dict does not fit the model: " + "; ".join(problems))
        return missing, unexpected

    def held_values(self, state_dict: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Canonical held name -> its values as one flat CPU tensor (a tile cut from the user's tensor)."""
        out: dict[str, torch.Tensor] = {}
        for user, parts in self.parts.items():
            value = state_dict.get(user)
            if value is None:
                continue
            for kind, source, index in parts:
                if kind != EXTRA and source not in out:
                    out[source] = value.detach()[index].reshape(-1).cpu()
        return out
