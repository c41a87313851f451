"""Which Lightning packages are installed: the standalone ``pytorch_lightning``, the unified
``lightning.pytorch``, or both.

[Note: two Lightning packages] Lightning ships the same Trainer under two import names,
``pytorch_lightning`` (package ``pytorch-lightning``) and ``lightning.pytorch`` (package
``lightning``). Their classes are distinct: a ``lightning.pytorch.Trainer`` accepts only
strategies derived from ``lightning.pytorch.strategies.Strategy``. So the strategy and its
precision plugin are built once per installed package (`zkernel.integrations.lightning.strategy`)
and registered by name in each package's own ``StrategyRegistry``.
"""

from __future__ import annotations

import importlib
from types import ModuleType, SimpleNamespace

# Import names of Lightning's Trainer package, in the order `ZKernelStrategy` prefers them.
PACKAGES = ("pytorch_lightning", "lightning.pytorch")


def load(package: str) -> SimpleNamespace | None:
    """The parts of Lightning ``package`` the strategy builds on, or None where it is not installed."""
    try:
        root: ModuleType = importlib.import_module(package)
    except ImportError:
        return None
    strategies = importlib.import_module(f"{package}.strategies")
    precision = importlib.import_module(f"{package}.plugins.precision")
    return SimpleNamespace(
        name=package,
        root=root,
        DDPStrategy=strategies.DDPStrategy,
        StrategyRegistry=strategies.StrategyRegistry,
        Precision=precision.Precision,
    )


def installed() -> list[SimpleNamespace]:
    """Every installed Lightning package, in `PACKAGES` order."""
    return [found for found in map(load, PACKAGES) if found is not None]
