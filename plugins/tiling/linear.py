"""Tiling ``linear``: memory-centric tiling of large ``nn.Linear`` layers (ZeRO-Infinity).

Algorithm. Every ``nn.Linear`` that ``[tiling] modules`` names (fnmatch
patterns of module names) or whose weight has at least ``min_numel``
elements is replaced, at `zkernel.initialize` before partitioning, by a
`TiledLinear` of ``tiles`` tiles along its output features (``split =
"output"``: tile outputs are concatenated) or its input features (``split =
"input"``: partial products are summed). ``split = "auto"`` (the default)
cuts along the larger of the two ([Note: which side to cut]).
Each tile is a module with parameters of its own, so zero3 makes each one a
unit, gathered before the tile runs and released after it (forward and
backward alike): the layer's gathered working memory falls from the whole
weight to one tile's (plus what ``prefetch_bytes`` lets the prefetcher hold
ahead), and a layer too large to gather whole trains. Gradients of a tile are
reduced as soon as that tile's backward ran. Under partitioners that keep
parameters whole, tiling changes nothing but the order of the arithmetic.

Names stay the user's: the tiled module answers ``weight``/``bias``, keeps
them in ``state_dict`` and declares its pieces to `zkernel.params.param_map`.
`Engine.close` puts the original ``nn.Linear`` objects back, holding the
trained values. A layer whose weight or bias is tied to another module's,
or a module reachable under two names, cannot be split without breaking the
tie: naming one is an error, ``min_numel`` skips it. ``nn.Linear``
subclasses with a forward of their own are left alone the same way.
"""

from __future__ import annotations

import fnmatch

import attrs
import torch
from torch import nn

from zkernel.spec import hookimpl
from zkernel.spec.config import ConfigError
from zkernel.telemetry.log import get_logger

from ._tiled_linear import TiledLinear

log = get_logger()

SPLITS = ("auto", "output", "input")


@attrs.frozen(kw_only=True)
class LinearTilingOptions:
    """``[tiling]`` options of the ``linear`` component."""

    # Along which features a layer is cut: "output" (rows of the weight), "input" (columns), or
    # "auto": output features when there are at least as many as input features, else input.
    split: str = attrs.field(default="auto", validator=attrs.validators.in_(SPLITS))


@attrs.frozen
class _Tiled:
    """One replacement: where the layer sat and the original module, to put back at close."""

    name: str
    original: nn.Linear


class LinearTiling:
    """Replaces the selected ``nn.Linear`` layers by `TiledLinear` (see the module docstring)."""

    def __init__(self, context) -> None:
        self.section = context.config.tiling
        self.options = context.options or LinearTilingOptions()
        self.tiled: list[_Tiled] = []

    @hookimpl
    def zkernel_apply_tiling(self, module, context):
        if not self.section.modules and self.section.min_numel == 0:
            return
        for name, linear in self._select(module):
            self._tile(module, name, linear)
        log.debug("zkernel.tiling.applied", layers=[t.name for t in self.tiled], tiles=self.section.tiles)

    @hookimpl
    def zkernel_restore_module(self, module):
        for entry in reversed(self.tiled):
            tiled = module.get_submodule(entry.name)
            original = entry.original
            with torch.no_grad():
                _put_back(original.weight, tiled.weight.detach().clone())
                if original.bias is not None:
                    _put_back(original.bias, tiled.bias.detach().clone())
            _set_submodule(module, entry.name, original)
        self.tiled.clear()

    # -- selection ------------------------------------------------------------------

    def _select(self, model: nn.Module) -> list[tuple[str, nn.Linear]]:
        linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        names_of = _names_by_module(model)
        owners_of = _owners_by_param(model)
        chosen: dict[str, nn.Linear] = {}
        for pattern in self.section.modules:
            matched = [(n, m) for n, m in linears if fnmatch.fnmatchcase(n, pattern)]
            if not matched:
                listed = ", ".join(n for n, _ in linears[:8]) + (", ..." if len(linears) > 8 else "")
                raise ConfigError(
                    f"tiling.modules pattern {pattern!r} matches no nn.Linear module; "
                    f"nn.Linear modules: {listed or '(none)'}"
                )
            for name, linear in matched:
                problem = _untileable(name, linear, names_of, owners_of)
                if problem:
                    raise ConfigError(f"tiling.modules pattern {pattern!r} selects {name!r}, which {problem}")
                chosen[name] = linear
        if self.section.min_numel > 0:
            for name, linear in linears:
                if name in chosen or linear.weight.numel() < self.section.min_numel:
                    continue
                problem = _untileable(name, linear, names_of, owners_of)
                if problem:
                    log.info("zkernel.tiling.skipped", module=name, reason=problem)
                    continue
                chosen[name] = linear
        return list(chosen.items())

    # -- replacement -------------------------------------------------------------------

    def _tile(self, model: nn.Module, name: str, linear: nn.Linear) -> None:
        tiles = self.section.tiles
        split = self._split_of(linear)
        rows = min(tiles, linear.out_features) if split == "output" else 1
        cols = min(tiles, linear.in_features) if split == "input" else 1
        tiled = TiledLinear.from_linear(linear, rows=max(rows, 1), cols=max(cols, 1))
        _set_submodule(model, name, tiled)
        # The original keeps its Parameter objects (restored at close) but not their storage.
        for param in (linear.weight, linear.bias):
            if param is not None and not param.is_meta:
                param.data = param.data.new_empty(0)
        self.tiled.append(_Tiled(name, linear))

    def _split_of(self, linear: nn.Linear) -> str:
        """The side ``linear`` is cut along.

        [Note: which side to cut] Cut along the outputs, the tiles share the
        whole input, so backward sums ``tiles`` input gradients of the whole
        input's size; cut along the inputs, forward sums ``tiles`` partial
        outputs of the whole output's size, and backward joins the input
        pieces' gradients in one copy. Either way the extra arithmetic is
        ``tiles - 1`` additions of the smaller side, when the layer is cut
        along its larger side (a GPT MLP: ``fc`` along its outputs, ``out``
        along its inputs).
        """
        if self.options.split != "auto":
            return self.options.split
        return "output" if linear.out_features >= linear.in_features else "input"


def _put_back(param: nn.Parameter, value: torch.Tensor) -> None:
    """Give ``param`` (the original layer's, kept at tiling) the trained ``value``, same object.

    ``.data`` cannot move a tensor between the meta device and real storage (a
    layer built on meta, or a closed model left on meta), so there the whole
    tensor is swapped in place.
    """
    if param.is_meta != value.is_meta:
        torch.utils.swap_tensors(param, nn.Parameter(value, requires_grad=param.requires_grad))
    else:
        param.data = value


def _untileable(name: str, linear: nn.Linear, names_of: dict, owners_of: dict) -> str:
    """Why ``linear`` cannot be tiled, or ""."""
    if type(linear).forward is not nn.Linear.forward:
        return f"is a {type(linear).__name__} with a forward of its own (only nn.Linear's computation can be tiled)"
    if len(names_of[id(linear)]) > 1:
        return f"is reachable under several names ({', '.join(names_of[id(linear)])}); tiling one would untie them"
    for pname in ("weight", "bias"):
        param = getattr(linear, pname)
        if param is not None and len(owners_of[id(param)]) > 1:
            others = sorted(owners_of[id(param)] - {f"{name}.{pname}" if name else pname})
            return f"shares its {pname} with {', '.join(others)} (tied); tiling it would untie them"
    return ""


def _names_by_module(model: nn.Module) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        out.setdefault(id(module), []).append(name)
    return out


def _owners_by_param(model: nn.Module) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(param), set()).add(name)
    return out


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    if not name:
        raise ConfigError("tiling cannot replace the model itself; select a submodule")
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, module)


@hookimpl
def zkernel_register_tilings(registry) -> None:
    registry.add(
        "linear",
        LinearTiling,
        description="splits large nn.Linear layers into tiles along output (or input) features, each its own unit",
        options_cls=LinearTilingOptions,
    )
