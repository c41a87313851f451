"""zkernel as a Lightning strategy: ``Trainer(strategy=ZKernelStrategy(config=...))`` or ``strategy="zkernel"``.

Importing this module registers ``"zkernel"`` and its presets (``"zkernel_stage_1"``,
``"zkernel_stage_2"``, ``"zkernel_stage_2_offload"``, ``"zkernel_stage_3"``,
``"zkernel_stage_3_offload"``, ``"zkernel_stage_3_offload_nvme"``) in the ``StrategyRegistry``
of every installed Lightning package (``pytorch_lightning`` and ``lightning.pytorch``).

[Note: registering by name] Lightning fills its ``StrategyRegistry`` from its own
strategy classes only (``_register_classes`` over ``pytorch_lightning.strategies``);
the one entry-point group it reads, ``pytorch_lightning.callbacks_factory``
(``lightning.pytorch.callbacks_factory``), supplies callbacks and is read after the
Trainer has resolved its strategy. So no entry point can make ``strategy="zkernel"``
known: the names exist once this module is imported (``import
zkernel.integrations.lightning``), as with other third-party strategies.

`ZKernelStrategy` is the class for ``pytorch_lightning`` where it is installed, else for
``lightning.pytorch``; `strategy_class` gives the one for a given package. `convert_checkpoint`
(`zkernel.integrations.lightning.convert`) writes a checkpoint directory the strategy saved as one
ordinary Lightning checkpoint file.
"""

from __future__ import annotations

from zkernel.integrations.lightning import _framework
from zkernel.integrations.lightning.strategy import build

_BUILT: dict[str, tuple[type, type]] = {}
for _found in _framework.installed():
    _BUILT[_found.name] = build(_found)
    _BUILT[_found.name][0].register_strategies(_found.StrategyRegistry)

if not _BUILT:
    raise ImportError(
        "zkernel.integrations.lightning needs Lightning: pip install 'zkernel[lightning]' "
        "(pytorch-lightning) or install lightning"
    )


def strategy_class(package: str = _framework.PACKAGES[0]) -> type:
    """The ZKernelStrategy class for Lightning ``package`` (``"pytorch_lightning"`` or ``"lightning.pytorch"``)."""
    if package not in _BUILT:
        raise ValueError(f"Lightning package {package!r} is not installed; installed: {', '.join(_BUILT)}")
    return _BUILT[package][0]


def precision_class(package: str = _framework.PACKAGES[0]) -> type:
    """The ZKernelPrecision plugin class for Lightning ``package``."""
    if package not in _BUILT:
        raise ValueError(f"Lightning package {package!r} is not installed; installed: {', '.join(_BUILT)}")
    return _BUILT[package][1]


def __getattr__(name: str):
    # convert_checkpoint is imported when asked for, so that ``python -m zkernel.integrations.lightning.convert``
    # does not find its module already imported by this package.
    if name == "convert_checkpoint":
        from zkernel.integrations.lightning.convert import convert_checkpoint

        return convert_checkpoint
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


ZKernelStrategy, ZKernelPrecision = next(iter(_BUILT.values()))

__all__ = ["ZKernelStrategy", "ZKernelPrecision", "convert_checkpoint", "strategy_class", "precision_class"]
