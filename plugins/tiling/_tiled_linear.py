"""`TiledLinear`: one ``nn.Linear`` held as a grid of smaller Linear tiles and run tile by tile.

The weight ``W`` (``out x in``) is cut into ``rows x cols`` tiles along its
output and input features (sizes differing by at most one, as
``torch.tensor_split`` cuts). Tile ``(i, j)`` is an ``nn.Linear`` of its own
holding ``W[rows_i, cols_j]`` (and, for ``j == 0``, ``bias[rows_i]``), so a
partitioner that gathers per module gathers one tile at a time. The output
is ``cat_i(sum_j tile_ij(x[..., cols_j]))``: output tiles are concatenated,
input tiles summed.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import nn

from zkernel.params.param_map import ComposedParam, Piece, install_state_dict_hooks


def split_bounds(size: int, parts: int) -> tuple[tuple[int, int], ...]:
    """``parts`` contiguous ranges covering ``range(size)``, sizes differing by at most one."""
    q, r = divmod(size, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + q + (1 if i < r else 0)
        bounds.append((start, stop))
        start = stop
    return tuple(bounds)


class LinearTile(nn.Linear):
    """One tile: an ``nn.Linear`` initialised with the whole layer's fan-in.

    ``reset_parameters`` draws from the distribution ``nn.Linear`` uses for the
    whole layer (uniform in +-1/sqrt(layer_in_features)), so a model built on
    the meta device and materialised tile by tile is initialised like the
    untiled one; an ``init_fn`` that initialises ``nn.Linear`` modules applies
    to tiles as well.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool, layer_in_features: int, device=None, dtype=None) -> None:
        self.layer_in_features = layer_in_features
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.layer_in_features) if self.layer_in_features > 0 else 0.0
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)


class TiledLinear(nn.Module):
    """Computes what an ``nn.Linear(in_features, out_features)`` computes, one tile at a time.

    ``weight`` and ``bias`` read as the whole layer's tensors (assembled from
    the tiles, differentiable, not writable), ``state_dict`` holds them under
    those names, and ``zkernel_composed_parameters`` tells `zkernel.params.param_map`
    which tile holds which slice.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool, rows: int, cols: int, device=None, dtype=None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.row_bounds = split_bounds(out_features, rows)
        self.col_bounds = split_bounds(in_features, cols)
        self.tiles = nn.ModuleList(
            LinearTile(
                c1 - c0, r1 - r0, bias=bias and j == 0, layer_in_features=in_features, device=device, dtype=dtype
            )
            for r0, r1 in self.row_bounds
            for j, (c0, c1) in enumerate(self.col_bounds)
        )
        self._param_map_hooks = install_state_dict_hooks(self)

    @classmethod
    def from_linear(cls, linear: nn.Linear, rows: int, cols: int) -> TiledLinear:
        """Tiles holding ``linear``'s values (none when it is on the meta device), same dtype and device."""
        weight = linear.weight
        tiled = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            rows=rows,
            cols=cols,
            device=weight.device,
            dtype=weight.dtype,
        )
        with torch.no_grad():
            for (name, index), tile_param in zip(tiled._piece_slices(), tiled._tile_params()):
                source = linear.get_parameter(name)
                if not source.is_meta:
                    tile_param.copy_(source[index])
                tile_param.requires_grad_(source.requires_grad)
        return tiled

    # -- computation -------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cols = len(self.col_bounds)
        # split, not slicing: its backward is one cat of the pieces' gradients, where each slice's
        # would be a zero-filled tensor of the whole input, summed with the others.
        pieces = (x,) if cols == 1 else x.split([c1 - c0 for c0, c1 in self.col_bounds], dim=-1)
        outputs = []
        for i in range(len(self.row_bounds)):
            acc = None
            for j, piece in enumerate(pieces):
                y = self.tiles[i * cols + j](piece)
                acc = y if acc is None else acc + y
            outputs.append(acc)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)

    # -- the whole layer, as the user sees it ------------------------------------------

    @property
    def weight(self) -> torch.Tensor:
        cols = len(self.col_bounds)
        rows = [
            torch.cat([self.tiles[i * cols + j].weight for j in range(cols)], dim=1) if cols > 1 else self.tiles[i * cols].weight
            for i in range(len(self.row_bounds))
        ]
        return torch.cat(rows, dim=0) if len(rows) > 1 else rows[0]

    @property
    def bias(self) -> torch.Tensor | None:
        cols = len(self.col_bounds)
        if self.tiles[0].bias is None:
            return None
        parts = [self.tiles[i * cols].bias for i in range(len(self.row_bounds))]
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def zkernel_composed_parameters(self) -> Iterator[ComposedParam]:
        """``weight`` and ``bias`` as the tiles hold them (see [Note: composed parameters])."""
        pieces: dict[str, list[Piece]] = {"weight": [], "bias": []}
        for (name, index), tile_name in zip(self._piece_slices(), self._tile_param_names()):
            pieces[name].append(Piece(tile_name, index))
        yield ComposedParam("weight", (self.out_features, self.in_features), tuple(pieces["weight"]))
        if pieces["bias"]:
            yield ComposedParam("bias", (self.out_features,), tuple(pieces["bias"]))

    def _piece_slices(self) -> Iterator[tuple[str, tuple[slice, ...]]]:
        """(whole parameter name, its region) for each tile parameter, in `_tile_params` order."""
        for r0, r1 in self.row_bounds:
            for j, (c0, c1) in enumerate(self.col_bounds):
                yield "weight", (slice(r0, r1), slice(c0, c1))
                if j == 0 and self.tiles[0].bias is not None:
                    yield "bias", (slice(r0, r1),)

    def _tile_params(self) -> Iterator[nn.Parameter]:
        for tile in self.tiles:
            yield tile.weight
            if tile.bias is not None:
                yield tile.bias

    def _tile_param_names(self) -> Iterator[str]:
        for k, tile in enumerate(self.tiles):
            yield f"tiles.{k}.weight"
            if tile.bias is not None:
                yield f"tiles.{k}.bias"

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.tiles[0].bias is not None}, tiles={len(self.row_bounds)}x{len(self.col_bounds)}"
        )
