"""zkernel: ZeRO partitioning and offload for PyTorch, as a plugin microkernel.

Public API (see docs/reference/api.md): `initialize`, `Config`, `consolidate`,
`from_deepspeed_config`, `estimate`, `tiled_cross_entropy`, `Engine`, and the
errors `ConfigError`, `CheckpointError`, `RankDivergenceError`, `LossScaleError`, `EngineClosedError`,
`LateParameterError`, `ParamAssignmentError`.
Plugins import `zkernel.spec` (the contract). Nothing is loaded at import time;
`initialize` builds the plugin managers.
"""

from zkernel import _moved
from zkernel.errors import ConfigError
from zkernel.spec.config import Config

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "RankDivergenceError",
    "LossScaleError",
    "EngineClosedError",
    "LateParameterError",
    "ParamAssignmentError",
    "ParamWriteError",
    "Config",
    "ConfigError",
    "Engine",
    "consolidate",
    "estimate",
    "from_deepspeed_config",
    "initialize",
    "tiled_cross_entropy",
]

_moved.install()

# Public name -> (module, attribute), imported on first use: `import zkernel` stays light.
_LAZY = {
    "initialize": ("zkernel.kernel.bootstrap", "initialize"),
    "consolidate": ("zkernel.kernel.bootstrap", "consolidate"),
    "from_deepspeed_config": ("zkernel.compat.deepspeed.config", "from_deepspeed_config"),
    "estimate": ("zkernel.sizing.estimator", "estimate"),
    "RankDivergenceError": ("zkernel.kernel.divergence", "RankDivergenceError"),
    "LossScaleError": ("zkernel.kernel.loss_scale", "LossScaleError"),
    "EngineClosedError": ("zkernel.kernel.closed", "EngineClosedError"),
    "CheckpointError": ("zkernel.checkpoint.format", "CheckpointError"),
    "LateParameterError": ("zkernel.kernel.late_params", "LateParameterError"),
    "ParamAssignmentError": ("zkernel.params.param_writes", "ParamAssignmentError"),
    "ParamWriteError": ("zkernel.params.param_writes", "ParamWriteError"),
    "tiled_cross_entropy": ("zkernel.ops.tiled_loss", "tiled_cross_entropy"),
    "Engine": ("zkernel.kernel.engine", "Engine"),
}
# Names the facade exported before `zkernel.spec` held them (deprecated, one release).
_SPEC_NAMES = ("hookimpl", "hookspec")


def __getattr__(name):
    import importlib

    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    if name in _SPEC_NAMES:
        import warnings

        warnings.warn(
            f"zkernel.{name} moved to zkernel.spec.{name}; the old name stops working in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        from zkernel import spec

        return getattr(spec, name)
    module = _moved.moved_attribute(name)
    if module is not None:
        return module
    raise AttributeError(f"module 'zkernel' has no attribute {name!r}")
