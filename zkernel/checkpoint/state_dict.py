"""`Engine.state_dict` and `Engine.load_state_dict`: the plain model's state dict, both ways. Collective.

Group by group (the same order on every rank), each rank writes the fragments
it holds (the fp32 master of a trainable group, from the optimizer tier; the
values of a frozen one, from the params tier) into a zeroed buffer laid out as
the group's parameters end to end, and one all-reduce (a sum: every element
comes from exactly one rank) makes it whole everywhere; a replicated group
needs none. Each tensor is then cast to the dtype the model had at
`zkernel.initialize` and copied to the CPU, so the result has the plain
model's keys (tied ones included, sharing one tensor), shapes and dtypes, and
loads with ``load_state_dict(strict=True)``. With ``rank0_only`` the sums are
reductions to rank 0, and only rank 0 builds and returns the dict (the
others return ``{}``), so a job's host memory holds the model once.

[Note: a state dict without the frozen parameters] With
``exclude_frozen_parameters`` the parameters that do not require grad are
neither gathered nor returned (buffers and trainable parameters are): an
adapter (LoRA) over a frozen base is a few megabytes of a model that may not
fit in one host's memory, and saving it (``PeftModel.save_pretrained`` keeps
the adapter's keys only) needs nothing of the base. A group is frozen or
trainable as a whole, so whole groups are skipped, with their collectives;
every rank skips the same ones.

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
(`zkernel.params.param_map`).

With ``broadcast_from_rank0`` (FSDP's option of that name) only rank 0 reads
a dict: it checks it and tells the others its keys and dtypes with its
verdict; then each user tensor is broadcast from rank 0 when the group (or
whole parameter, or buffer) it feeds is written, so the other ranks never
read the files and hold at most one group's tensors at a time.
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
from zkernel.checkpoint.format import dtype_name, parse_dtype
from zkernel.checkpoint.model import BUFFER, EXTRA, PARAM, ModelView, view_of
from zkernel.checkpoint.shards import (
    check_between_steps,
    describe_error,
    describe_groups,
    whole_params,
)
from zkernel.params.shard_values import read_shard_values, write_shard_values
from zkernel.telemetry.log import get_logger
from zkernel.params.param_map import ParamMap

log = get_logger()


def full_state_dict(engine, rank0_only: bool = False, exclude_frozen_parameters: bool = False) -> dict[str, Any]:
    check_between_steps(engine, "state_dict", boundary=False)
    view = view_of(engine.module)
    # [Note: a state dict without the frozen parameters]
    left_out = {n for n, p in view.params.items() if not p.requires_grad} if exclude_frozen_parameters else set()
    groups = engine.groups
    layouts = describe_groups(engine.hook, groups, engine.config.partitioner)
    original = engine.original_tensors
    distributed = engine.dist.distributed
    keeps = engine.dist.rank == 0 or not rank0_only  # whether this rank returns the tensors
    device = engine.device if distributed and dist.get_backend() == "nccl" else torch.device("cpu")
    values: dict[str, torch.Tensor] = {}

    def finish(name: str, tensor: torch.Tensor) -> None:
        shape, dtype = original.get(name, (tensor.shape, tensor.dtype))
        values[name] = tensor.detach().reshape(shape).to(device="cpu", dtype=dtype, copy=True)

    for group, layout in zip(groups, layouts):
        if layout is None or (layout.replicated and not keeps) or (left_out and not group.requires_grad):
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
            if rank0_only:
                dist.reduce(flat, dst=0)
            else:
                dist.all_reduce(flat)
        if keeps:
            for name, offset, numel in zip(names, offsets, numels):
                finish(name, flat[offset : offset + numel])
    if not keeps:
        return {}
    for name in whole_params(view, groups, layouts):
        if name not in left_out:
            finish(name, view.params[name])
    for name, buf in view.buffers.items():
        finish(name, buf)
    held = {
        key: (view.extra[key] if kind == EXTRA else values[source])
        for key, kind, source in view.keys
        if not (kind == PARAM and source in left_out)
    }
    # A transform's pieces as the user's parameters ([Note: composed parameters] in `zkernel.params.param_map`).
    return ParamMap.of(engine.module).assemble(held)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def load_full_state_dict(
    engine, state_dict: Mapping[str, Any] | None, strict: bool = True, broadcast_from_rank0: bool = False
) -> _IncompatibleKeys:
    """Write ``state_dict`` (the plain model's keys) into ``engine`` (see [Note: loading weights into a
    live engine]); returns the missing and unexpected keys, as ``nn.Module.load_state_dict``. With
    ``broadcast_from_rank0`` only rank 0's dict is read and its tensors reach the others one at a time."""
    check_between_steps(engine, "load_state_dict")
    view = view_of(engine.module)
    targets = _UserKeys(engine, view)
    info = engine.dist
    from_rank0 = broadcast_from_rank0 and info.distributed
    reads = info.rank == 0 or not from_rank0  # whether this rank's state_dict is read
    error, missing, unexpected, given, extras_given = None, [], [], [], []
    if reads:
        try:
            if not isinstance(state_dict, Mapping):
                raise TypeError(f"state_dict must be a mapping of names to tensors, not a {type(state_dict).__name__}")
            missing, unexpected = targets.check(state_dict, strict)
            given = [[key, dtype_name(value.dtype)] for key, value in state_dict.items() if key in targets.shapes]
            extras_given = [key for key in view.extra if key in state_dict]
        except (ValueError, TypeError) as exc:  # every rank must hear of it, or the others would wait
            error = exc
    keys = hashlib.sha256("\n".join(sorted(map(str, state_dict or ()))).encode()).hexdigest() if reads else None
    message = {"error": describe_error(error) if error else None, "keys": keys}
    if from_rank0 and info.rank == 0:
        message.update(given=given, extras=extras_given, missing=missing, unexpected=unexpected)
    statuses = exchange_json(message, info)
    failures = [f"rank {r}: {s['error']}" for r, s in enumerate(statuses) if s["error"]]
    if not failures and len({s["keys"] for s in statuses if s["keys"] is not None}) > 1:
        failures = ["the ranks passed different keys; every rank must pass the same state dict's keys (or pass "
                    "broadcast_from_rank0=True and the dict on rank 0 only)"]  # fmt: skip
    if failures:
        raise RuntimeError("engine.load_state_dict changed nothing: " + "; ".join(failures)) from error
    if from_rank0:
        first = statuses[0]
        missing, unexpected = first["missing"], first["unexpected"]
        values = _RankZeroValues(engine, targets, first["given"], first["extras"], state_dict if info.rank == 0 else None)
    else:
        values = _LocalValues(targets, state_dict)
    if info.rank == 0 and unexpected and len(unexpected) == len(state_dict or ()):
        _warn_nothing_matched(unexpected, missing)
    groups = engine.groups
    layouts = describe_groups(engine.hook, groups, engine.config.partitioner)
    touched = []
    for group, layout in zip(groups, layouts):
        names = [view.names[id(p)] for p in group.params]
        if layout is None or not any(values.has(n) for n in names):
            continue
        touched.append(group)
        _write_group(engine, group, layout, names, values.get(names))
    with torch.no_grad():
        wholes = [n for n in whole_params(view, groups, layouts) if values.has(n)]
        for name, value in values.get(wholes).items():
            view.params[name].data.copy_(value.view(view.params[name].shape))
        buffers = values.get([n for n in view.buffers if values.has(n)])
        for name, value in buffers.items():
            view.buffers[name].copy_(value.view(view.buffers[name].shape))
    extras = values.extra_state()
    if extras:
        extra_state.restore(engine.module, extras)
    with engine.scheduler.plugin_call():
        for group in touched:
            engine.params_tier.to_device(group, consume=True, block=True)
            engine.hook.zkernel_restore_state(group=group)
            engine.params_tier.drop_device(group)
    engine.unset.written(values.source)
    return _IncompatibleKeys(missing, unexpected)


def _warn_nothing_matched(given: list[str], expected: list[str]) -> None:
    """A non-strict load none of whose keys is the model's writes nothing; say so instead of staying silent
    (a wrapper's prefix, PEFT's ``base_model.model.``, is the usual cause)."""
    log.warning(
        "zkernel.load_state_dict.no_key_matched",
        given=len(given),
        given_keys=given[:3],
        model_keys=expected[:3],
        advice="none of the state dict's keys is one of the model's, so nothing was loaded; rename the keys "
        "to the model's (engine.state_dict().keys())",
    )


def _write_group(engine, group, layout, names: list[str], values: dict[str, torch.Tensor]) -> None:
    """This rank's fragments of the given parameters into ``group``'s master (or frozen values)."""
    target, kept = read_shard_values(engine, group)
    for frag in layout.fragments:
        value = values.get(names[frag.param])
        if value is not None:
            target[frag.offset : frag.offset + frag.numel].copy_(value[frag.start : frag.start + frag.numel])
    write_shard_values(engine, group, target, kept)


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

    def sources(self, given) -> dict[str, str]:
        """Canonical held name -> the user key among ``given`` its values come from (the first of
        tied keys)."""
        out: dict[str, str] = {}
        for user in self.parts:
            if user in given:
                for kind, source, _ in self.parts[user]:
                    if kind != EXTRA:
                        out.setdefault(source, user)
        return out

    def cut(self, user: str, value: torch.Tensor, wanted) -> dict[str, torch.Tensor]:
        """The held tensors among ``wanted`` that user key ``user`` gives values to, each as one flat CPU
        tensor (a tile cut from the user's tensor)."""
        return {
            source: value.detach()[index].reshape(-1).cpu()
            for kind, source, index in self.parts[user]
            if kind != EXTRA and source in wanted
        }


class _LocalValues:
    """The held tensors' new values from this rank's own state dict."""

    def __init__(self, targets: _UserKeys, state_dict: Mapping[str, Any]) -> None:
        self.targets = targets
        self.state_dict = state_dict
        self.source = targets.sources(state_dict)

    def has(self, name: str) -> bool:
        return name in self.source

    def get(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The new values of the held tensors among ``names`` that the state dict gives, by held name."""
        wanted = {n for n in names if n in self.source}
        out: dict[str, torch.Tensor] = {}
        for user in dict.fromkeys(self.source[n] for n in names if n in wanted):
            for name, value in self.targets.cut(user, self._value(user), wanted).items():
                out.setdefault(name, value)
        return out

    def _value(self, user: str) -> torch.Tensor:
        return self.state_dict[user]

    def extra_state(self) -> dict[str, Any]:
        """Modules' extra state (``<module>._extra_state`` keys) given in the state dict."""
        return {key: self.state_dict[key] for key in self.targets.extra if key in self.state_dict}


class _RankZeroValues(_LocalValues):
    """The held tensors' new values from rank 0's state dict, each user tensor broadcast when a group
    (or a whole parameter, a buffer) needs it: a rank holds at most one group's tensors at a time."""

    def __init__(
        self, engine, targets: _UserKeys, given: list, extras: list[str], state_dict: Mapping[str, Any] | None
    ) -> None:
        self.dtypes = {key: parse_dtype(name, f"rank 0's state dict: {key}") for key, name in given}
        super().__init__(targets, self.dtypes)  # the keys rank 0 gave, known on every rank
        self.state_dict = state_dict
        self.extras = extras
        self.rank = engine.dist.rank
        self.device = engine.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def _value(self, user: str) -> torch.Tensor:
        """User key ``user``'s tensor from rank 0 (collective: every rank asks for the same keys in order)."""
        if self.rank == 0:
            value = self.state_dict[user].detach().to(self.device).contiguous()
        else:
            value = torch.empty(self.targets.shapes[user], dtype=self.dtypes[user], device=self.device)
        dist.broadcast(value, src=0)
        return value

    def extra_state(self) -> dict[str, Any]:
        if not self.extras:
            return {}
        box = [{key: self.state_dict[key] for key in self.extras} if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, device=self.device)  # objects of this job's rank 0, not of a file
        return box[0]
