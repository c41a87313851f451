"""Families of selectable components, declared once, and the registry plugins fill.

[Note: declaring a family] A family (partitioner, optimizer, offload tier, ...)
is one `Family` member whose `FamilySpec` says, once: which registration hook
offers its components; which config keys select them and so how many may be
selected at once (a `Slot` each: the dotted key holding the component's name,
the dotted key holding its options, any extra arguments its factory takes,
whether the planner may choose it, what it needs of other slots); and its config
section (the table's key and its schema in `zkernel.spec.sections`). Everything
else is driven from that declaration: `zkernel.spec.config.Config` gets the
section as a field, `config_from_dict` builds it and `section_keys` lists it;
`zkernel.kernel.plugin_manager` collects components by walking the families and
`resolve_components` resolves every slot through `ComponentRegistry.select`;
`zkernel.kernel.bootstrap.initialize` builds every selected component from the
resolved slots; ``zkernel plugins`` lists components by family and ``zkernel
config`` prints the sections and checks every selection. Adding a family
means: its hook spec in `zkernel.spec.hookspecs`, its section's schema in
`zkernel.spec.sections` (if it has a table), and one member here.

A family whose components change the model before it is partitioned (tiling,
activation checkpointing) also names its *apply* hook in the spec; the
selected component then joins the runtime manager and `zkernel.kernel.transforms`
calls that hook on the model, family by family in declaration order, with no
further code per family (see [Note: model transforms] there).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from zkernel.errors import ConfigError
from zkernel.spec import sections
from zkernel.spec.options import build_options


# The value of a slot declared ``auto`` that asks the planner to choose (see `zkernel.kernel.planning`).
AUTO = "auto"

# [Note: capabilities] What a component can do that another slot's component may need,
# declared by the component (``registry.add(..., capabilities=...)``) and asked for by a
# slot's `Need`, so that a rule across families names no component: the kernel checks
# the capability and the error lists the installed components that declare it.
#
# A partitioner that keeps each rank's parameter shard in the ``offload.params`` tier,
# which may then hold it off the compute device.
PARAMS_ON_TIER = "params_on_tier"
# A tier that keeps what it holds on the compute device (it offloads nothing).
ON_COMPUTE_DEVICE = "on_compute_device"
# A partitioner that materialises a model built on the meta device (with ``init_fn``).
MATERIALIZES_META = "materializes_meta"
# An optimizer that steps some parameters with their own learning rate, weight decay,
# betas and eps (``optimizer.param_groups``, ``optimizer.no_weight_decay``).
PER_PARAM_HYPER = "per_param_hyper"


@attrs.frozen
class Need:
    """A slot's component needs the component selected at ``key`` to declare ``capability``,
    unless it declares ``unless`` itself. ``why`` (with ``{name}``, the other component's
    name) says what goes wrong otherwise."""

    key: str
    capability: str
    unless: str = ""
    why: str = ""


@attrs.frozen
class Slot:
    """One config selection of a family's component."""

    # Dotted config path of the selected name, e.g. "offload.optimizer".
    key: str
    # Dotted config path of the component's own options (a mapping), e.g. "offload.optimizer_options".
    options: str
    # Extra positional arguments of the factory after the context, e.g. the tier's role.
    factory_args: tuple[Any, ...] = ()
    # The planner may choose it: the value `AUTO` is resolved at `initialize` (`zkernel.kernel.planning`).
    auto: bool = False
    # What the selected component needs of other slots' components ([Note: capabilities]).
    needs: tuple[Need, ...] = ()


@attrs.frozen
class FamilySpec:
    """Everything about a family, in one place ([Note: declaring a family])."""

    label: str  # as `zkernel plugins` prints it
    hook: str  # the registration hook that offers components of this family
    # Where config selects its components, one `Slot` each: how many may be selected at once.
    slots: tuple[Slot, ...]
    # The family's own table in the config (``"optimizer"`` for ``[optimizer]``), or "" when its
    # keys sit at the top level (the partitioner's), and that table's schema: a frozen attrs class
    # whose own keys apply to whichever component is selected ([Note: family sections]).
    section: str = ""
    schema: type | None = None
    # The hook that applies the selected component to the model before partitioning, or "".
    apply: str = ""


def _one(section: str, schema: type, hook: str, label: str, **kwargs: Any) -> FamilySpec:
    """A family that selects one component by ``[section] name``, its options beside the section's keys."""
    return FamilySpec(label, hook, (Slot(f"{section}.name", f"{section}.options"),), section, schema, **kwargs)


class Family(enum.Enum):
    """Families of selectable components (see [Note: declaring a family])."""

    PARTITIONER = FamilySpec(
        "partitioner", "zkernel_register_partitioners", (Slot("partitioner", "partitioner_options", auto=True),)
    )
    OFFLOAD_TIER = FamilySpec(
        "offload tier",
        "zkernel_register_offload_tiers",
        (
            Slot("offload.optimizer", "offload.optimizer_options", factory_args=("optimizer",), auto=True),
            Slot(
                "offload.params",
                "offload.params_options",
                factory_args=("params",),
                auto=True,
                needs=(
                    Need(
                        "partitioner",
                        PARAMS_ON_TIER,
                        unless=ON_COMPUTE_DEVICE,
                        why="parameters are whole on every rank with {name!r}",
                    ),
                ),
            ),
        ),
        "offload",
        sections.OffloadConfig,
    )
    OPTIMIZER = _one("optimizer", sections.OptimizerConfig, "zkernel_register_optimizers", "optimizer")
    # Model transforms, applied in this order: tiling replaces layers, checkpointing wraps blocks.
    TILING = _one("tiling", sections.TilingConfig, "zkernel_register_tilings", "tiling", apply="zkernel_apply_tiling")
    ACTIVATION_CHECKPOINTING = _one(
        "activation_checkpointing",
        sections.ActivationCheckpointingConfig,
        "zkernel_register_activation_checkpointers",
        "activation checkpointing",
        apply="zkernel_apply_activation_checkpointing",
    )
    LR_SCHEDULE = _one("lr_schedule", sections.LRScheduleConfig, "zkernel_register_lr_schedules", "lr schedule")
    # Resolves "auto" in the config before the others are resolved (see `zkernel.kernel.planning`).
    PLANNER = _one("planner", sections.PlannerConfig, "zkernel_register_planners", "planner")

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

    @property
    def section(self) -> str:
        return self.value.section

    @property
    def schema(self) -> type | None:
        return self.value.schema

    def section_keys(self) -> tuple[str, ...]:
        """The keys the family's section takes itself, before any component's options."""
        return sections.own_keys(self.schema) if self.schema is not None else ()

    def options_owner(self, slot: Slot) -> tuple[str, tuple[str, ...]]:
        """Where the user writes ``slot``'s component options (the key errors name) and the section's
        own keys beside them: ``("optimizer", ("name", "lr", ...))`` for options inside ``[optimizer]``,
        ``("offload.optimizer_options", ())`` for a table of their own."""
        if self.section and slot.options == f"{self.section}.options":
            return self.section, self.section_keys()
        return slot.options, ()

    @classmethod
    def of_section(cls, section: str) -> Family:
        """The family whose section is ``section``."""
        for family in cls:
            if family.section == section:
                return family
        raise KeyError(f"no family has the config section {section!r}; valid: {', '.join(f.section for f in cls if f.section)}")


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
    # What it can do that another slot's component may need ([Note: capabilities]).
    capabilities: frozenset[str] = frozenset()
    # ``check(config, slot)``: raises `ConfigError` when the config cannot run this component
    # in ``slot`` for a reason outside its own options (a section key it needs, say).
    check: Callable[[Any, Slot], None] | None = None

    def options_for(self, slot: Slot) -> type | None:
        """The options class for ``slot`` (by its first factory argument when given per slot)."""
        if isinstance(self.options_cls, dict):
            return self.options_cls.get(slot.factory_args[0] if slot.factory_args else None)
        return self.options_cls


@attrs.frozen
class Selected:
    """One resolved `Slot`: the component config names there and its validated options."""

    slot: Slot
    component: Component
    options: Any

    def build(self, context: Any) -> Any:
        """Call the component's factory with ``context`` (whose ``options`` are set to ours)."""
        return self.component.factory(attrs.evolve(context, options=self.options), *self.slot.factory_args)


def config_value(config: Any, dotted: str) -> Any:
    """The value at a dotted path of ``config`` (``"offload.optimizer"``)."""
    value: Any = config
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def slot_of(key: str) -> tuple[Family, Slot]:
    """The family and slot that select at the dotted config ``key``."""
    for family in Family:
        for slot in family.slots:
            if slot.key == key:
                return family, slot
    valid = ", ".join(s.key for f in Family for s in f.slots)
    raise KeyError(f"no family selects a component at {key!r}; valid: {valid}")


class ComponentRegistry:
    """What the registration hooks write into: ``registry.add(name, factory, ...)``.

    One registry instance is handed to each registration hook with its family
    and the name of the plugin being asked, so a component knows where it came
    from (``zkernel plugins`` prints it).
    """

    def __init__(self, not_installed: Callable[[Family, str, str], str] | None = None) -> None:
        self._components: dict[Family, dict[str, Component]] = {f: {} for f in Family}
        self._family: Family | None = None
        self._plugin_name = "?"
        # ``not_installed(family, key, name)``: how a plugin would offer ``name`` (the plugin
        # manager knows where plugins come from), appended to the error for a name none offers.
        self._not_installed = not_installed

    def bind(self, family: Family, plugin_name: str) -> ComponentRegistry:
        """Return a view that adds components of ``family`` on behalf of ``plugin_name``."""
        view = ComponentRegistry.__new__(ComponentRegistry)
        view._components = self._components
        view._family = family
        view._plugin_name = plugin_name
        view._not_installed = self._not_installed
        return view

    def add(
        self,
        name: str,
        factory: Callable[..., Any],
        *,
        description: str = "",
        options_cls: type | dict[Any, type | None] | None = None,
        capabilities: Iterable[str] = (),
        check: Callable[[Any, Slot], None] | None = None,
    ) -> None:
        """Offer ``factory`` under ``name``; a second component of the same name is an error.

        ``capabilities`` say what it can do that another slot may need ([Note: capabilities]);
        ``check(config, slot)`` raises `ConfigError` for a config it cannot run under.
        """
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
            capabilities=frozenset(capabilities),
            check=check,
        )

    def get(self, family: Family, name: str) -> Component | None:
        return self._components[family].get(name)

    def names(self, family: Family) -> list[str]:
        return sorted(self._components[family])

    def components(self, family: Family) -> list[Component]:
        return [self._components[family][n] for n in self.names(family)]

    def with_capability(self, family: Family, capability: str) -> list[str]:
        """Names of the installed components of ``family`` that declare ``capability``."""
        return [c.name for c in self.components(family) if capability in c.capabilities]

    # -- resolving what config selects: the one place ----------------------------------

    def select(self, config: Any, key: str, name: str | None = None) -> Selected:
        """The component selected at the dotted config ``key`` (or ``name`` there), with its options.

        [Note: resolving a component] This is the one place a component's options
        are resolved: `zkernel.initialize` (through
        `zkernel.kernel.plugin_manager.resolve_components`) and the estimator call
        it, and a planner holds the registry (``PlanRequest.components``) to call it
        for a candidate's options (``name``: a component other than the config's). It raises `ConfigError` naming the key and what is installed
        for a name no plugin offers; validates the options written for the slot
        against the component's own class (`zkernel.spec.options.build_options`, its
        section's own keys listed beside them); runs the component's ``check``; and
        checks the slot's `Need`s against the other slots' components, where those
        are not ``"auto"``.
        """
        family, slot = slot_of(key)
        name = config_value(config, key) if name is None else name
        component = self.get(family, name)
        if component is None:
            installed = ", ".join(self.names(family)) or "(none)"
            how = self._not_installed(family, key, name) if self._not_installed is not None else ""
            raise ConfigError(f"{key} {name!r} is not installed; installed: {installed}{how}")
        owner, common = family.options_owner(slot)
        options = build_options(owner, component.options_for(slot), config_value(config, slot.options), common)
        if component.check is not None:
            component.check(config, slot)
        for need in slot.needs:
            self._check_need(config, slot, component, need)
        return Selected(slot, component, options)

    def _check_need(self, config: Any, slot: Slot, component: Component, need: Need) -> None:
        if need.unless and need.unless in component.capabilities:
            return
        other_family, other_slot = slot_of(need.key)
        other_name = config_value(config, need.key)
        other = self.get(other_family, other_name)
        if other_name == AUTO or other is None or need.capability in other.capabilities:
            return  # the planner chooses it, or its own resolution says it is not installed
        offering = self.with_capability(other_family, need.capability)
        waiving = self.with_capability(component.family, need.unless) if need.unless else []

        def either(names: list[str], key_slot: Slot) -> str:
            text = " or ".join(repr(n) for n in names) or "(none installed)"
            return text + (f" (or {AUTO!r})" if key_slot.auto else "")

        why = f" ({need.why.format(name=other_name)})" if need.why else ""
        valid = [f"{slot.key} = {either(waiving, slot)}"] if waiving else []
        valid.append(f"{need.key} = {either(offering, other_slot)}")
        raise ConfigError(
            f"{slot.key} {component.name!r} needs {need.key} {' or '.join(repr(n) for n in offering) or '(none installed)'}"
            f"{why}; valid: {', or '.join(valid)}"
        )
