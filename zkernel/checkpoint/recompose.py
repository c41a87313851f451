"""Reading the engine's held parameters from a checkpoint whose model held them otherwise.

[Note: loading across compositions] A checkpoint stores each parameter under
the name the engine held it by, and its manifest keeps the composition
([Note: composed parameters] in `zkernel.params.param_map`): which held parameters
make up each parameter the user wrote, and the region of it each fills. A
model tiled into 2 tiles saves ``fc.tiles.0.weight`` and ``fc.tiles.1.weight``;
resumed untiled it asks for ``fc.weight``, tiled into 4 for
``fc.tiles.0.weight`` .. ``fc.tiles.3.weight`` with other regions. Both name the
same user tensor, so a checkpoint loads wherever the user's parameters are the
same, whatever either side's tiling:

* a held parameter stored under its own name with the same region is read as
  it is (the usual case, and every checkpoint of an untransformed model);
* any other is translated through the user's tensor: an element range of the
  engine's piece becomes runs contiguous in the user's tensor (one per row of
  a tile cut along its columns), each run becomes ranges of the stored
  pieces it crosses, and neighbouring ranges that stay contiguous on both
  sides merge, so an untiled layer read into row tiles is one range a tile.

Only element ranges are translated: the optimizer state of a piece is
per-element, as its values are, and a per-parameter scalar (a step count)
comes from the stored pieces, which must agree on it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from zkernel.checkpoint.format import CheckpointError
from zkernel.checkpoint.reader import CheckpointIndex, ReadBatch
from zkernel.params.param_map import ParamMap, Piece


class _Region:
    """Where a piece lies in its user tensor: a box cut along leading dimensions, flat positions both ways."""

    def __init__(self, shape: tuple[int, ...], piece: Piece) -> None:
        self.name = piece.name
        self.shape = shape
        bounds = [s.indices(d)[:2] for s, d in zip(piece.index, shape)] + [(0, d) for d in shape[len(piece.index) :]]
        self.lo = [a for a, _ in bounds]
        self.hi = [b for _, b in bounds]
        self.extent = [b - a for a, b in bounds]
        self.user_strides = _strides(shape)
        self.own_strides = _strides(self.extent)
        cut = [i for i, (a, b) in enumerate(bounds) if (a, b) != (0, shape[i])]
        # Elements contiguous in the user's tensor: the last cut dimension's extent times all after it.
        self.run = self.extent[cut[-1]] * self.user_strides[cut[-1]] if cut else max(math.prod(shape), 1)
        self.numel = math.prod(self.extent)

    def user_runs(self, start: int, end: int) -> Iterator[tuple[int, int, int]]:
        """(user flat position, own flat position, length) of the runs covering own elements ``[start, end)``."""
        at = start
        while at < end:
            length = min(end, (at // self.run + 1) * self.run) - at
            index = _unravel(at, self.extent, self.own_strides)
            yield sum((i + lo) * s for i, lo, s in zip(index, self.lo, self.user_strides)), at, length
            at += length

    def own(self, user_at: int) -> int | None:
        """This piece's flat position of the user tensor's element ``user_at`` (None: not in this piece)."""
        index = _unravel(user_at, self.shape, self.user_strides)
        if any(not lo <= i < hi for i, lo, hi in zip(index, self.lo, self.hi)):
            return None
        return sum((i - lo) * s for i, lo, s in zip(index, self.lo, self.own_strides))


def _strides(shape) -> list[int]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return strides[::-1]


def _unravel(flat: int, shape, strides) -> list[int]:
    return [(flat // s) % d if d else 0 for d, s in zip(shape, strides)]


class StoredParams:
    """The checkpoint's parameters, asked for by the engine's held names (see [Note: loading across
    compositions]). Used by `zkernel.checkpoint.load` in place of the index's own lookups."""

    def __init__(self, index: CheckpointIndex, target: ParamMap) -> None:
        self.index = index
        self.target = target
        self.source = ParamMap.from_json(index.manifest.get("composed", []))
        self._regions: dict[str, tuple[_Region, list[_Region]]] = {}
        self._stored_shapes: dict[str, tuple[int, ...]] | None = None
        self._excluded_users: set[str] | None = None

    # -- what both sides call the user's parameters ---------------------------------------------

    def stored_user_shapes(self) -> dict[str, tuple[int, ...]]:
        """The user's parameters in the checkpoint (those left out as frozen too), with their shapes."""
        if self._stored_shapes is None:
            tables = (self.index.params, self.index.excluded)
            shapes = {name: tuple(param["shape"]) for table in tables for name, param in table.items()}
            self._stored_shapes = _user_shapes(self.source, shapes)
        return self._stored_shapes

    def excluded(self, held: str) -> bool:
        """Whether the user's parameter ``held`` belongs to was left out of the checkpoint as frozen ([Note:
        frozen parameters left out] in `zkernel.checkpoint.save`): the engine keeps its own values."""
        if not self.index.excluded:
            return False
        if self._excluded_users is None:
            self._excluded_users = {self.source.user_name(name)[0] for name in self.index.excluded}
        return self.target.user_name(held)[0] in self._excluded_users

    def user_shapes(self, held: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """The user's parameters of the engine, from its held parameters' shapes."""
        return _user_shapes(self.target, held)

    # -- reads -------------------------------------------------------------------------------------

    def direct(self, held: str) -> bool:
        """Whether ``held`` is stored under its own name with the same region of the same user tensor."""
        return held in self.index.params and self.source.user_name(held) == self.target.user_name(held)

    def value_kind(self, held: str) -> str:
        """"master" or "param": where the stored values of ``held``'s elements are."""
        if self.direct(held):
            return self.index.value_kind(held)
        kinds = {self.index.value_kind(r.name) for r in self._stored_regions(held)}
        if len(kinds) != 1:
            raise CheckpointError(
                f"parameter {self.target.user_name(held)[0]!r} was saved partly frozen, partly trained "
                f"(pieces stored as {sorted(kinds)}) in checkpoint {self.index.dir}"
            )
        return kinds.pop()

    def add(self, batch: ReadBatch, held: str, kind: str, start: int, out: torch.Tensor) -> None:
        """Elements ``[start, start + out.numel())`` of ``kind`` of held parameter ``held`` into ``out``."""
        if self.direct(held):
            batch.add(held, kind, start, out)
            return
        mine, stored = self._ensure(held)
        for name, at, offset, length in _merged(_translate(mine, stored, start, start + out.numel())):
            batch.add(name, kind, at, out[offset : offset + length])

    def scalar(self, held: str, state_name: str):
        """The stored per-parameter scalar ``state_name`` of ``held`` ([dtype, value]; None if not stored)."""
        if self.direct(held):
            return self.index.params[held]["scalars"].get(state_name)
        scalars = (self.index.params[r.name]["scalars"] for r in self._stored_regions(held))
        values = {repr(found.get(state_name)): found for found in scalars}
        if len(values) != 1:
            raise CheckpointError(
                f"optimizer state {state_name!r} differs between the stored pieces of parameter "
                f"{self.target.user_name(held)[0]!r} in checkpoint {self.index.dir} ({sorted(values)[:4]}), so it "
                "cannot be given to pieces cut another way"
            )
        return next(iter(values.values())).get(state_name)

    def _stored_regions(self, held: str) -> list[_Region]:
        return self._ensure(held)[1]

    def _ensure(self, held: str) -> tuple[_Region, list[_Region]]:
        """(the engine's region of ``held``, the stored pieces of its user tensor), built once a parameter."""
        found = self._regions.get(held)
        if found is None:
            user, _ = self.target.user_name(held)
            composed = self.target.composed.get(user)
            shape = composed.shape if composed is not None else self.stored_user_shapes()[user]
            mine = next(p for p in self.target.pieces(user) if p.name == held)
            found = self._regions[held] = (_Region(shape, mine), [_Region(shape, p) for p in self.source.pieces(user)])
        return found


def _user_shapes(param_map: ParamMap, held: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    out = {}
    for name, shape in held.items():
        user = param_map.user_name(name)[0]
        composed = param_map.composed.get(user)
        out[user] = tuple(composed.shape) if composed is not None else shape
    return out


def _translate(mine: _Region, stored: list[_Region], start: int, end: int) -> Iterator[tuple[str, int, int, int]]:
    """(stored piece, its flat position, offset into the request, length) covering ``mine``'s ``[start, end)``."""
    last = stored[0]
    for user_at, own_at, length in mine.user_runs(start, end):
        at, stop = user_at, user_at + length
        while at < stop:
            position = last.own(at)
            if position is None:
                found = [(r, p) for r in stored if (p := r.own(at)) is not None]
                if not found:
                    raise CheckpointError(
                        f"the stored pieces of the parameter holding {mine.name!r} do not cover its element {at}"
                    )
                last, position = found[0]
            take = min(last.run - position % last.run, stop - at)
            yield last.name, position, own_at - start + (at - user_at), take
            at += take


def _merged(ranges: Iterator[tuple[str, int, int, int]]) -> Iterator[tuple[str, int, int, int]]:
    """``ranges`` with neighbours contiguous in both the stored piece and the request joined."""
    pending = None
    for name, at, offset, length in ranges:
        if pending is not None:
            p_name, p_at, p_offset, p_length = pending
            if p_name == name and p_at + p_length == at and p_offset + p_length == offset:
                pending = (name, p_at, p_offset, p_length + length)
                continue
            yield pending
        pending = (name, at, offset, length)
    if pending is not None:
        yield pending
