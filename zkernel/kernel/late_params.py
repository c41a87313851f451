"""Parameters added to the model after ``initialize`` are refused at the next forward.

[Note: parameters added after initialize] The engine partitions, steps and
checkpoints the parameters the model had when it was built: its groups, hooks,
masters and optimizer state are made from them once. A module attached later
(``model.extra = nn.Linear(...)``, a module replaced, ``resize_token_embeddings``
building a new embedding), or a parameter registered on a module of the model
(``model.fc.scale = nn.Parameter(...)``, a parameter replaced by a new one),
took part in forward and filled its ``.grad``, but no optimizer ever stepped it,
no checkpoint held it and no rank reduced its gradient: training went on wrong
without a word, on every partitioner (DeepSpeed behaves alike). Managing them
late would mean re-partitioning, new optimizer state and new hooks on every
rank at once; the engine refuses them instead, naming them and what to do.

Detection costs nothing per pass: while an engine is alive, torch's global
registration hooks (``register_module_parameter_registration_hook``,
``register_module_module_registration_hook``: ``__setattr__``,
``register_parameter``, ``add_module``, ``ModuleList.append`` all call them)
note a registration on a module of the model (a set lookup; modules built
elsewhere are ignored). Only then does the next forward entry walk the
model's parameters once for ones the engine does not know; a registration
that added none (a parameterless module, a module assigned again) clears the
note. The walk runs at the forward entry, before any fetch or collective, on
local state only: every rank that changed its model alike raises alike, at
the same forward (a change made on some ranks only diverges them as any
rank-dependent code does). Writes bypassing ``nn.Module`` (``module._parameters[name] = p``) are
not seen.
"""

from __future__ import annotations

import weakref

from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook, register_module_parameter_registration_hook


class LateParameterError(RuntimeError):
    """The model gained parameters after ``zkernel.initialize``, which the engine would never train."""


class LateParameters:
    """Notes registrations on ``root``'s modules; `check` refuses parameters it did not have at construction."""

    def __init__(self, root: nn.Module) -> None:
        self._root = weakref.ref(root)  # the global hooks hold this object: it must not keep the model alive
        self._known = {id(p) for p in root.parameters()}
        self._modules = {id(m) for m in root.modules()}
        self.changed = False  # a module or parameter was registered on a module of the model since the last check
        self.handles = [
            register_module_parameter_registration_hook(self._registered),
            register_module_module_registration_hook(self._registered),
        ]

    def _registered(self, module: nn.Module, _name: str, value) -> None:
        if value is not None and id(module) in self._modules:
            self.changed = True

    def check(self) -> None:
        """Raise `LateParameterError` if the model holds parameters it did not have at construction.
        Local (no collective); walks the model only after a registration on it."""
        if not self.changed:
            return
        root = self._root()
        if root is None:
            return
        self._modules = {id(m) for m in root.modules()}  # a module added without parameters may gain some later
        late = [name for name, p in root.named_parameters() if id(p) not in self._known]
        if not late:
            self.changed = False
            return
        raise LateParameterError(_message(root, late))


def _message(root: nn.Module, late: list[str]) -> str:
    new_modules = []  # the outermost modules whose parameters are all new: what was attached or replaced
    for name, module in root.named_modules():
        if name and not any(name.startswith(m + ".") for m, _ in new_modules):
            own = [n for n, _ in module.named_parameters(prefix=name)]
            if own and all(n in late for n in own):
                new_modules.append((name, type(module).__name__))
    shown = ", ".join(repr(n) for n in late[:8]) + (f" and {len(late) - 8} more" if len(late) > 8 else "")
    modules = ", ".join(f"{name!r} ({kind})" for name, kind in new_modules[:4])
    where = f" (new modules: {modules})" if modules else ""
    return (
        f"the model gained parameters after zkernel.initialize: {shown}{where}. The engine partitions, steps "
        "and checkpoints only the parameters the model had at initialize; these would fill .grad and never "
        "train. Add modules and parameters before zkernel.initialize, or call engine.close(), change the model "
        "and call zkernel.initialize again"
    )
