"""Module paths of zkernel before its packages (0.1), kept importable for one release.

[Note: moved modules] Until 0.1 every module sat flat in `zkernel`
(``zkernel.config``, ``zkernel.tiers``, ``zkernel.hookspecs``, ...). A
third-party plugin or script may import those paths, so each stays importable:
`install` puts a finder on ``sys.meta_path`` that answers an old path with the
module that now holds it (the same module object, so a monkeypatch on the old
path reaches the code), or, for a module that was split, with a module that
reads each name from the new modules in turn. The first import of an old path
warns with `DeprecationWarning` naming the new one.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

# Old module (under zkernel.) -> the modules that now hold its names, searched in order.
MOVED: dict[str, tuple[str, ...]] = {
    "adam_math": ("zkernel.platform.adam_math",),
    "aio": ("zkernel.platform.aio",),
    "bootstrap": ("zkernel.kernel.bootstrap",),
    "chrome_trace": ("zkernel.telemetry.chrome_trace",),
    "compiled": ("zkernel.platform.compiled",),
    "config": ("zkernel.spec.config", "zkernel.spec.options", "zkernel.kernel.config_source"),
    "deepspeed_config": ("zkernel.compat.deepspeed.config",),
    "deepspeed_scheduler": ("zkernel.compat.deepspeed.scheduler",),
    "demo": ("zkernel.cli.demo",),
    "distributed": ("zkernel.platform.distributed",),
    "divergence": ("zkernel.kernel.divergence",),
    "engine": ("zkernel.kernel.engine",),
    "entries": ("zkernel.kernel.entries",),
    "estimator": ("zkernel.sizing.estimator",),
    "gpu_clock": ("zkernel.telemetry.gpu_clock",),
    "grad_readiness": ("zkernel.kernel.grad_readiness",),
    "groups": ("zkernel.spec.groups",),
    "hookspecs": ("zkernel.spec.hookspecs",),
    "host_memory": ("zkernel.platform.host_memory",),
    "intervals": ("zkernel.telemetry.intervals",),
    "lifecycle": ("zkernel.kernel.lifecycle",),
    "log": ("zkernel.telemetry.log",),
    "lookahead": ("zkernel.kernel.lookahead",),
    "loss_scale": ("zkernel.kernel.loss_scale",),
    "lr_schedule": ("zkernel.spec.lr_schedule",),
    "machine": ("zkernel.platform.machine",),
    "model_shape": ("zkernel.sizing.model_shape",),
    "module_select": ("zkernel.params.module_select",),
    "native": ("zkernel.platform.native",),
    "param_hyper": ("zkernel.kernel.param_hyper",),
    "param_map": ("zkernel.params.param_map",),
    "param_writes": ("zkernel.params.param_writes",),
    "planning": ("zkernel.spec.planner", "zkernel.kernel.planning"),
    "plugin_manager": ("zkernel.kernel.plugin_manager",),
    "profiling": ("zkernel.telemetry.profiling",),
    "progress": ("zkernel.telemetry.progress",),
    "reduction_order": ("zkernel.kernel.reduction_order",),
    "registry": ("zkernel.spec.registry",),
    "released": ("zkernel.params.released",),
    "runtime": ("zkernel.spec.runtime",),
    "scheduler": ("zkernel.kernel.scheduler",),
    "sizes": ("zkernel.platform.sizes",),
    "step_pipeline": ("zkernel.kernel.step_pipeline",),
    "streams": ("zkernel.platform.streams",),
    "tiers": ("zkernel.spec.tiers",),
    "tiled_loss": ("zkernel.ops.tiled_loss",),
    "timeline": ("zkernel.telemetry.timeline",),
    "trace": ("zkernel.kernel.trace",),
    "transforms": ("zkernel.kernel.transforms",),
    "unit_modules": ("zkernel.params.unit_modules",),
    "unset": ("zkernel.params.unset",),
    "unused_params": ("zkernel.kernel.unused_params",),
}


def _warn(old: str, new: tuple[str, ...]) -> None:
    warnings.warn(
        f"zkernel.{old} moved to {' and '.join(new)}; the old path stops working in the next release",
        DeprecationWarning,
        stacklevel=4,
    )


class _Merged(types.ModuleType):
    """An old module split over several new ones: each name is read from the first that has it."""

    def __init__(self, name: str, sources: tuple[str, ...]) -> None:
        super().__init__(name)
        self.__sources = sources

    def __getattr__(self, attr: str):
        for source in self.__sources:
            module = importlib.import_module(source)
            if hasattr(module, attr):
                return getattr(module, attr)
        raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r}")


class _MovedLoader(importlib.abc.Loader):
    def __init__(self, old: str, new: tuple[str, ...], sub: str) -> None:
        self.old, self.new, self.sub = old, new, sub

    def create_module(self, spec):
        _warn(self.old + self.sub, tuple(n + self.sub for n in self.new))
        if len(self.new) == 1:
            return importlib.import_module(self.new[0] + self.sub)
        return _Merged(spec.name, self.new)

    def exec_module(self, module) -> None:
        pass


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        prefix, _, rest = fullname.partition(".")
        if prefix != "zkernel" or not rest:
            return None
        old, dot, sub = rest.partition(".")
        if old not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _MovedLoader(old, MOVED[old], dot + sub))


def install() -> None:
    """Answer the old module paths (idempotent; `zkernel` calls it at import)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())


def moved_attribute(name: str):
    """``zkernel.<old module>`` as an attribute (``from zkernel import tiers``), or None."""
    if name not in MOVED:
        return None
    return importlib.import_module(f"zkernel.{name}")
