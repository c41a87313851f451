"""Parameter names the user sees versus the parameters the engine holds.

[Note: composed parameters] A model transform may hold one parameter the
user wrote as several (tiling keeps ``fc.weight`` as ``fc.tiles.0.weight``,
``fc.tiles.1.weight``, ...: each tile its own parameter, so zero3 gathers
and releases it on its own). ``named_parameters()`` and the partitioners'
groups then list the pieces, while what faces the user (``state_dict``,
`Engine.state_dict`, `Engine.gathered_parameters`) speaks of the parameter
as written. A module that holds such pieces declares them with a method

    zkernel_composed_parameters(self) -> Iterable[ComposedParam]

with names relative to that module; `ParamMap.of(model)` collects every
declaration in a model under full names, and answers both ways:

* `ParamMap.pieces` (user name -> the held parameters and the slice of the
  user's tensor each fills), `ParamMap.user_name` (held name -> user name);
* `ParamMap.assemble` turns held tensors keyed by held name (what a
  partitioner gathers, what `Engine.state_dict` reads) into whole tensors
  keyed by user name, and `ParamMap.split` the other way.

A parameter nobody composes maps to itself. `install_state_dict_hooks` makes
a composing module's own ``state_dict``/``load_state_dict`` speak user names,
so ``model.state_dict()`` (whole inside `Engine.gathered_parameters` under
zero3) looks like the untransformed model's. Inside `held_names` they speak
the held names instead: the checkpoint code reads the parameter objects
themselves through ``state_dict(keep_vars=True)`` (under zero3 released,
which composing would read) and stores each piece under its held name, and
`Engine.state_dict` assembles the pieces it read into the user's tensors. So
a checkpoint of a transformed model holds the pieces, and its manifest keeps
the composition (`ParamMap.to_json`): ``zkernel.consolidate`` assembles the
user's tensors, and a load reads the pieces wherever the engine holds them
cut another way or whole ([Note: loading across compositions] in
`zkernel.checkpoint.recompose`).
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Iterable, Iterator, Mapping
from typing import Protocol, runtime_checkable

import attrs
import torch
from torch import nn

_WHOLE = ()  # index of a piece that is the whole tensor


@attrs.frozen
class Piece:
    """One held parameter and where its values sit in the user's tensor."""

    name: str  # as ``named_parameters()`` lists it (relative to the declaring module in a declaration)
    index: tuple[slice, ...]  # the region of the user's tensor, one slice per leading dimension


@attrs.frozen
class ComposedParam:
    """A parameter the user sees, held as ``pieces`` that tile it exactly."""

    name: str  # the user's name (relative to the declaring module in a declaration)
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]


@runtime_checkable
class ComposesParameters(Protocol):
    """A module holding some of its user-visible parameters as pieces (see [Note: composed parameters])."""

    def zkernel_composed_parameters(self) -> Iterable[ComposedParam]: ...


class ParamMap:
    """Every composed parameter of a model, under full names (see [Note: composed parameters])."""

    def __init__(self, composed: Iterable[ComposedParam]) -> None:
        self._composed: dict[str, ComposedParam] = {}
        self._owner: dict[str, tuple[str, Piece]] = {}
        for param in composed:
            self._composed[param.name] = param
            for piece in param.pieces:
                self._owner[piece.name] = (param.name, piece)

    @classmethod
    def of(cls, model: nn.Module) -> ParamMap:
        found = []
        for prefix, module in model.named_modules():
            if isinstance(module, ComposesParameters):
                found.extend(_prefixed(param, prefix) for param in module.zkernel_composed_parameters())
        return cls(found)

    def to_json(self) -> list:
        """The composed parameters as JSON values (a checkpoint's manifest keeps them for `from_json`)."""
        return [
            {"name": p.name, "shape": list(p.shape),
             "pieces": [[piece.name, [[i.start, i.stop] for i in piece.index]] for piece in p.pieces]}
            for p in self._composed.values()
        ]  # fmt: skip

    @classmethod
    def from_json(cls, data: list) -> ParamMap:
        return cls(
            ComposedParam(
                d["name"], tuple(d["shape"]), tuple(Piece(n, tuple(slice(a, b) for a, b in index)) for n, index in d["pieces"])
            )
            for d in data
        )

    @property
    def composed(self) -> Mapping[str, ComposedParam]:
        """The composed parameters by user name (parameters mapping to themselves are not listed); a
        read-only view, so callers may look names up one by one without a copy each time."""
        return types.MappingProxyType(self._composed)

    def pieces(self, user_name: str) -> tuple[Piece, ...]:
        """The held parameters making up ``user_name`` (itself, whole, when nothing composes it)."""
        param = self._composed.get(user_name)
        return param.pieces if param is not None else (Piece(user_name, _WHOLE),)

    def user_name(self, held_name: str) -> tuple[str, tuple[slice, ...]]:
        """The user's name of held parameter ``held_name`` and the region of it this one fills."""
        owner = self._owner.get(held_name)
        return (owner[0], owner[1].index) if owner is not None else (held_name, _WHOLE)

    def user_names(self, held_names: Iterable[str]) -> list[str]:
        """User names in the order of ``held_names`` (e.g. ``named_parameters()``), each once."""
        out, seen = [], set()
        for held in held_names:
            name = self.user_name(held)[0]
            if name not in seen:
                seen.add(name)
                out.append(name)
        return out

    def assemble(self, held: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Whole tensors by user name from held tensors by held name (in ``held``'s order).

        Keys nobody composes pass through. A composed parameter needs all its
        pieces; the result is a new tensor of the user's shape, on the first
        piece's device and dtype.
        """
        out: dict[str, torch.Tensor] = {}
        for key, value in held.items():
            owner = self._owner.get(key)
            if owner is None:
                out[key] = value
            elif owner[0] not in out:
                out[owner[0]] = self._assemble_one(self._composed[owner[0]], held)
        return out

    def split(self, user: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Held tensors by held name (views of the inputs) from whole tensors by user name."""
        out: dict[str, torch.Tensor] = {}
        for key, value in user.items():
            param = self._composed.get(key)
            if param is None:
                out[key] = value
                continue
            if tuple(value.shape) != param.shape:
                raise ValueError(
                    f"{key!r} has shape {tuple(value.shape)}, expected {param.shape} (it is held as "
                    f"{len(param.pieces)} pieces: {', '.join(p.name for p in param.pieces)})"
                )
            for piece in param.pieces:
                out[piece.name] = value[piece.index]
        return out

    @staticmethod
    def _assemble_one(param: ComposedParam, held: Mapping[str, torch.Tensor]) -> torch.Tensor:
        missing = [p.name for p in param.pieces if p.name not in held]
        if missing:
            raise KeyError(f"cannot assemble {param.name!r}: pieces {missing} are missing")
        first = held[param.pieces[0].name]
        whole = torch.empty(param.shape, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for piece in param.pieces:
                whole[piece.index] = held[piece.name].detach()
        return whole


def _prefixed(param: ComposedParam, prefix: str) -> ComposedParam:
    if not prefix:
        return param
    return ComposedParam(
        f"{prefix}.{param.name}",
        param.shape,
        tuple(Piece(f"{prefix}.{p.name}", p.index) for p in param.pieces),
    )


def install_state_dict_hooks(module: nn.Module) -> list:
    """Make ``module``'s ``state_dict``/``load_state_dict`` use its user-visible names; returns the handles.

    ``module`` must implement ``zkernel_composed_parameters``. Saving replaces
    the pieces' entries by the whole tensors; loading splits whole tensors
    into the pieces' entries. Under zero3 between uses every piece is an
    empty tensor: the entry is then an empty tensor too, as for a released
    parameter of an untransformed module.
    """
    return [
        module.register_state_dict_post_hook(_compose_state_dict),
        module.register_load_state_dict_pre_hook(_split_state_dict),
    ]


_held = threading.local()


@contextlib.contextmanager
def held_names() -> Iterator[None]:
    """Composing modules' ``state_dict``/``load_state_dict`` keep their pieces under held names here."""
    outer = getattr(_held, "on", False)
    _held.on = True
    try:
        yield
    finally:
        _held.on = outer


def _compose_state_dict(module, state_dict, prefix, _local_metadata) -> None:
    if getattr(_held, "on", False):
        return
    for param in module.zkernel_composed_parameters():
        keys = [prefix + p.name for p in param.pieces]
        if not all(k in state_dict for k in keys):
            continue  # pieces excluded by the caller (e.g. a filtered state dict)
        values = [state_dict.pop(k) for k in keys]
        if all(v.numel() == 0 for v in values):
            whole = values[0].detach().new_empty(0)
        else:
            held = dict(zip((p.name for p in param.pieces), values))
            whole = ParamMap._assemble_one(param, held)
        state_dict[prefix + param.name] = whole


def _split_state_dict(module, state_dict, prefix, _local_metadata, _strict, _missing, _unexpected, _errors) -> None:
    if getattr(_held, "on", False):
        return
    for param in module.zkernel_composed_parameters():
        key = prefix + param.name
        if key not in state_dict:
            continue
        value = state_dict.pop(key)
        for name, part in ParamMap([param]).split({param.name: value}).items():
            state_dict[prefix + name] = part
