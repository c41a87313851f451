"""`Engine.save_checkpoint`: every rank writes its own shards; rank 0 commits with the manifest.

[Note: commit protocol] A save runs in phases separated by one small
all-gather of JSON (`exchange_json`), so a failure on any rank reaches every
rank instead of leaving some waiting in a collective:

1. rank 0 creates ``DIR/<tag>.incomplete/`` (removing leftovers of saves that
   died) and tells everyone whether that worked;
2. every rank streams its shards into ``rank<r>.safetensors`` there (temporary
   name, preallocated so a full disk fails before any data moves, fsync,
   rename) and reports its file's checksums, its fragments, the optimizer's
   scalar state and its RNG states, or its error;
3. rank 0 writes ``manifest.json`` (sealed with its own checksum: [Note: sealed
   JSON] in `zkernel.checkpoint.sealed`; temporary name, fsync, rename),
   renames the directory to ``DIR/<tag>/`` (an existing ``<tag>`` is first
   renamed to ``<tag>.replaced``, which a load falls back to, and removed
   after), fsyncs ``DIR`` and replaces ``DIR/latest`` atomically, with
   ``DIR/latest.checksum`` in step, then tells everyone.

A process killed at any moment leaves ``latest`` and the previous checkpoint
as they were (at worst a ``.incomplete`` directory, removed by the next save,
or a ``<tag>.replaced``, which the next save settles: [Note: leftover
replaced checkpoints]).

A failed save removes its directory, so no temporary file is left, and raises
`CheckpointError` on every rank with each failing rank's error (which names
the file).

[Note: leftover replaced checkpoints] A kill between the two renames of a
commit over an existing tag leaves ``<tag>.replaced`` (the committed
checkpoint) and no ``<tag>``; a kill after the second leaves both. The next
save, before it writes anything, renames a ``<tag>.replaced`` back to
``<tag>`` where ``<tag>`` is gone (it is that tag's committed checkpoint, and
loads and `committed_tags` see it as such meanwhile), and removes it where
``<tag>`` is there and complete (its manifest verifies and every file it
lists has the size it records). Otherwise (``<tag>`` there but not complete,
or neither copy complete) it is left as it is, with a warning event naming it:
no save deletes the only good copy of a checkpoint.

[Note: frozen parameters left out] ``exclude_frozen_parameters=True`` (as
DeepSpeed's flag) writes no values of the parameters that do not require
grad: a LoRA run over a frozen base model then saves its adapters and their
optimizer state, not the base again at every save. The manifest lists them
(``excluded_frozen``: name, shape, dtype), so a load checks their names and
shapes and keeps the loading engine's own values for them, which must be
frozen there too (its base weights, loaded from wherever they came from the
first time). `zkernel.consolidate` leaves them out of the state dict it
gives, which then loads with ``strict=False`` over the base.

[Note: a save inside an accumulation window] As DeepSpeed's, a save after
the `Engine.step` of a micro-batch that does not end its window is taken: it
holds the state of the last applied step (masters, optimizer state, counters
with ``micro_steps`` at that step's boundary, lr, loss scale), not the
window's partial gradients, and says so in a WARNING
(``zkernel.checkpoint.mid_window``). Nothing of the window is lost to the
running engine, whose gradients stay and keep accumulating; a run resumed
from the checkpoint starts at that window's first micro-batch, so feed it
those micro-batches again. The RNG states are those at the save (the
window's micro-batches have drawn from them). Between a backward and its
`Engine.step` a save is refused: at a boundary the optimizer may already be
stepping.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import attrs
import torch

from zkernel.checkpoint import client_state as client, extra_state, rng
from zkernel.checkpoint.collective import exchange_json
from zkernel.checkpoint.format import (
    FORMAT,
    FORMAT_VERSION,
    INCOMPLETE,
    MANIFEST,
    REPLACED,
    CheckpointError,
    check_tag,
    dtype_name,
    entry_name,
    fsync_dir,
    rank_file,
    write_atomic,
)
from zkernel.checkpoint.sealed import latest_names, read_manifest, seal, write_latest
from zkernel.checkpoint.model import PARAM, ModelView, view_of
from zkernel.checkpoint.shards import StateSpecs, check_between_steps, describe_error, describe_groups, state_specs, whole_params
from zkernel.checkpoint.stream_writer import Entry, write_file
from zkernel.spec.groups import ParamGroup, ShardLayout
from zkernel.telemetry.log import get_logger
from zkernel.params.param_map import ParamMap
from zkernel.telemetry.progress import progress
from zkernel.spec.tiers import ShardState

log = get_logger()


def save(
    engine,
    directory: str | os.PathLike,
    tag: str | None = None,
    client_state: Any = None,
    exclude_frozen_parameters: bool = False,
) -> Path:
    """Write a checkpoint of ``engine`` to ``directory/tag`` (collective), with rank 0's ``client_state``
    ([Note: client state] in `zkernel.checkpoint.client_state`); return that path. With
    ``exclude_frozen_parameters`` the parameters that do not require grad are left out ([Note: frozen
    parameters left out])."""
    check_between_steps(engine, "save_checkpoint", boundary=False)
    root = Path(directory)
    tag = check_tag(tag if tag is not None else f"step{engine.global_steps}")
    info = engine.dist
    staging = root / f"{tag}{INCOMPLETE}"
    started = time.perf_counter()

    done = engine.micro_steps % engine.config.gradient_accumulation_steps
    if done:  # [Note: a save inside an accumulation window]
        log.warning(
            "zkernel.checkpoint.mid_window",
            rank=info.rank,
            path=str(root / tag),
            global_steps=engine.global_steps,
            micro_batches_done=done,
            gradient_accumulation_steps=engine.config.gradient_accumulation_steps,
            saved="the state of the last applied step; this window's partial gradients are not saved, "
            "and a run resumed from it starts at this window's first micro-batch",
        )
    view = view_of(engine.module)
    _agree(_attempt(info.rank == 0, _prepare, root, staging), info, "preparing", staging, cleanup=False)
    error, report = None, None
    try:
        if not staging.is_dir():
            raise CheckpointError(
                f"{staging}, which rank 0 has just created, is not there for rank {info.rank}: every rank must "
                "pass the same directory, on a filesystem all ranks share"
            )
        if not isinstance(exclude_frozen_parameters, bool):
            raise TypeError(f"exclude_frozen_parameters must be True or False, not {exclude_frozen_parameters!r}")
        plan = _RankPlan(engine, view, client_state, exclude_frozen_parameters)
        with progress(sum(e.nbytes for e in plan.entries), "saving checkpoint") as bar:
            record = write_file(staging / rank_file(info.rank), plan.entries, plan.metadata(tag), on_bytes=bar.update)
        report = plan.report(record)
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it
        error = exc
    reports = exchange_json(report if error is None else {"error": describe_error(error)}, info)
    failures = [f"rank {r}: {rep['error']}" for r, rep in enumerate(reports) if "error" in rep]
    if failures:
        if info.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(f"saving checkpoint {tag!r} in {root} failed; " + "; ".join(failures)) from error

    def commit() -> None:
        manifest = _manifest(engine, view, tag, reports, exclude_frozen_parameters)
        write_atomic(staging / MANIFEST, seal(manifest))
        _commit(root, tag, staging)

    _agree(_attempt(info.rank == 0, commit), info, "committing", staging, cleanup=True)
    nbytes = sum(rep["file"]["bytes"] for rep in reports)
    log.info(
        "zkernel.checkpoint.saved",
        rank=info.rank,
        path=str(root / tag),
        bytes=nbytes,
        seconds=round(time.perf_counter() - started, 3),
    )
    return root / tag


# -- phases ------------------------------------------------------------------------------------


def _attempt(active: bool, fn, *args) -> dict[str, Any]:
    if not active:
        return {}
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - reported to every rank by _agree
        return {"error": describe_error(exc)}
    return {}


def _agree(status: dict, info, phase: str, staging: Path, cleanup: bool) -> None:
    """Rank 0 tells every rank whether its phase worked; all raise together if not."""
    statuses = exchange_json(status, info)
    if "error" in statuses[0]:
        if cleanup and info.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(f"saving a checkpoint failed while {phase} (rank 0): {statuses[0]['error']}")


def _prepare(root: Path, staging: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for leftover in root.iterdir():
        if leftover.name.endswith(INCOMPLETE) and leftover.is_dir():
            log.warning("zkernel.checkpoint.leftover_removed", path=str(leftover), reason="a save that did not finish")
            shutil.rmtree(leftover)
        elif leftover.name.endswith(REPLACED) and leftover.is_dir():
            _settle_replaced(root, leftover)
    staging.mkdir()
    fsync_dir(root)


def _settle_replaced(root: Path, replaced: Path) -> None:
    """Rename ``<tag>.replaced`` back or remove it ([Note: leftover replaced checkpoints])."""
    final = root / replaced.name.removesuffix(REPLACED)
    if final.exists():
        if _complete(final):
            log.warning("zkernel.checkpoint.leftover_removed", path=str(replaced), reason=f"{final.name} replaced it")
            shutil.rmtree(replaced)
            return
    elif _complete(replaced):
        os.rename(replaced, final)
        log.warning(
            "zkernel.checkpoint.replaced_restored",
            path=str(final),
            reason="a save of the same tag died while committing; this was the committed checkpoint",
        )
        return
    log.warning(
        "zkernel.checkpoint.leftover_kept",
        path=str(replaced),
        reason=f"{final} is not a complete checkpoint to replace it; remove whichever you do not need",
    )


def _complete(tag_dir: Path) -> bool:
    """Whether ``tag_dir``'s manifest verifies and every file it lists has the size it records."""
    try:
        files = read_manifest(tag_dir)["files"]
        return all((tag_dir / name).stat().st_size == record["bytes"] for name, record in files.items())
    except (CheckpointError, OSError, KeyError, TypeError):
        return False


def _commit(root: Path, tag: str, staging: Path) -> None:
    fsync_dir(staging)
    final, replaced = root / tag, root / f"{tag}{REPLACED}"
    if final.exists():
        if replaced.exists():
            shutil.rmtree(replaced)
        os.rename(final, replaced)
    try:
        os.rename(staging, final)
        fsync_dir(root)
        write_latest(root, tag)
    except BaseException:
        if not latest_names(root, tag):  # not committed: put everything back as it was
            if final.exists() and not staging.exists():
                os.rename(final, staging)
            if replaced.exists() and not final.exists():
                os.rename(replaced, final)
        raise
    if replaced.exists():
        shutil.rmtree(replaced)


# -- what one rank writes ------------------------------------------------------------------------


class _GroupStateCache:
    """Reads a group's state from its tier when its first tensor is due; holds only one group's."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.group: ParamGroup | None = None
        self.state: ShardState | None = None
        self.shard: torch.Tensor | None = None
        # group index -> scalar name -> [dtype, value] (a list of values, one per parameter, for per-parameter state)
        self.scalars: dict[int, dict[str, list]] = {}
        self.per_param: frozenset[str] = frozenset()  # names of per-parameter state

    def tensor(self, group: ParamGroup, kind: str) -> torch.Tensor:
        if self.group is not group:
            self.group, self.state, self.shard = group, None, None  # drop the previous group's first
            if group.requires_grad:
                self.state = self.engine.optimizer_tier.read_state(group)
                self.scalars[group.index] = {
                    name: [dtype_name(t.dtype), t.item() if t.dim() == 0 else t.tolist()]
                    for name, t in self.state.state.items()
                    if t.dim() == 0 or name in self.per_param
                }
            else:
                self.shard = self.engine.params_tier.read_shard(group)
        if kind == "param":
            return self.shard
        if kind == "master":
            return self.state.master
        return self.state.state[kind.removeprefix("state.")]


class _RankPlan:
    """The tensors this rank writes and the records rank 0 needs for the manifest."""

    def __init__(self, engine, view: ModelView, client_state: Any = None, exclude_frozen: bool = False) -> None:
        self.engine = engine
        self.rank = engine.dist.rank
        self.view = view
        self.entries: list[Entry] = []
        self.fragments: dict[str, list[list[int]]] = {}  # canonical name -> [[start, numel], ...]
        self.stored: dict[str, str] = {}  # canonical name -> "master" | "param"
        self.scalar_groups: dict[str, tuple[int, int]] = {}  # canonical name -> (group index, position) (trainable)
        self.cache = _GroupStateCache(engine)
        self.specs: StateSpecs | None = None
        self.extra: dict[str, int] = {}  # state-dict key -> bytes of its serialised extra state (rank 0)
        self.client: int | None = None  # bytes of the serialised client state (rank 0, where given)
        if client_state is not None:
            client.check(client_state)  # every rank checks its own; rank 0's is kept
            if self.rank == 0:
                data = client.serialize(client_state)
                self.entries.append(
                    Entry(entry_name(client.KIND, client.NAME, 0), torch.uint8, (data.numel(),), lambda d=data: d)
                )
                self.client = data.numel()
        groups = engine.groups
        layouts = describe_groups(engine.hook, groups, engine.config.partitioner)
        for group, layout in zip(groups, layouts):
            if layout is None or (layout.replicated and self.rank != 0):
                continue
            if group.requires_grad or not exclude_frozen:
                self._add_group(group, layout)
        if self.rank == 0:
            for name in whole_params(view, groups, layouts):
                if view.params[name].requires_grad or not exclude_frozen:
                    self._add_whole(PARAM, name, view.params[name], stored="param")
            for name, buf in view.buffers.items():
                self._add_whole("buffer", name, buf)
            for key, value in view.extra.items():  # see [Note: extra state]
                data = extra_state.serialize(key, value)
                self.entries.append(Entry(entry_name(extra_state.KIND, key, 0), torch.uint8, (data.numel(),), lambda d=data: d))
                self.extra[key] = data.numel()

    def _add_group(self, group: ParamGroup, layout: ShardLayout) -> None:
        names = [self.view.names[id(p)] for p in group.params]
        if group.requires_grad:
            specs = state_specs(self.engine, group, layout.numel)
            self.specs = self.specs or specs
            self.cache.per_param = specs.per_param
            kinds = [("master", torch.float32)] + [(f"state.{n}", d) for n, d in specs.per_element.items()]
        else:
            shard = group.param_shard
            kinds = [("param", shard.dtype if shard is not None else self.engine.compute_dtype)]
        for kind, dtype in kinds:
            for i, frag in enumerate(layout.fragments):
                self.entries.append(
                    Entry(
                        entry_name(kind, names[frag.param], frag.start),
                        dtype,
                        (frag.numel,),
                        lambda g=group, k=kind, f=frag: self._slice(g, k, f, layout.numel),
                        aligned=i == 0,  # each run of a shard starts on a page: direct reads on load
                    )
                )
        for frag in layout.fragments:
            name = names[frag.param]
            self.fragments.setdefault(name, []).append([frag.start, frag.numel])
            self.stored[name] = "master" if group.requires_grad else "param"
            if group.requires_grad:
                self.scalar_groups[name] = (group.index, frag.param)

    def _slice(self, group: ParamGroup, kind: str, frag, numel: int) -> torch.Tensor:
        tensor = self.cache.tensor(group, kind)
        if tensor.numel() != numel:
            raise CheckpointError(
                f"{kind} of group {group.name!r} has {tensor.numel()} elements but the partitioner describes a "
                f"shard of {numel}"
            )
        return tensor.reshape(-1)[frag.offset : frag.offset + frag.numel]

    def _add_whole(self, kind: str, name: str, tensor: torch.Tensor, stored: str | None = None) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self.entries.append(
            Entry(
                entry_name(kind, name, 0),
                tensor.dtype,
                (tensor.numel(),),
                lambda t=tensor: t.detach().reshape(-1),
                aligned=nbytes >= 64 << 10,
            )
        )
        if stored is not None:
            self.fragments[name] = [[0, tensor.numel()]]
            self.stored[name] = stored

    def metadata(self, tag: str) -> dict[str, str]:
        return {"format": FORMAT, "version": str(FORMAT_VERSION), "tag": tag, "rank": str(self.rank)}

    def report(self, record) -> dict[str, Any]:
        scalars = {
            name: {
                key: [dtype, value[position] if isinstance(value, list) else value]
                for key, (dtype, value) in self.cache.scalars.get(index, {}).items()
            }
            for name, (index, position) in self.scalar_groups.items()
        }
        specs = self.specs
        return {
            "file": record.to_json(),
            "fragments": self.fragments,
            "stored": self.stored,
            "scalars": scalars,
            "state": None
            if specs is None
            else {
                "per_element": {n: dtype_name(d) for n, d in specs.per_element.items()},
                "scalar": {n: dtype_name(d) for n, d in specs.scalars.items()},
            },
            "rng": rng.capture(),
            "extra": self.extra,
            "client": self.client,
        }


# -- the manifest (rank 0) -----------------------------------------------------------------------


def _manifest(engine, view: ModelView, tag: str, reports: list[dict], exclude_frozen: bool = False) -> dict[str, Any]:
    world = engine.dist.world_size
    params: dict[str, Any] = {}
    excluded: dict[str, Any] = {}
    for name, p in view.params.items():
        if exclude_frozen and not p.requires_grad:
            shape, dtype = engine.original_tensors.get(name, (p.shape, p.dtype))
            excluded[name] = {"shape": list(shape), "dtype": dtype_name(dtype)}
            continue
        fragments = sorted(
            ([rank, start, numel] for rank, rep in enumerate(reports) for start, numel in rep["fragments"].get(name, ())),
            key=lambda f: f[1],
        )
        shape, dtype = engine.original_tensors.get(name, (p.shape, p.dtype))
        _check_coverage(name, fragments, shape.numel())
        stored = {rep["stored"][name] for rep in reports if name in rep["stored"]}
        scalars: dict[str, Any] = {}
        for rep in reports:
            for key, value in rep["scalars"].get(name, {}).items():
                if scalars.setdefault(key, value) != value:
                    raise CheckpointError(f"ranks disagree on optimizer state {key!r} of parameter {name!r}")
        params[name] = {
            "shape": list(shape),
            "dtype": dtype_name(dtype),
            "trainable": p.requires_grad,
            "stored": stored.pop(),
            "fragments": fragments,
            "scalars": scalars,
        }
    buffers = {
        name: {"shape": list(buf.shape), "dtype": dtype_name(engine.original_tensors.get(name, (None, buf.dtype))[1])}
        for name, buf in view.buffers.items()
    }
    state = next((rep["state"] for rep in reports if rep["state"] is not None), None)
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "tag": tag,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "zkernel_version": _version(),
        "torch_version": torch.__version__,
        "world_size": world,
        "config": _config_json(engine.config),
        "files": {rank_file(r): rep["file"] for r, rep in enumerate(reports)},
        "params": params,
        "buffers": buffers,
        **({"excluded_frozen": excluded} if excluded else {}),
        "state_dict": [list(k) for k in view.keys],
        "composed": ParamMap.of(engine.module).to_json(),
        "extra_state": {key: {"bytes": n} for key, n in reports[0]["extra"].items()},
        **({"client_state": {"bytes": reports[0]["client"]}} if reports[0]["client"] is not None else {}),
        "optimizer_state": state or {"per_element": {}, "scalar": {}},
        "engine": _last_step_state(engine),
        "ranks": [{"rng": rep["rng"]} for rep in reports],
    }


def _last_step_state(engine) -> dict[str, Any]:
    """The counters of the last applied step: ``micro_steps`` at its boundary ([Note: a save inside an
    accumulation window])."""
    state = engine.training_state()
    state["micro_steps"] -= state["micro_steps"] % engine.config.gradient_accumulation_steps
    return state


def _check_coverage(name: str, fragments: list[list[int]], numel: int) -> None:
    at = 0
    for _, start, n in fragments:
        if start != at:
            break
        at += n
    if at != numel:
        raise CheckpointError(
            f"the shards of parameter {name!r} do not cover its {numel} elements exactly once "
            f"(fragments {[(s, n) for _, s, n in fragments][:6]}): the partitioner's zkernel_describe_shard is wrong"
        )


def _config_json(config) -> dict[str, Any]:
    def value(_inst, _field, v):
        if isinstance(v, os.PathLike):
            return os.fspath(v)
        if isinstance(v, tuple):
            return list(v)
        return v

    return attrs.asdict(config, value_serializer=value)


def _version() -> str:
    from zkernel import __version__

    return __version__
