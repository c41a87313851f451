"""zkernel and ``torch.compile``: hooks that run between graphs, compiled modules as ZeRO-3 units.

[Note: hooks under torch.compile] A user compiles a model or each of its blocks
(``block.compile()``, ``torch.compile(model)``), as FSDP2's users do. Dynamo
then traces ``nn.Module.__call__`` with its hooks, so zero3's pre- and
post-forward hooks would be traced into the graph: their gathers, releases and
the parameters' class swaps (see [Note: released-parameter trap]) are side
effects a graph cannot hold, and tracing them fails. Each hook must run as
Python between graphs, as FSDP2's do.

``torch.compiler.disable`` does that, but importing Dynamo takes ~2 s (a cost
every training process would pay at ``initialize`` whether it compiles or not)
and its wrapper costs ~1 us a call in eager mode. So the hook checks
``torch.compiler.is_compiling()``, a flag read in eager mode and a constant
True while Dynamo traces. Traced, it calls the hook through
``torch._dynamo.disable``, which Dynamo does not trace either: the graph breaks
there and the hook runs eagerly with Dynamo off, so nothing it calls is
compiled. The graph of the module's forward then sees whole parameters, as in
an eager step. The trap of a released parameter (a tied head reading the
embedding's weight inside a compiled forward) runs eagerly the same way; by
the time it runs, Dynamo's own inspection of the parameter may have fetched it
already, and then the call simply runs on the whole values.

[Note: compiled units] Every zero3 unit's hooks break the graph around the
unit. Under ``units = "modules"`` the units inside a compiled block are its
Linears and norms, so the block would compile into a graph per layer, with
eager Python between them, which loses most of what compiling gained
(measured: BENCHMARKS.md, "Figures formerly in docstrings"). So a module compiled in place (``block.compile()``, before
``initialize``) is one unit holding its whole subtree under either policy, as
FSDP2's users wrap each block they compile: its forward stays one graph, its
parameters are gathered in one piece. The root is left to the policy: a whole
model compiled as one unit would be gathered whole. ``torch.compile(model)``
returns a wrapper and marks no module, so the policy decides its units and
each breaks the graph; compile the blocks instead where speed matters.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn


def eager_hook(hook: Callable) -> Callable:
    """``hook``, run eagerly even where ``torch.compile`` traces its caller (see [Note: hooks under torch.compile])."""

    @functools.wraps(hook)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            from torch import _dynamo

            return _dynamo.disable(hook, recursive=True)(*args, **kwargs)
        return hook(*args, **kwargs)

    return call


def compiled_in_place(module: nn.Module) -> bool:
    """Whether ``module.compile()`` was called on ``module`` (torch keeps the compiled call on it)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def with_compiled_units(root: nn.Module, unit_ids: set[int]) -> set[int]:
    """``unit_ids`` (ids of the modules that are units) with every module compiled in place below
    ``root`` made a unit of its whole subtree (see [Note: compiled units])."""
    compiled = [m for m in root.modules() if m is not root and compiled_in_place(m)]
    if not compiled:
        return unit_ids
    inside = {id(d) for m in compiled for d in m.modules() if d is not m}
    return (unit_ids | {id(m) for m in compiled}) - inside
