"""`Engine.load_checkpoint`: every rank rebuilds its own shards from whichever files hold them.

Per group, in group order: the partitioner describes this rank's shard
(`zkernel_describe_shard`), the rank reads exactly those parameter element
ranges (master and optimizer state, or a frozen group's values) from the files
that hold them, whatever world size or partitioner wrote them, and hands them
to the optimizer tier (`OptimizerTier.write_state`) or the params tier
(`ParamsTier.write_shard`). Reads run one group ahead on a thread of their own,
into two alternating sets of page-aligned host buffers (page-locked with CUDA,
for fast uploads), so the disk keeps reading while the previous group is handed
to its tier. Parameters held whole and buffers are read whole.
These reads are local; the ranks then exchange their status, so an error on
one rank (a damaged file) raises on all of them before the partitioners
refresh their whole copies (`zkernel_restore_state`, collective). Counters,
the loss scale and this rank's RNG states come back last.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import torch

from zkernel.checkpoint import client_state as client, extra_state, rng
from zkernel.checkpoint.blockio import host_buffer
from zkernel.checkpoint.collective import exchange_json
from zkernel.checkpoint.format import REPLACED, CheckpointError, NoCheckpoint, parse_dtype
from zkernel.checkpoint.model import ModelView, view_of
from zkernel.checkpoint.recompose import StoredParams
from zkernel.checkpoint.reader import CheckpointIndex, ReadBatch, open_checkpoint
from zkernel.checkpoint.range_reader import RangeReader
from zkernel.checkpoint.shards import (
    check_between_steps,
    describe_error,
    describe_groups,
    state_specs,
    whole_params,
)
from zkernel.params.shard_values import kept_optimizer_state
from zkernel.spec.groups import ParamGroup, ShardLayout
from zkernel.telemetry.log import get_logger
from zkernel.params.param_map import ParamMap
from zkernel.telemetry.progress import progress
from zkernel.spec.tiers import ShardState

log = get_logger()


class LoadedCheckpoint(NamedTuple):
    """What `Engine.load_checkpoint` returns: the checkpoint directory it read and the ``client_state``
    saved with it ({} where none was), as DeepSpeed's ``load_path, client_state``."""

    path: Path
    client_state: dict[str, Any]

    @property
    def tag(self) -> str:
        return self.path.name.removesuffix(REPLACED)


def load(
    engine,
    directory: str | os.PathLike,
    tag: str | None = None,
    *,
    load_optimizer_states: bool = True,
    load_module_only: bool = False,
) -> LoadedCheckpoint | None:
    """Restore ``engine`` from ``directory`` (``tag``, or the latest); collective.

    ``load_optimizer_states=False`` keeps the engine's optimizer state (moments,
    step counts) and restores the rest; ``load_module_only=True`` restores the
    model's weights, buffers and extra state only (a fine-tuning start: the
    optimizer state, counters, loss scale and RNG states stay as they are).
    Without ``tag``, a directory with no ``latest`` file (or none at all) holds
    no checkpoint: every rank logs a WARNING and gets None, the engine as it
    was, as DeepSpeed's ``load_checkpoint`` warns and loads nothing (a script
    then starts from scratch). A named tag that is not there, or a damaged
    checkpoint, raises `CheckpointError`.
    """
    check_between_steps(engine, "load_checkpoint")
    started = time.perf_counter()
    error, index, touched, saved_client, written = None, None, [False], [{}], []
    optimizer_states = load_optimizer_states and not load_module_only
    try:
        for name, flag in (("load_optimizer_states", load_optimizer_states), ("load_module_only", load_module_only)):
            if not isinstance(flag, bool):
                raise TypeError(f"load_checkpoint's {name} must be True or False, not {flag!r}")
        index = open_checkpoint(Path(directory), tag)
        written = _read_everything(engine, index, touched, optimizer_states, saved_client)
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it, or the others would wait forever
        error = exc
    missing = isinstance(error, NoCheckpoint)
    status = {"error": describe_error(error), "missing": missing} if error is not None else {}
    statuses = exchange_json(status, engine.dist)
    if all(s.get("missing") for s in statuses):  # no rank found one: nothing to load, nothing changed
        log.warning("zkernel.checkpoint.none_to_load", rank=engine.dist.rank, path=str(directory), reason=str(error))
        return None
    failures = [f"rank {r}: {s['error']}" for r, s in enumerate(statuses) if "error" in s]
    if failures:
        where = index.dir if index is not None else Path(directory) / (tag or "latest")
        raise CheckpointError(
            f"loading checkpoint {where} failed; "
            + "; ".join(failures)
            + (
                ". The engine's parameters and optimizer state may be partly overwritten: load a checkpoint "
                "again or initialize a new engine"
                if touched[0]
                else ". The engine was not changed"
            )
        ) from error
    with engine.scheduler.plugin_call():
        for group in engine.groups:
            engine.params_tier.to_device(group, consume=True, block=True)
            engine.hook.zkernel_restore_state(group=group)
            engine.params_tier.drop_device(group)
    engine.unset.written(written)
    rank = engine.dist.rank
    if not load_module_only:
        engine.load_training_state(index.manifest["engine"])
        ranks = index.manifest["ranks"]
        if rank < len(ranks):
            rng.restore(ranks[rank]["rng"])
        else:
            log.info("zkernel.checkpoint.rng_kept", rank=rank, saved_world_size=len(ranks))
    log.info(
        "zkernel.checkpoint.loaded",
        rank=rank,
        path=str(index.dir),
        saved_world_size=index.manifest["world_size"],
        optimizer_states=optimizer_states,
        module_only=load_module_only,
        seconds=round(time.perf_counter() - started, 3),
    )
    return LoadedCheckpoint(index.dir, saved_client[0])


def _read_everything(
    engine, index: CheckpointIndex, touched: list[bool], optimizer_states: bool, saved_client: list[dict]
) -> list[str]:
    """Every group's shard (with its optimizer state, or the state the engine keeps), then whole
    parameters, buffers and modules' extra state, into this rank's tiers and modules (no collectives);
    the client state into ``saved_client[0]``. Returns the names of the parameters and buffers given values."""
    view = view_of(engine.module)
    stored = StoredParams(index, ParamMap.of(engine.module))
    _check_model(engine, view, index, stored)
    # Before anything changes, so a value weights_only loading refuses leaves the engine as it was.
    extras = _read_extra_state(view, index, engine.device)
    with RangeReader() as reader:
        saved_client[0] = client.read(index, reader, engine.device)
    groups = engine.groups
    layouts = describe_groups(engine.hook, groups, engine.config.partitioner)
    largest = max((layout.numel for layout in layouts if layout is not None), default=0)
    present = [(g, l) for g, l in zip(groups, layouts) if l is not None]
    wholes = whole_params(view, groups, layouts)
    with (
        RangeReader() as reader,
        ThreadPoolExecutor(1, thread_name_prefix="zkernel-checkpoint") as ahead,
        progress(len(present) + len(wholes) + len(view.buffers), "loading checkpoint", unit="tensor") as bar,
    ):
        loader = _ShardLoader(engine, view, stored, reader, largest, optimizer_states)
        applying = None  # group i is read on the thread while group i - 1 goes to its tier here
        for i, (group, layout) in enumerate(present):
            reading = ahead.submit(loader.read_group, group, layout, i % 2)
            if applying is not None:
                touched[0] = True
                applying.result()()
                bar.update(1)
            applying = reading
        if applying is not None:
            touched[0] = True
            applying.result()()
            bar.update(1)
        for name in wholes:
            if not stored.excluded(name):
                touched[0] = True
                loader.whole(name, view.params[name], stored.value_kind(name))
            bar.update(1)
        for name, buf in view.buffers.items():
            touched[0] = True
            loader.whole(name, buf, "buffer")
            bar.update(1)
    if extras:
        touched[0] = True
        extra_state.restore(engine.module, extras)
    return [*(name for name in view.params if not stored.excluded(name)), *view.buffers]


def _read_extra_state(view: ModelView, index: CheckpointIndex, device: torch.device) -> dict[str, Any]:
    values = {}
    with RangeReader() as reader:
        for key in view.extra:
            values[key] = extra_state.read(index, reader, key, device)
    return values


def _check_model(engine, view: ModelView, index: CheckpointIndex, stored: StoredParams) -> None:
    """The checkpoint's parameters and buffers must be this model's, with the same shapes. Parameters
    are compared as the user wrote them, so a checkpoint loads whatever either side's tiling ([Note:
    loading across compositions] in `zkernel.checkpoint.recompose`)."""
    held = {
        name: tuple(engine.original_tensors[name][0]) if name in engine.original_tensors else tuple(p.shape)
        for name, p in view.params.items()
    }
    buffers = {name: tuple(b.shape) for name, b in view.buffers.items()}
    stored_buffers = {name: tuple(b["shape"]) for name, b in index.buffers.items()}
    problems = []
    for kind, mine, theirs in (
        ("parameters", stored.user_shapes(held), stored.stored_user_shapes()),
        ("buffers", buffers, stored_buffers),
    ):
        missing = sorted(set(mine) - set(theirs))
        unexpected = sorted(set(theirs) - set(mine))
        if missing:
            problems.append(f"{kind} missing from the checkpoint: {missing[:5]}")
        if unexpected:
            problems.append(f"{kind} the model does not have: {unexpected[:5]}")
        for name in sorted(set(mine) & set(theirs)):
            if theirs[name] != mine[name]:
                problems.append(f"{name}: shape {theirs[name]} in the checkpoint, {mine[name]} in the model")
    trained = sorted(
        {stored.target.user_name(name)[0] for name, p in view.params.items() if p.requires_grad and stored.excluded(name)}
    )
    if trained:
        problems.append(
            f"parameters {trained[:5]} were frozen and left out of the checkpoint "
            "(save_checkpoint(exclude_frozen_parameters=True)), but this engine trains them; freeze them, or load "
            "their values with engine.load_state_dict after this load"
        )
    missing = sorted(set(view.extra) - set(index.extra_state))
    if missing:
        problems.append(f"modules' extra state (get_extra_state) missing from the checkpoint: {missing[:5]}")
    unexpected = sorted(set(index.extra_state) - set(view.extra))
    if unexpected:
        problems.append(f"extra state of modules the model does not have or that keep none: {unexpected[:5]}")
    if problems:
        raise CheckpointError(f"checkpoint {index.dir} does not match this model: " + "; ".join(problems[:8]))


class _ShardLoader:
    def __init__(
        self, engine, view: ModelView, stored: StoredParams, reader: RangeReader, largest: int, optimizer_states: bool
    ) -> None:
        self.engine = engine
        self.optimizer_states = optimizer_states
        self.view = view
        self.stored = stored
        self.index = index = stored.index
        self.reader = reader
        saved = index.manifest["optimizer_state"]
        self.saved_per_element = dict(saved.get("per_element", {}))
        self.saved_scalars = dict(saved.get("scalar", {}))
        self._warned = False
        self.buffers = _HostBuffers(largest)

    def read_group(self, group: ParamGroup, layout: ShardLayout, slot: int) -> Callable[[], None]:
        """Read this rank's shard of ``group`` into buffer set ``slot``; return what hands it to its tier."""
        names = [self.view.names[id(p)] for p in group.params]
        batch = ReadBatch(self.index)
        covered = sorted((f.offset, f.offset + f.numel) for f in layout.fragments)
        if not group.requires_grad:
            shard = group.param_shard
            dtype = shard.dtype if shard is not None else self.engine.compute_dtype
            values = self.buffers.get((slot, "param"), layout.numel, dtype, covered)
            kept = []  # fragments of parameters left out of the checkpoint: their values stay the engine's
            for frag in layout.fragments:
                name = names[frag.param]
                span = slice(frag.offset, frag.offset + frag.numel)
                if self.stored.excluded(name):
                    kept.append(span)
                    continue
                self.stored.add(batch, name, self.stored.value_kind(name), frag.start, values[span])
            if len(kept) == len(layout.fragments):
                return lambda: None
            batch.run(self.reader)

            def write_frozen() -> None:
                if kept:
                    current = self.engine.params_tier.read_shard(group).reshape(-1)
                    for span in kept:
                        values[span].copy_(current[span])
                self.engine.params_tier.write_shard(group, values)

            return write_frozen
        master = self.buffers.get((slot, "master"), layout.numel, torch.float32, covered)
        if not self.optimizer_states:  # the checkpoint's weights under the engine's own optimizer state
            for frag in layout.fragments:
                name = names[frag.param]
                span = slice(frag.offset, frag.offset + frag.numel)
                self.stored.add(batch, name, self.stored.value_kind(name), frag.start, master[span])
            batch.run(self.reader)

            def keep_state() -> None:
                kept = kept_optimizer_state(self.engine.optimizer_tier.read_state(group))
                self.engine.optimizer_tier.write_state(group, ShardState(master=master, state=kept))
                self.engine.refresh_param_shard(group)

            return keep_state
        specs = state_specs(self.engine, group, layout.numel)
        self._check_state(specs)
        state = {n: self.buffers.get((slot, n), layout.numel, d, covered) for n, d in specs.per_element.items()}
        for frag in layout.fragments:
            name = names[frag.param]
            span = slice(frag.offset, frag.offset + frag.numel)
            kind = self.stored.value_kind(name)
            self.stored.add(batch, name, kind, frag.start, master[span])
            if state and kind != "master":
                raise CheckpointError(
                    f"parameter {name!r} was frozen when checkpoint {self.index.dir} was saved, so it has no "
                    "optimizer state"
                )
            for state_name, tensor in state.items():
                self.stored.add(batch, name, f"state.{state_name}", frag.start, tensor[span])
        batch.run(self.reader)
        for state_name, dtype in specs.scalars.items():
            if state_name in specs.per_param:
                values = [self._saved_scalar(name, state_name, group) for name in names]
                state[state_name] = torch.tensor([v for _, v in values], dtype=torch.float64).to(dtype)
            else:
                state[state_name] = self._scalar(group, names, state_name, dtype)
        def hand_over() -> None:
            self.engine.optimizer_tier.write_state(group, ShardState(master=master, state=state))
            self.engine.refresh_param_shard(group)

        return hand_over

    def _check_state(self, specs) -> None:
        missing = [n for n in specs.per_element if n not in self.saved_per_element]
        missing += [n for n in specs.scalars if n not in self.saved_scalars]
        if missing:
            saved = sorted({*self.saved_per_element, *self.saved_scalars})
            optimizer = self.index.manifest.get("config", {}).get("optimizer", {}).get("name", "?")
            raise CheckpointError(
                f"the selected optimizer keeps state {missing}, which checkpoint {self.index.dir} (saved with "
                f"optimizer {optimizer!r}) does not have; it has {saved or 'no optimizer state'}"
            )
        extra = sorted({*self.saved_per_element, *self.saved_scalars} - {*specs.per_element, *specs.scalars})
        if extra and not self._warned:
            self._warned = True
            log.warning("zkernel.checkpoint.state_ignored", names=extra, reason="the selected optimizer keeps none")

    def _saved_scalar(self, name: str, state_name: str, group: ParamGroup) -> list:
        found = self.stored.scalar(name, state_name)
        if found is None:
            raise CheckpointError(
                f"optimizer state {state_name!r} of parameter {name!r} (group {group.name!r}) is missing in "
                f"checkpoint {self.index.dir}"
            )
        return found

    def _scalar(self, group: ParamGroup, names: list[str], state_name: str, dtype: torch.dtype) -> torch.Tensor:
        found = [self.stored.scalar(n, state_name) for n in set(names)]
        values = {repr(v) for v in found}
        if len(values) != 1 or found[0] is None:
            raise CheckpointError(
                f"optimizer state {state_name!r} of the parameters of group {group.name!r} is missing or differs "
                f"between them in checkpoint {self.index.dir} ({sorted(values)[:4]})"
            )
        saved_dtype, value = found[0]
        return torch.tensor(value, dtype=parse_dtype(saved_dtype, state_name)).to(dtype)

    def whole(self, name: str, tensor: torch.Tensor, kind: str) -> None:
        values = self.buffers.get("whole", tensor.numel(), tensor.dtype, [(0, tensor.numel())])
        batch = ReadBatch(self.index)
        if kind == "buffer":
            batch.add(name, kind, 0, values)
        else:
            self.stored.add(batch, name, kind, 0, values)
        batch.run(self.reader)
        with torch.no_grad():
            tensor.data.copy_(values.view(tensor.shape))


class _HostBuffers:
    """Page-aligned host buffers (page-locked with CUDA), reused from group to group.

    Each is sized for the largest shard on first use: page-locking costs about
    half a second per GiB, so it is done once, not again as groups grow.
    """

    def __init__(self, largest_numel: int) -> None:
        self._buffers: dict[object, torch.Tensor] = {}
        self.largest_numel = largest_numel

    def get(self, key: object, numel: int, dtype: torch.dtype, covered: list[tuple[int, int]]) -> torch.Tensor:
        """``numel`` elements of ``dtype``; those outside the ``covered`` (start, end) runs are zero (padding)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = numel * itemsize
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < nbytes:
            buf = self._buffers[key] = host_buffer(max(nbytes, self.largest_numel * itemsize, 1))
        out = buf[:nbytes].view(dtype)
        at = 0
        for start, end in covered:
            out[at:start].zero_()
            at = max(at, end)
        out[at:].zero_()
        return out
