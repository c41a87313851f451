"""Choosing modules of a model by class name or by an fnmatch pattern of their names.

Used by every config key that names modules (``activation_checkpointing.modules``,
zero3's ``leaf_modules``), so they all read the same way and fail the same way.
"""

from __future__ import annotations

import fnmatch

from torch import nn

from zkernel.spec.config import ConfigError


def select_modules(model: nn.Module, selectors: tuple[str, ...], key: str) -> list[tuple[str, nn.Module]]:
    """Modules matching a class name or a name pattern, outermost only, in model order.

    A selector that matches nothing is an error naming the config ``key`` and listing what could match.
    """
    if not selectors:
        return []
    named = list(model.named_modules())
    matched: dict[int, tuple[str, nn.Module]] = {}
    for selector in selectors:
        hits = [(n, m) for n, m in named if type(m).__name__ == selector or fnmatch.fnmatchcase(n, selector)]
        if not hits:
            classes = sorted({type(m).__name__ for _, m in named})
            raise ConfigError(
                f"{key} {selector!r} matches no module (by class name or by fnmatch pattern of module "
                f"names); classes in the model: {', '.join(classes[:12])}" + (", ..." if len(classes) > 12 else "")
            )
        for name, module in hits:
            matched.setdefault(id(module), (name, module))
    chosen = []
    for name, module in matched.values():
        inside = any(
            other_name != name and (other_name == "" or name.startswith(other_name + "."))
            for other_name, _ in matched.values()
        )
        if not inside:
            chosen.append((name, module))
    return chosen
