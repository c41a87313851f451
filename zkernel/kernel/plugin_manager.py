"""Building plugin managers and resolving the components config names.

Plugins come, in this order, from: the entry-point group ``zkernel`` (the
builtins register there exactly like a third party), objects passed in code
(``zkernel.initialize(..., plugins=[...])``), and dotted module paths in the
config's ``plugins``. ``ZKERNEL_DISABLE_PLUGIN_AUTOLOAD=1`` skips entry points
of other distributions; names in the config's ``blocked_plugins`` or in
``ZKERNEL_BLOCKED_PLUGINS`` (comma-separated) are never registered.
The builtins are listed once, as the entry points in zkernel's pyproject.toml;
without that distribution's metadata (a source tree never installed) there are
none, and `get_plugin_manager` says how to install it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import pluggy

from zkernel.spec import hookspecs
from zkernel.spec.config import Config, ConfigError
from zkernel.telemetry.log import get_logger
from zkernel.spec.registry import Component, ComponentRegistry, Family, Selected  # Selected: kept importable from here

log = get_logger()

ENTRY_POINT_GROUP = "zkernel"
DISTRIBUTION = "zkernel"
AUTOLOAD_ENV = "ZKERNEL_DISABLE_PLUGIN_AUTOLOAD"
TRACE_ENV = "ZKERNEL_TRACE_HOOKS"
BLOCKED_ENV = "ZKERNEL_BLOCKED_PLUGINS"

@attrs.frozen
class PluginSource:
    """Where an installed plugin came from, for ``zkernel plugins``."""

    name: str
    origin: str  # "entry point", "code", "config"
    distribution: str | None = None
    version: str | None = None


class InstalledPlugins:
    """The installed plugin manager plus the provenance of each plugin."""

    def __init__(self, pm: pluggy.PluginManager, config: Config | None = None) -> None:
        self.pm = pm
        self.sources: dict[str, PluginSource] = {}
        self.config = config or Config()  # the one the plugins were loaded for

    def register(self, plugin: Any, source: PluginSource) -> None:
        if self.pm.is_blocked(source.name) or self.pm.has_plugin(source.name):
            return
        self.pm.register(plugin, name=source.name)
        self.sources[source.name] = source


def new_plugin_manager(trace: bool = False) -> pluggy.PluginManager:
    """An empty manager with zkernel's specs, tracing to the ``zkernel.kernel.trace`` logger when asked."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    if trace or os.environ.get(TRACE_ENV, "") not in ("", "0"):
        writer_log = get_logger("zkernel.trace")
        pm.trace.root.setwriter(lambda text: writer_log.debug("zkernel.hook.trace", msg=text.rstrip()))
        pm.enable_tracing()
    return pm


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def _load_entry_point(ep: importlib.metadata.EntryPoint, dist_name: str | None) -> Any:
    try:
        return ep.load()
    except Exception as exc:
        raise ImportError(
            f"plugin {ep.name!r} (entry point {ep.value!r} of distribution {dist_name!r}) "
            f"failed to import: {exc}; uninstall it or add {ep.name!r} to blocked_plugins"
        ) from exc


def _import_dotted(path: str) -> Any:
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"plugin {path!r} from config key `plugins` cannot be imported: {exc}") from exc
    return getattr(module, attr) if attr else module


def get_plugin_manager(
    plugins: Sequence[Any] = (),
    *,
    config: Config | None = None,
    autoload: bool | None = None,
) -> InstalledPlugins:
    """Build the installed plugin manager: entry points, code plugins, config plugins.

    Nothing is imported at zkernel import time; this factory does all loading
    and ends with ``check_pending()`` so a misspelled hook fails here.
    """
    config = config or Config()
    pm = new_plugin_manager(trace=config.trace_hooks)
    installed = InstalledPlugins(pm, config)
    env_blocked = [n for n in os.environ.get(BLOCKED_ENV, "").split(",") if n.strip()]
    for name in (*config.blocked_plugins, *env_blocked):
        pm.set_blocked(name.strip())
    if autoload is None:
        autoload = os.environ.get(AUTOLOAD_ENV, "") in ("", "0")

    found_builtins = set()
    described: dict[object, tuple[str, str]] = {}  # a distribution's name and version: its metadata parsed once
    for ep in _entry_points():
        dist = getattr(ep, "dist", None)
        if dist is not None and (key := getattr(dist, "_path", id(dist))) not in described:
            metadata = dist.metadata
            described[key] = (metadata["Name"], metadata["Version"])
        dist_name, dist_version = described[key] if dist is not None else (None, None)
        is_builtin = dist_name == DISTRIBUTION
        if is_builtin:
            found_builtins.add(ep.name)
        if not is_builtin and not autoload:
            continue
        if pm.is_blocked(ep.name) or pm.has_plugin(ep.name):
            continue
        installed.register(
            _load_entry_point(ep, dist_name),
            PluginSource(ep.name, "entry point", dist_name, dist_version),
        )
    if not found_builtins:
        raise ImportError(
            "zkernel's builtin plugins are registered through its distribution's entry points, and no "
            f"distribution named {DISTRIBUTION!r} is installed in this environment; install zkernel "
            "(pip install -e . in a checkout) instead of importing it from a source tree"
        )

    for plugin in plugins:
        name = getattr(plugin, "__name__", None) or f"{type(plugin).__name__}-{id(plugin):x}"
        installed.register(plugin, PluginSource(name, "code"))
    for path in config.plugins:
        installed.register(_import_dotted(path), PluginSource(path, "config"))
    pm.check_pending()
    return installed


def collect_components(installed: InstalledPlugins) -> ComponentRegistry:
    """Ask every installed plugin for its components, each with a registry bound to its name."""
    registry = ComponentRegistry(not_installed=_how_to_offer(installed.config))
    for family in Family:
        caller = getattr(installed.pm.hook, family.hook)
        for impl in caller.get_hookimpls():
            impl.function(registry=registry.bind(family, impl.plugin_name))
    return registry


def _how_to_offer(config: Config) -> Callable[[Family, str, str], str]:
    """The end of the error for a name no plugin offers: which blocked plugins might offer it, and
    how a plugin offers one."""

    def explain(family: Family, key: str, name: str) -> str:
        blocked = [*config.blocked_plugins, *(n.strip() for n in os.environ.get(BLOCKED_ENV, "").split(",") if n.strip())]
        hint = f"; plugins blocked by blocked_plugins or {BLOCKED_ENV} might offer it: {', '.join(blocked)}" if blocked else ""
        return (
            f"{hint}. No loaded plugin offers "
            f"the {family.label} {name!r}: a plugin offers one from its `{family.hook}(registry)` "
            f"hook with `registry.add({name!r}, factory)`, and is loaded from the entry-point group "
            f"{ENTRY_POINT_GROUP!r} of an installed package, from `zkernel.initialize(..., plugins=[module])`, "
            "or from the config key `plugins` (`zkernel plugins` lists every installed component)"
        )

    return explain


def resolve_components(
    registry: ComponentRegistry,
    config: Config,
    families: Iterable[Family] | None = None,
    skip: Iterable[str] = (),
) -> dict[str, Selected]:
    """Resolve every slot of every family (or of ``families``) but those keyed in ``skip``, by config key.

    Each slot through `ComponentRegistry.select` ([Note: resolving a component]):
    raises `ConfigError` naming the key and what is installed for a name no
    plugin offers, and for options the component does not take.
    """
    skip = set(skip)
    return {
        slot.key: registry.select(config, slot.key)
        for family in (Family if families is None else families)
        for slot in family.slots
        if slot.key not in skip
    }


def list_components(installed: InstalledPlugins) -> Iterable[tuple[Component, PluginSource]]:
    """Every component with the source of the plugin that offers it, by family then name."""
    registry = collect_components(installed)
    for family in Family:
        for component in registry.components(family):
            yield component, installed.sources.get(
                component.plugin_name, PluginSource(component.plugin_name, "unknown")
            )
