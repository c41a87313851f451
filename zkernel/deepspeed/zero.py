"""``deepspeed.zero``: `Init` (construction on the meta device) and `GatheredParameters`.

`Init` builds modules on the meta device: shapes only, no storage. ``initialize`` with
ZeRO stage 3 then materialises one unit at a time and initialises it with the modules'
own code (each module's ``reset_parameters()``), keeping this rank's shard
(docs/guide/construction.md). DeepSpeed partitions inside the block instead; the result
a script sees after ``initialize`` is the same, and the values come from the same code.

`GatheredParameters` is `Engine.gathered_parameters` of the engine the parameters belong
to: every parameter whole inside the block, writes kept; ``modifier_rank=r`` broadcasts
rank r's values of what was written at its end, and without it a write made on some
ranks only is a `zkernel.ParamWriteError` ([Note: writes on some ranks only] in
`zkernel.params.param_writes`). Parameters of no engine (a model not yet given to
``initialize``) are whole already: the block does nothing, as DeepSpeed's does for them.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable

import torch
from torch import nn

from zkernel.telemetry.log import get_logger

log = get_logger()

_engines: weakref.WeakSet = weakref.WeakSet()  # live zkernel engines made by `zkernel.deepspeed.initialize`


def track(engine) -> None:
    """``engine``'s parameters are found by `GatheredParameters` from now on."""
    _engines.add(engine)


def tracked() -> list:
    """The live engines `track` recorded (for `zkernel.deepspeed.utils`, which finds a parameter's engine)."""
    return list(_engines)


class Init:
    """Construct modules inside the block on the meta device, for ZeRO stage 3 to materialise.

    Takes DeepSpeed's arguments; ``enabled=False`` builds as usual. ``module`` (an existing
    model to partition) needs nothing: ``initialize`` partitions it. ``remote_device``,
    ``pin_memory``, ``config_dict_or_path`` and the rest are decided by the config given to
    ``initialize``; ``dtype`` by its precision.
    """

    def __init__(self, module: nn.Module | None = None, data_parallel_group=None, mem_efficient_linear=True,
                 remote_device=None, pin_memory=False, config_dict_or_path=None, config=None, enabled=True,
                 dtype=None, mpu=None, **kwargs) -> None:
        self.enabled = bool(enabled) and module is None
        self._device: torch.device | None = None

    def __enter__(self) -> Init:
        if self.enabled:
            self._device = torch.device("meta")
            self._device.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._device is not None:
            self._device.__exit__(*exc)
            self._device = None


def _owner(params: list[nn.Parameter]):
    wanted = {id(p) for p in params}
    for engine in list(_engines):
        if engine.closed:
            continue
        if any(id(p) in wanted for p in engine.module.parameters()):
            return engine
    return None


@contextlib.contextmanager
def GatheredParameters(params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True):  # noqa: N802
    """Make ``params`` (a parameter or an iterable of them) whole inside the block; collective.

    Call it on every rank, as DeepSpeed's. Every parameter of the owning engine is gathered
    (a superset of ``params``). Writes are kept: with ``modifier_rank=r``, rank r's values;
    without it, writes must be alike on every rank, or the block ends in a `ParamWriteError`.
    """
    if isinstance(params, nn.Parameter) or isinstance(params, torch.Tensor):
        params = [params]
    params = [p for p in (params if isinstance(params, Iterable) else [params]) if p is not None]
    if enabled and any(p.is_meta for p in params):
        raise ValueError(
            "GatheredParameters over parameters on the meta device (built under zero.Init, before initialize): "
            "a write to them would be lost, since initialize materialises them with the modules' own "
            "reset_parameters(). Initialise them in the module's reset_parameters(), or call "
            "GatheredParameters(..., modifier_rank=0) after initialize"
        )
    engine = _owner(params) if enabled and params else None
    if engine is None:
        yield
        return
    with engine.gathered_parameters(modifier_rank=modifier_rank):
        yield
