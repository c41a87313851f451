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
    _DATA.__set__(param, value)


class _WatchedMixin:
    """Mixed into a whole parameter's own class (see [Note: writes to gathered parameters])."""

    __slots__ = ()
    data = property(_get_data, _set_data, doc="The parameter's values as a tensor autograd does not track.")


_watched: dict[type, type] = {}  # a parameter class -> its watched twin
_unwatched: dict[type, type] = {}


def own_class(cls: type) -> type:
    """The parameter class ``cls`` watches for (``cls`` itself where it is not a watched twin)."""
    return _unwatched.get(cls, cls)


def watch(param: nn.Parameter) -> None:
    """Give ``param`` the watched twin of its own class and take a snapshot (call once it is whole)."""
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


def unwatch(params: Sequence[nn.Parameter]) -> None:
    """Give ``params`` their own classes back and stop tracking them (the engine closed)."""
    for p in params:
        own = own_class(type(p))
        if own is not type(p):
            p.__class__ = own
        _noted.discard(id(p))
        _versions.pop(id(p), None)


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
