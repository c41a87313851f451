"""Writes to whole parameters reach their fp32 masters, as they reach a plain model's parameters.

[Note: writes to gathered parameters] A zero3 parameter is whole only while
gathered: its values are a copy, in the compute dtype, of the ranks' shards,
and the fp32 master each rank keeps of its shard is what the optimizer steps
and checkpoints save. A model that writes its own parameter inside forward
(Gemma3n's AltUp clamps ``prediction_coefs.weight.data`` before using it,
FLAVA clamps ``logit_scale.data``), a user who writes one inside
`Engine.gathered_parameters` (FSDP's ``summon_full_params`` keeps such writes)
or clamps a persistent one between steps (OpenCLIP clamps ``logit_scale``
after each step) wrote only the copy: the release freed it, or the next
step's publish overwrote it, and training went on from the unwritten master
without a word. DeepSpeed and FSDP2 drop the writes made in forward alike
(DeepSpeed keeps a user's only inside ``GatheredParameters(modifier_rank=r)``).

The same holds for the whole parameters of none, ZeRO-1 and ZeRO-2 where
their fp32 master is not the parameter itself (bf16 or fp16 compute, or the
master offloaded): a clamp between steps reached only the compute copy, which
the next step's publish overwrote.

[Note: assignments keep the storage] A whole parameter is a view of storage
the engine owns (a flat buffer of none, ZeRO-1 and ZeRO-2, a zero3 group's
gathered buffer), which the engine's publish after a step and its gathers
write. ``p.data = t`` in plain torch points the parameter at ``t``; here it
would leave the engine's storage for good: every later publish missed it,
the next forward computed with the assigned values forever while the master
kept training, and ``w.data = w.data.clamp(...)`` after each step folded
stale values back into the master (issue 43). So the watched twin's
``data`` setter copies the assigned values into the storage the parameter is
bound to (`watch`) and leaves it bound, as ``p.data.copy_(t)`` would: the
assignment is then an ordinary write, noted and folded like one. The copy
keeps the storage's version counter, as a write through ``.data`` does (the
parameter's own counter is apart from it either way). Values of another
floating dtype or on another device are cast and moved in, as ``initialize``
cast and moved the model: the config's precision decides the parameter's
dtype, not the assigned tensor's (``bias.data = torch.zeros(n)`` in a bf16
run is kept; ``model.half()`` after ``initialize`` rounds the values and
changes no dtype). An assignment of another shape or kind (floating or not)
cannot live in that storage and is refused with `ParamAssignmentError`, which
names the parameter (the model's layout is fixed at ``initialize``). A
parameter moved off its storage another way (``p.set_(t)``, which moves its
version counter) is found when its group is folded and bound back the same
way. The engine's own moves of a parameter (zero3's release, ``close``) call
`unbind` first.

Detection, at no cost per operation: a whole parameter's class is a
watched twin of its own (as the released-parameter trap swaps classes, see
`zkernel.params.released`), whose ``data`` property notes the parameter whenever it
is read or assigned: ``p.data.clamp_()`` writes through a tensor that shares
storage but not the version counter, so only the access shows it. An
in-place operation on the parameter itself (``p.clamp_()`` under
``no_grad``, ``p.copy_(x)``) moves its version counter, which is noted when
the parameter becomes whole. Under ``torch.compile`` the property runs
eagerly (``torch._disable_dynamo``); an eager process never imports Dynamo.

Folding, only where something was noted: each rank takes the elements of
its own shard from the whole parameter and, where they differ from the
master rounded to the parameter's dtype (what the gather gave), writes them
into the master (fp32) and the parameter shard. Elements left alone keep the
master's full precision, so a bf16 copy that was only read changes nothing.
No collective is involved: every rank folds its own elements, so a write
must be made alike on every rank (as every rank runs the same forward). The
scheduler folds a group before releasing it in a forward or a user's
gather, at the end of each forward for the groups still whole, and before
a forward, ``state_dict`` or ``save_checkpoint`` for groups whole between
steps; never in backward, where the optimizer may already be stepping the
group (a write made in backward is not kept).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import nn

from zkernel.params.shard_values import read_shard_values, write_shard_values
from zkernel.spec.groups import ParamGroup
from zkernel.telemetry.log import get_logger

log = get_logger()

_DATA = torch._C.TensorBase.data
_noted: set[int] = set()  # ids of watched parameters whose .data was read or assigned since their snapshot
_versions: dict[int, int] = {}  # id of a watched parameter -> its version counter at the snapshot
_BINDING = "_zkernel_storage"  # a watched parameter's attribute: its `_Binding` ([Note: assignments keep the storage])


class _Binding:
    """The view of the engine's storage a watched parameter stays, and its name; held by the parameter, so it
    lives no longer than the parameter (an engine dropped without close leaks nothing). A copy of the
    parameter (``copy.deepcopy``, pickling) is bound to nothing."""

    __slots__ = ("view", "name")

    def __init__(self, view: torch.Tensor, name: str) -> None:
        self.view, self.name = view, name

    def __deepcopy__(self, memo) -> None:
        return None

    def __reduce__(self):
        return (_unbound, ())


def _unbound() -> None:
    return None


class ParamAssignmentError(ValueError):
    """A whole parameter was assigned values its storage in the engine cannot hold (another shape or kind)."""


def _note_and_get(param):
    _noted.add(id(param))
    return _DATA.__get__(param)


_note_and_get_eagerly = torch._disable_dynamo(_note_and_get)


def _get_data(param):
    if torch.compiler.is_compiling():
        return _note_and_get_eagerly(param)
    _noted.add(id(param))
    return _DATA.__get__(param)


def _set_data(param, value) -> None:
    _noted.add(id(param))
    binding = param.__dict__.get(_BINDING)
    if binding is None:
        _DATA.__set__(param, value)
    else:
        _keep_bound(param, value, binding.view, binding.name)


def _keep_bound(param, value: torch.Tensor, view: torch.Tensor, name: str) -> None:
    """Give ``param`` the values of ``value`` in ``view``, the engine's storage, and leave it a view of it."""
    if value.shape != view.shape or value.is_floating_point() != view.is_floating_point():
        raise ParamAssignmentError(
            f"parameter {name!r} was assigned a {value.dtype} tensor of shape {tuple(value.shape)}, but the engine "
            f"keeps it as {view.dtype} of shape {tuple(view.shape)}, in storage its optimizer step and gathers "
            "write; a tensor of another shape or kind cannot live there, and the parameter would stop training. "
            "Assign values of the same shape (they are copied in and kept, in the engine's dtype and on its "
            "device), or call engine.close(), change the model and call zkernel.initialize again"
        )
    if value.data_ptr() != view.data_ptr() or value.stride() != view.stride() or value.dtype != view.dtype:
        with torch.no_grad():
            if value.untyped_storage().data_ptr() == view.untyped_storage().data_ptr():
                value = value.clone()  # it overlaps the storage it is copied into (a transpose, a tied sibling)
            with torch.autograd._unsafe_preserve_version_counter(view):
                view.copy_(value)
    if param.data_ptr() != view.data_ptr():
        _DATA.__set__(param, view)


class _WatchedMixin:
    """Mixed into a whole parameter's own class (see [Note: writes to gathered parameters])."""

    __slots__ = ()
    data = property(_get_data, _set_data, doc="The parameter's values as a tensor autograd does not track.")


_watched: dict[type, type] = {}  # a parameter class -> its watched twin
_unwatched: dict[type, type] = {}


def own_class(cls: type) -> type:
    """The parameter class ``cls`` watches for (``cls`` itself where it is not a watched twin)."""
    return _unwatched.get(cls, cls)


def watch(param: nn.Parameter, view: torch.Tensor, name: str) -> None:
    """Give ``param`` the watched twin of its own class and take a snapshot (call once it is whole).

    ``view`` is the engine's storage ``param``'s ``.data`` was just pointed at, which it keeps whatever is
    assigned to it until `unbind` ([Note: assignments keep the storage]); ``name`` names it in errors.
    """
    param.__dict__[_BINDING] = _Binding(view, name)
    watch_loose([param])


def watch_loose(params: Sequence[nn.Parameter]) -> None:
    """Watch ``params``, parameters in no group of the engine's, until `unwatch` (`Engine.gathered_parameters`
    calls it for the block; see [Note: parameters in no group]). They are bound to no storage: an assignment
    points them elsewhere, as in plain torch."""
    for param in params:
        cls = own_class(type(param))
        twin = _watched.get(cls)
        if twin is None:
            twin = type(f"Watched{cls.__name__}", (_WatchedMixin, cls), {"__module__": __name__})
            _watched[cls] = twin
            _unwatched[twin] = cls
        param.__class__ = twin
        snapshot(param)


def snapshot(param: nn.Parameter) -> None:
    """From now on, a write to ``param`` is one made after this call."""
    _noted.discard(id(param))
    _versions[id(param)] = param._version


def note(param: nn.Parameter) -> None:
    """``param``'s ``.data`` was handed out while it was released, and it is whole now (the trap fetched it)."""
    _noted.add(id(param))


def unbind(param: nn.Parameter) -> None:
    """The engine is about to point ``param``'s ``.data`` elsewhere (a release, ``close``): let it."""
    param.__dict__.pop(_BINDING, None)


def unwatch(params: Sequence[nn.Parameter]) -> None:
    """Give ``params`` their own classes back and stop tracking them (the engine closed)."""
    for p in params:
        own = own_class(type(p))
        if own is not type(p):
            p.__class__ = own
        _noted.discard(id(p))
        _versions.pop(id(p), None)
        p.__dict__.pop(_BINDING, None)


def written(params: Sequence[nn.Parameter]) -> list[int]:
    """Indices of watched ``params`` that may have been written since their snapshot."""
    if not _versions:
        return []
    return [
        i
        for i, p in enumerate(params)
        if isinstance(p, _WatchedMixin) and (id(p) in _noted or _versions.get(id(p)) != p._version)
    ]


class WriteFolder:
    """Folds noted writes of a whole group into its master and parameter shard (one per engine)."""

    def __init__(self, engine) -> None:
        self._engine_ref = weakref.ref(engine)  # the model's hooks must not keep the engine alive ([Note: weak links])
        self.compared = 0  # groups whose shard was compared with their whole parameters

    def fold(self, group: ParamGroup) -> None:
        """Keep the writes made to ``group``'s whole parameters since their snapshot. Local: no collective."""
        indices = written(group.params)
        if not indices:
            return
        for i in indices:  # moved off its storage without an assignment (``set_``): bound back
            param = group.params[i]
            binding = param.__dict__.get(_BINDING)
            if binding is not None and param.data_ptr() != binding.view.data_ptr():
                _keep_bound(param, _DATA.__get__(param), binding.view, binding.name)
        engine = self._engine_ref()
        layout = engine.hook.zkernel_describe_shard(group=group)
        if layout is not None:
            if engine.pipeline.update_pending(group):
                engine.pipeline.wait_update(group)
            changed = self._fold_into_shard(group, layout, set(indices))
            if changed:
                log.debug("zkernel.param_writes.folded", group=group.name, elements=changed)
        for i in indices:
            snapshot(group.params[i])

    def _fold_into_shard(self, group: ParamGroup, layout, indices: set[int]) -> int:
        engine = self._engine_ref()
        fragments = [f for f in layout.fragments if f.param in indices]
        if not fragments:
            return 0
        self.compared += 1
        target, kept = read_shard_values(engine, group)
        changed = 0
        with torch.no_grad():
            for frag in fragments:
                whole = group.params[frag.param].detach().reshape(-1)
                new = whole[frag.start : frag.start + frag.numel].to("cpu")
                old = target[frag.offset : frag.offset + frag.numel]
                differs = new != old.to(new.dtype)
                count = int(differs.sum())
                if count:
                    old[differs] = new[differs].to(old.dtype)
                    changed += count
        if changed:
            write_shard_values(engine, group, target, kept)
        return changed


# [Note: writes on some ranks only] Folding is local: each rank keeps the elements of its own shard, so a
# write inside `Engine.gathered_parameters` made on some ranks but not on others (``if rank == 0:
# p.fill_(...)``) reached only the shards of the ranks that made it. DeepSpeed keeps such a write only
# inside ``GatheredParameters(modifier_rank=r)``, by broadcasting rank r's values, and drops it silently
# otherwise. `settle` runs at the end of the block, before the fold: the ranks exchange the names of the
# parameters each may have written (one small collective; an empty exchange ends it). With a modifier
# rank, rank r's values of every parameter named by any rank are broadcast to all, so every rank folds
# the same values (a write on another rank is replaced by rank r's, as in DeepSpeed). Without one, those
# parameters' values are compared with rank 0's, and a parameter whose values differ between ranks is a
# `ParamWriteError` naming it, never a write kept in part: its write is folded nowhere, and its whole
# values are a rank's that did not write it. A read of ``p.data`` notes the parameter too, so a block
# that reads parameters pays one broadcast of each read one; a block that touches none pays the exchange.


class ParamWriteError(RuntimeError):
    """A write inside ``gathered_parameters()`` was made on some ranks but not alike on all of them."""


# [Note: parameters in no group] A partitioner may leave some parameters out of its groups: none, ZeRO-1
# and ZeRO-2 keep frozen parameters whole on every rank, a plain tensor each, with no master and nothing
# to fold. A write to one of them on some ranks only stayed in those ranks' replicas: the ranks computed
# with different weights from then on, without a word. `Engine.gathered_parameters` watches them for the
# block (`watch_loose`, `unwatch` after) and `settle` treats them as the groups' parameters: rank r's
# values with a modifier rank, or a `ParamWriteError` naming them where the ranks' values differ. Their
# write, made alike on every rank or broadcast, is kept as it stands (it is the parameter's only copy).


def settle(groups: Sequence[ParamGroup], modifier_rank: int | None, world_size: int,
           loose: Sequence[tuple[str, nn.Parameter]] = ()) -> None:
    """Make the writes to ``groups``' whole parameters, and to ``loose`` (named parameters in no group,
    watched with `watch_loose`), alike on every rank ([Note: writes on some ranks only], [Note:
    parameters in no group]); collective, on every rank, before the groups are folded."""
    if world_size <= 1:
        return
    import torch.distributed as dist

    named = {}
    for group in groups:
        for i in written(group.params):
            named[group.param_names[i]] = group.params[i]
    loose_params = [p for _, p in loose]
    for i in written(loose_params):
        named[loose[i][0]] = loose_params[i]
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, sorted(named))
    names = sorted(set().union(*everyone))
    if not names:
        return
    by_name = {n: p for g in groups for n, p in zip(g.param_names, g.params, strict=True)}
    by_name.update(loose)
    missing = [n for n in names if n not in by_name]
    if missing:
        raise ParamWriteError(f"parameters {missing} were written inside gathered_parameters() on some ranks "
                              "but are not whole on every rank")
    params = [by_name[n] for n in names]
    with torch.no_grad():
        if modifier_rank is not None:
            for p in params:
                dist.broadcast(_DATA.__get__(p), src=modifier_rank)
                note(p)
            return
        differs = torch.zeros(len(params), device=params[0].device)
        for i, p in enumerate(params):
            mine = _DATA.__get__(p)
            theirs = mine.clone()
            dist.broadcast(theirs, src=0)
            differs[i] = float(not torch.equal(mine, theirs))
            note(p)
        dist.all_reduce(differs, op=dist.ReduceOp.MAX)
    bad = [n for n, d in zip(names, differs.tolist(), strict=True) if d]
    if bad:
        with torch.no_grad():
            for n in bad:  # not folded, and whole again as gathered on every rank (from a rank that did not write)
                source = next((r for r, seen in enumerate(everyone) if n not in seen), None)
                if source is not None:
                    dist.broadcast(_DATA.__get__(by_name[n]), src=source)
                snapshot(by_name[n])
        writers = [r for r, seen in enumerate(everyone) if set(seen) & set(bad)]
        raise ParamWriteError(
            f"parameter(s) {bad} were written inside engine.gathered_parameters() with values that differ "
            f"between ranks (noted as written on ranks {writers}); each rank keeps only its own shard's "
            "elements, so the write would be kept in part. Make the same write on every rank, or pass "
            "modifier_rank=r to keep rank r's values on all ranks (as DeepSpeed's GatheredParameters does)"
        )
