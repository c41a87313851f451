"""Where a forward of the model may begin, and the model's own ``generate`` around its forwards.

The scheduler brackets each pass at these modules' hooks ([Note: forward entry] in
`zkernel.kernel.scheduler`) and lets a ``generate`` read released parameters ([Note: reads inside generate]).
"""

from __future__ import annotations

import weakref

from torch import nn


def entry_modules(root: nn.Module, depth: int = 2) -> list[nn.Module]:
    """The root and the modules within ``depth`` levels of it: where a forward may begin (see
    [Note: forward entry]). Few, and each runs once a pass, so their hooks cost nothing measurable."""
    entries = [root]
    level = [root]
    seen = {id(root)}
    for _ in range(depth):
        level = [child for module in level for child in module.children() if id(child) not in seen]
        seen.update(id(m) for m in level)
        entries.extend(level)
    return entries


class GenerateGuarded:
    """[Note: reads inside generate] A model's own ``generate`` may read its parameters between the
    forwards it runs: BLIP-2's reads the root's ``query_tokens`` after running the vision tower and
    the Q-Former, and before the language model's ``generate``. Outside a forward that read raised
    `ReleasedParameterError`. Every rank runs the same ``generate`` (Hugging Face's ``synced_gpus``,
    which ZeRO-3 needs anyway), so a fetch there is as safe as inside a forward: while an entry
    module's ``generate`` runs, a read of a released parameter fetches its group as the guard does
    in a forward ([Note: guard] in `zkernel.kernel.scheduler`), which keeps it whole from then on. Each
    forward ``generate`` runs is still a pass of its own, traced and prefetched as before. An
    instance attribute wraps the class's method until the engine removes its hooks; the module is
    held weakly, so this handle keeps nothing alive."""

    def __init__(self, module: nn.Module, scheduler_ref) -> None:
        """Wrap ``module.generate``; ``scheduler_ref`` is a weak reference to the scheduler whose
        ``generating`` count the wrapper keeps while it runs."""
        self._module = weakref.ref(module)
        self._own = module.__dict__.get("generate")  # an instance attribute the user set, put back on removal
        method = module.generate

        def generate(*args, **kwargs):
            scheduler = scheduler_ref()
            if scheduler is None:
                return method(*args, **kwargs)
            scheduler.generating += 1
            try:
                return method(*args, **kwargs)
            finally:
                scheduler.generating -= 1

        generate.__wrapped__ = method
        generate.__doc__ = method.__doc__
        module.generate = generate

    def remove(self) -> None:
        module = self._module()
        if module is None or "generate" not in module.__dict__:
            return
        if self._own is not None:
            module.generate = self._own
        else:
            del module.generate
