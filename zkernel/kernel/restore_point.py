"""What `zkernel.initialize` puts back when it fails: the model exactly as the user handed it in.

[Note: a failed initialize gives the model back] `initialize` rewrites the
model in place long before it can return an engine: transforms swap layers
and wrap ``forward``, the partitioner points each parameter's ``.data`` at a
flat buffer or an empty placeholder and gives it another class (zero3
materialises a meta-device model unit by unit), tiers adopt the shards
(NVMe pre-allocation can fail here on a full disk), buffers move, the
scheduler hooks every module. A failure at any of these points used to leave
the parameters released, so the next `initialize` with a valid config raised
`ReleasedParameterError` on the user's own model.

So `initialize` takes a `RestorePoint` before it touches the model, and a
failure puts it back: every module's attributes (its parameter, buffer and
submodule dicts, its hook dicts, an instance ``forward``) and class, every
parameter's class, attributes, ``requires_grad``, ``grad``, tensor hooks and
``.data`` -- the very tensor it had, so the values are bitwise the user's
(and a meta-device model is on meta again). Nothing is copied: the restore
point holds references. Holding the original ``.data`` until `initialize`
returns keeps the model's own storage alive while the tiers fill theirs; the
capacity check never counts that storage as free (it measures what is free
with the model in memory), so this asks for no memory the check did not
already require. Engine bookkeeping kept by parameter identity (watched
writes, fetchers of released parameters) is dropped too.

A successful `initialize` drops the restore point; from then on `Engine.close`
gives the model back (with its trained values).
"""

from __future__ import annotations

import copy

import attrs
import torch
from torch import nn

from zkernel.params import param_writes
from zkernel.params.released import drop_fetcher
from zkernel.telemetry.log import get_logger

log = get_logger()


@attrs.frozen
class _ModuleState:
    module: nn.Module
    cls: type
    attributes: dict  # a copy of ``__dict__`` whose dict values are copies too (parameters, hooks, ...)


@attrs.frozen
class _ParamState:
    param: nn.Parameter
    cls: type
    data: torch.Tensor
    attributes: dict
    requires_grad: bool
    grad: torch.Tensor | None
    backward_hooks: object
    post_accumulate_grad_hooks: object


def _copied(attributes: dict) -> dict:
    """``attributes`` with each dict value copied, of its own type (OrderedDict hook dicts stay ordered)."""
    return {k: (copy.copy(v) if isinstance(v, dict) else v) for k, v in attributes.items()}


@attrs.frozen
class RestorePoint:
    """The model's modules and parameters as they were (see [Note: a failed initialize gives the model back])."""

    modules: tuple[_ModuleState, ...]
    params: tuple[_ParamState, ...]

    @classmethod
    def take(cls, model: nn.Module) -> RestorePoint:
        modules = tuple(_ModuleState(m, type(m), _copied(vars(m))) for m in model.modules())
        params = {}
        for m in model.modules():
            for p in m._parameters.values():
                if p is not None and id(p) not in params:
                    params[id(p)] = _ParamState(
                        param=p,
                        cls=type(p),
                        data=p.data,
                        attributes=dict(vars(p)),
                        requires_grad=p.requires_grad,
                        grad=p.grad,
                        backward_hooks=p._backward_hooks,
                        post_accumulate_grad_hooks=p._post_accumulate_grad_hooks,
                    )
        return cls(modules, tuple(params.values()))

    def restore(self) -> None:
        """Put every module and parameter back as `take` found it (called while an error propagates:
        a parameter that cannot be put back is logged, and the others still are)."""
        for state in self.modules:
            module = state.module
            if type(module) is not state.cls:
                module.__class__ = state.cls
            vars(module).clear()
            vars(module).update(_copied(state.attributes))
        param_writes.unwatch([s.param for s in self.params])
        for state in self.params:
            try:
                _restore_param(state)
            except Exception as exc:  # noqa: BLE001 - the error that failed initialize is the one to raise
                log.warning("zkernel.initialize.restore_failed", param_class=state.cls.__name__, error=str(exc))


def _restore_param(state: _ParamState) -> None:
    p = state.param
    drop_fetcher(p)
    with torch.no_grad():
        try:
            torch.Tensor.data.__set__(p, state.data)
        except RuntimeError:  # meta <-> real (zero3 materialised it): .data cannot change the tensor's type
            torch.utils.swap_tensors(p, nn.Parameter(state.data, requires_grad=state.requires_grad))
    p.__class__ = state.cls
    vars(p).clear()
    vars(p).update(state.attributes)
    p.requires_grad_(state.requires_grad)
    p.grad = state.grad
    p._backward_hooks = state.backward_hooks
    p._post_accumulate_grad_hooks = state.post_accumulate_grad_hooks
