"""A block of the user's in which every parameter is whole: the body of `Engine.gathered_parameters`.

Between steps ZeRO-3 parameters are released. For the block the scheduler
fetches every released group (``Phase.USER``), and the parameters no group
holds are watched for writes; at its end the writes made on any rank are
settled alike on every rank ([Note: writes on some ranks only], [Note:
parameters in no group] in `zkernel.params.param_writes`), folded into the
masters ([Note: writes to gathered parameters]) and the groups released again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from torch import nn

from zkernel.params import param_writes
from zkernel.spec.groups import Phase

if TYPE_CHECKING:
    from zkernel.kernel.engine import Engine

__all__ = ["gathered"]


@contextlib.contextmanager
def gathered(engine: Engine, modifier_rank: int | None) -> Iterator[nn.Module]:
    """Every parameter of ``engine``'s model whole inside the block; yields the model.

    Entered by `Engine.gathered_parameters` on every rank (each entry and exit is collective);
    ``modifier_rank``: the rank whose written values are broadcast at the end (None: values
    written must agree across ranks). Nothing is gathered or settled before the checks pass."""
    engine.unset.require("engine.gathered_parameters()")
    world_size = engine.dist.world_size
    if modifier_rank is not None and not 0 <= modifier_rank < world_size:
        raise ValueError(f"modifier_rank {modifier_rank!r} is not a rank of this world size {world_size}")
    scheduler = engine.scheduler
    engine.pipeline.wait_all()
    groups = [g for g in scheduler.bound if not g.gathered]
    with scheduler.plugin_call():
        for group in groups:
            scheduler.fetch_now(group, Phase.USER)
    grouped = {id(p) for group in engine.groups for p in group.params}
    loose = [(n, p) for n, p in engine.module.named_parameters() if id(p) not in grouped]
    # [Note: parameters in no group] in `zkernel.params.param_writes`
    param_writes.watch_loose([p for _, p in loose])
    completed = False
    try:
        yield engine.module
        completed = True
    finally:
        with scheduler.plugin_call():
            try:
                if completed:  # a block that raised may have raised on some ranks only: no collective
                    whole = [g for g in scheduler.groups if g.gathered]
                    param_writes.settle(whole, modifier_rank, world_size, loose)
            finally:
                param_writes.unwatch([p for _, p in loose])
                scheduler.fold_writes()
                for group in groups:
                    engine.hook.zkernel_release_params(group=group, phase=Phase.USER)
