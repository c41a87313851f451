"""Families of selectable components, declared once, and the registry plugins fill.

[Note: declaring a family] A family (partitioner, optimizer, offload tier, ...)
is one `Family` member whose `FamilySpec` says which registration hook offers
its components and which config keys select them (a `Slot` each: the dotted key
holding the component's name, the dotted key holding its options, and any extra
arguments its factory takes). `zkernel.kernel.plugin_manager` collects components by
walking the families, `resolve_components` resolves every slot, and
`zkernel.kernel.bootstrap.initialize` builds every selected component from the
resolved slots, so adding a family means: its hook spec in `zkernel.spec.hookspecs`,
its section in `zkernel.spec.config`, and one member here.

A family whose components change the model before it is partitioned (tiling,
activation checkpointing) also names its *apply* hook in the spec; the
selected component then joins the runtime manager and `zkernel.kernel.transforms`
calls that hook on the model, family by family in declaration order, with no
further code per family (see [Note: model transforms] there).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import attrs


@attrs.frozen
class Slot:
    """One config selection of a family's component."""

    # Dotted config path of the selected name, e.g. "offload.optimizer".
    key: str
    # Dotted config path of the component's own options (a mapping), e.g. "offload.optimizer_options".
    options: str
    # Dotted config path of the section whose own keys sit beside the options (named in errors), or "".
    section: str = ""
    # Extra positional arguments of the factory after the context, e.g. the tier's role.
    factory_args: tuple[Any, ...] = ()


@attrs.frozen
class FamilySpec:
    label: str  # as `zkernel plugins` prints it
    hook: str  # the registration hook that offers components of this family
    slots: tuple[Slot, ...]
    # The hook that applies the selected component to the model before partitioning, or "".
    apply: str = ""


class Family(enum.Enum):
    """Families of selectable components (see [Note: declaring a family])."""

    PARTITIONER = FamilySpec(
        "partitioner", "zkernel_register_partitioners", (Slot("partitioner", "partitioner_options"),)
    )
    OFFLOAD_TIER = FamilySpec(
        "offload tier",
        "zkernel_register_offload_tiers",
        (
            Slot("offload.optimizer", "offload.optimizer_options", factory_args=("optimizer",)),
            Slot("offload.params", "offload.params_options", factory_args=("params",)),
        ),
    )
    OPTIMIZER = FamilySpec(
        "optimizer", "zkernel_register_optimizers", (Slot("optimizer.name", "optimizer.options", "optimizer"),)
    )
    # Model transforms, applied in this order: tiling replaces layers, checkpointing wraps blocks.
    TILING = FamilySpec(
        "tiling",
        "zkernel_register_tilings",
        (Slot("tiling.name", "tiling.options", "tiling"),),
        apply="zkernel_apply_tiling",
    )
    ACTIVATION_CHECKPOINTING = FamilySpec(
        "activation checkpointing",
        "zkernel_register_activation_checkpointers",
        (Slot("activation_checkpointing.name", "activation_checkpointing.options", "activation_checkpointing"),),
        apply="zkernel_apply_activation_checkpointing",
    )
    LR_SCHEDULE = FamilySpec(
        "lr schedule",
        "zkernel_register_lr_schedules",
        (Slot("lr_schedule.name", "lr_schedule.options", "lr_schedule"),),
    )
    # Resolves "auto" in the config before the others are resolved (see `zkernel.kernel.planning`).
    PLANNER = FamilySpec("planner", "zkernel_register_planners", (Slot("planner.name", "planner.options", "planner"),))

    @property
    def label(self) -> str:
        return self.value.label

    @property
    def hook(self) -> str:
        return self.value.hook

    @property
    def slots(self) -> tuple[Slot, ...]:
        return self.value.slots

    @property
    def apply(self) -> str:
        return self.value.apply


@attrs.frozen
class Component:
    """One selectable component: what config names, and how to build it."""

    family: Family
    name: str
    factory: Callable[..., Any]
    description: str
    plugin_name: str
    # attrs class for the component's own config keys, or None when it takes none; or, for a
    # family whose slots pass an argument (a tier's role), a mapping from it to such a class.
    options_cls: type | dict[Any, type | None] | None = None

    def options_for(self, slot: Slot) -> type | None:
        """The options class for ``slot`` (by its first factory argument when given per slot)."""
        if isinstance(self.options_cls, dict):
            return self.options_cls.get(slot.factory_args[0] if slot.factory_args else None)
        return self.options_cls


class ComponentRegistry:
    """What the registration hooks write into: ``registry.add(name, factory, ...)``.

    One registry instance is handed to each registration hook with its family
    and the name of the plugin being asked, so a component knows where it came
    from (``zkernel plugins`` prints it).
    """

    def __init__(self) -> None:
        self._components: dict[Family, dict[str, Component]] = {f: {} for f in Family}
        self._family: Family | None = None
        self._plugin_name = "?"

    def bind(self, family: Family, plugin_name: str) -> ComponentRegistry:
        """Return a view that adds components of ``family`` on behalf of ``plugin_name``."""
        view = ComponentRegistry.__new__(ComponentRegistry)
        view._components = self._components
        view._family = family
        view._plugin_name = plugin_name
        return view

    def add(
        self,
        name: str,
        factory: Callable[..., Any],
        *,
        description: str = "",
        options_cls: type | dict[Any, type | None] | None = None,
    ) -> None:
        """Offer ``factory`` under ``name``; a second component of the same name is an error."""
        if self._family is None:
            raise RuntimeError("ComponentRegistry.add is only valid inside a registration hook")
        existing = self._components[self._family].get(name)
        if existing is not None:
            raise ValueError(
                f"{self._family.label} {name!r} is offered twice: by plugin "
                f"{existing.plugin_name!r} and by plugin {self._plugin_name!r}; "
                "block one of them with `blocked_plugins`"
            )
        self._components[self._family][name] = Component(
            family=self._family,
            name=name,
            factory=factory,
            description=description,
            plugin_name=self._plugin_name,
            options_cls=options_cls,
        )

    def get(self, family: Family, name: str) -> Component | None:
        return self._components[family].get(name)

    def names(self, family: Family) -> list[str]:
        return sorted(self._components[family])

    def components(self, family: Family) -> list[Component]:
        return [self._components[family][n] for n in self.names(family)]
