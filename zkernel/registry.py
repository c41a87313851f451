"""Named components offered by plugins, by family."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import attrs


class Family(enum.Enum):
    """Families of selectable components, each fed by one registration hook."""

    PARTITIONER = "partitioner"
    OFFLOAD_TIER = "offload tier"
    OPTIMIZER = "optimizer"


@attrs.frozen
class Component:
    """One selectable component: what config names, and how to build it."""

    family: Family
    name: str
    factory: Callable[..., Any]
    description: str
    plugin_name: str
    # attrs class for the component's own config keys, or None when it takes none.
    options_cls: type | None = None


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
        options_cls: type | None = None,
    ) -> None:
        """Offer ``factory`` under ``name``; a second component of the same name is an error."""
        if self._family is None:
            raise RuntimeError("ComponentRegistry.add is only valid inside a registration hook")
        existing = self._components[self._family].get(name)
        if existing is not None:
            raise ValueError(
                f"{self._family.value} {name!r} is offered twice: by plugin "
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
