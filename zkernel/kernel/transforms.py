"""Model transforms: the selected components that change the model before it is partitioned.

[Note: model transforms] Some families do not hold model state but change
the model itself: tiling replaces large ``nn.Linear`` layers by tiles,
activation checkpointing makes blocks recompute their activations. Each such
family names an *apply* hook in its `zkernel.spec.registry.FamilySpec`. At
`zkernel.initialize` the selected component of every such family is built
and registered on the runtime manager (`register_transforms`), and its apply
hook runs on the model (`apply_transforms`), family by family in declaration
order, after the partitioner is built and before it partitions: a partitioner
sees the transformed model, so tiles become units of their own, and the
parameter names recorded for `Engine.close` are the transformed ones.
`Engine.close` calls ``zkernel_restore_module`` once the parameters are whole
again, which undoes the transforms in reverse order. A transform family has
exactly one slot; a component whose selection selects nothing (empty
``modules``) leaves the model as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import pluggy
from torch import nn

from zkernel.spec.registry import Family


def transform_families() -> list[Family]:
    """The families whose components change the model, in the order they are applied."""
    return [family for family in Family if family.apply]


def register_transforms(runtime: pluggy.PluginManager, selection: Mapping[str, Any], context: Any) -> None:
    """Build the selected component of every transform family and register it on ``runtime``."""
    for family in transform_families():
        (slot,) = family.slots
        selected = selection[slot.key]
        runtime.register(selected.build(context), name=f"{family.label}:{selected.component.name}")


def apply_transforms(
    runtime: pluggy.PluginManager, model: nn.Module, selection: Mapping[str, Any], context: Any
) -> None:
    """Run each transform family's apply hook on ``model``, in declaration order."""
    for family in transform_families():
        (slot,) = family.slots
        apply = getattr(runtime.hook, family.apply)
        apply(module=model, context=attrs.evolve(context, options=selection[slot.key].options))
