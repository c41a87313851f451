"""zkernel: ZeRO partitioning and offload for PyTorch, as a plugin microkernel.

Public API (see README): `initialize`, `Config`, `hookimpl`, `consolidate`,
`from_deepspeed_config`, `estimate`, `tiled_cross_entropy`, `CheckpointError`,
`RankDivergenceError`, `LossScaleError`.
Nothing is loaded at import time; `initialize` builds the plugin managers.
"""

from zkernel.config import Config, ConfigError
from zkernel.hookspecs import hookimpl, hookspec

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "RankDivergenceError",
    "LossScaleError",
    "Config",
    "ConfigError",
    "Engine",
    "consolidate",
    "estimate",
    "from_deepspeed_config",
    "hookimpl",
    "hookspec",
    "initialize",
    "tiled_cross_entropy",
]


def __getattr__(name):
    # Keep `import zkernel` light: torch-heavy modules load on first use.
    if name in ("initialize", "consolidate"):
        from zkernel import bootstrap

        return getattr(bootstrap, name)
    if name == "from_deepspeed_config":
        from zkernel.deepspeed_config import from_deepspeed_config

        return from_deepspeed_config
    if name == "estimate":
        from zkernel.estimator import estimate

        return estimate
    if name == "RankDivergenceError":
        from zkernel.divergence import RankDivergenceError

        return RankDivergenceError
    if name == "LossScaleError":
        from zkernel.loss_scale import LossScaleError

        return LossScaleError
    if name == "CheckpointError":
        from zkernel.checkpoint.format import CheckpointError

        return CheckpointError
    if name == "tiled_cross_entropy":
        from zkernel.tiled_loss import tiled_cross_entropy

        return tiled_cross_entropy
    if name == "Engine":
        from zkernel.engine import Engine

        return Engine
    raise AttributeError(f"module 'zkernel' has no attribute {name!r}")
