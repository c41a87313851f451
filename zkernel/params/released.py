"""Released parameters: reading one outside the engine raises instead of seeing an empty tensor.

A partitioner that frees a parameter's storage between uses (ZeRO-3) points its
``.data`` at a 0-element placeholder. Left at that, ``p.norm()`` gives 0.0 and
``module.state_dict()`` gives tensors of shape (0,), silently. `mark_released`
turns such a parameter into a `ReleasedParameterError` trap: any torch operation
that would read or write its values raises an error that names the parameter
and how to read it; `mark_gathered` makes it an ordinary parameter again.

[Note: released-parameter trap] Options weighed:

* a state-dict hook on the root module that raises: closes ``state_dict()``
  only; ``p.norm()``, ``copy.deepcopy(model)``, ``model.half()`` and any other
  read still see the empty placeholder.
* a placeholder that raises on misuse: ``param.data = x`` keeps the
  parameter's own class (only the tensor's storage and metadata are taken from
  ``x``), so a tensor subclass as placeholder never dispatches; a meta-device
  placeholder with the true shape would raise on some reads, but with torch's
  messages (naming neither remedy), would make ``next(model.parameters()).device``
  say ``meta`` between steps and would let ``state_dict()`` hand out meta
  tensors without a word.
* swapping a released parameter's class to a subclass whose
  ``__torch_function__`` raises (what this module does, as torch's own
  ``UninitializedParameter.materialize`` swaps ``__class__``): every Python-level
  torch call on the parameter (functions, methods, property getters such as
  ``.data``) dispatches to it, so all reads are caught, ``state_dict()``
  included (it calls ``detach``). Metadata that does not depend on values stays
  readable (dtype, device, ``requires_grad``, ``.grad``, hooks, and the
  placeholder's shape (0,), which tells the truth about what the rank holds),
  so the kernel's bookkeeping and autograd hooks work unchanged, and so do
  queries about memory (storage, strides), which describe the empty placeholder. From the
  engine's forward to the end of its backward the trap gathers the parameter
  instead of raising (see [Note: fetch on first read]). Cost: one ``__class__``
  assignment per parameter at each gather and release (about 0.15 us, a third
  of the ``.data`` swap the partitioner makes anyway) and nothing per operation
  on a gathered parameter, which is an ordinary ``nn.Parameter`` again.
  C++ code (autograd's engine, kernels) never dispatches to Python, so it is
  unaffected.

[Note: fetch on first read] The same trap is how the engine fetches a parameter
read outside its own module's forward (a tied embedding reused as the output
head): the scheduler gives each parameter a fetcher (`set_fetcher`), which the
trap asks before raising; from the engine's forward to the end of its backward
the fetcher gathers the parameter's group and the operation runs again on the
whole values; a read of metadata (``weight.shape``) fetches too, so the model
sees the whole parameter's. It replaced a `TorchFunctionMode` over the whole
forward and backward, which called into Python for every operation of the
model and of the plugins' hooks: about a third more host time per unit and
step, which a forward the host can barely keep ahead of pays in GPU idle time
(`bench/host_overhead.py`; figures in BENCHMARKS.md, "Figures formerly in
docstrings"). The trap costs nothing on a gathered
parameter, which is an ordinary ``nn.Parameter``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from zkernel.params import param_writes

__all__ = ["ReleasedParameterError", "is_released", "mark_gathered", "mark_released", "set_fetcher"]


class ReleasedParameterError(RuntimeError):
    """A released (partitioned, not gathered) parameter was read outside the engine."""


_Tensor = torch.Tensor
# Value-independent properties: readable (and, for the grad-related ones, writable).
_METADATA_PROPERTIES = {
    getattr(_Tensor, name)
    for name in (
        "dtype", "device", "layout", "requires_grad", "grad", "_grad", "grad_fn", "is_leaf",
        "retains_grad", "shape", "ndim", "is_cuda", "is_cpu", "is_meta", "is_sparse",
        "is_quantized", "is_mkldnn", "is_nested", "_backward_hooks", "_post_accumulate_grad_hooks",
        "names", "output_nr", "_version", "_base", "_cdata", "nbytes", "itemsize",
    )
    if hasattr(_Tensor, name)
}  # fmt: skip
_METADATA_METHODS = {
    getattr(_Tensor, name)
    for name in (
        "numel", "nelement", "size", "dim", "ndimension", "element_size", "is_floating_point",
        "is_complex", "get_device", "requires_grad_", "register_hook",
        "register_post_accumulate_grad_hook", "_is_view", "__hash__", "__dir__", "__len__",
        # memory, not values (accounting walks every live tensor)
        "untyped_storage", "data_ptr", "storage_offset", "stride", "is_contiguous", "is_pinned", "__sizeof__",
    )
    if hasattr(_Tensor, name)
}  # fmt: skip


_DATA_ACCESS = {_Tensor.data.__get__, _Tensor.data.__set__}


def _is_metadata(func) -> bool:
    descriptor = getattr(func, "__self__", None)  # property access: the descriptor's __get__/__set__
    if descriptor is not None and getattr(func, "__name__", "") in ("__get__", "__set__", "__delete__"):
        return descriptor in _METADATA_PROPERTIES
    return func in _METADATA_METHODS


def _describe(func) -> str:
    descriptor = getattr(func, "__self__", None)
    if descriptor is not None and getattr(func, "__name__", "") in ("__get__", "__set__", "__delete__"):
        return f"Tensor.{getattr(descriptor, '__name__', '?')}"
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    return name.replace("TensorBase.", "Tensor.") if "." in name else f"torch.{name}"


class _ReleasedMixin:
    """Mixed into a parameter's own class while its storage is released (see [Note: released-parameter trap])."""

    __slots__ = ()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if torch.compiler.is_compiling():  # traced: run the trap eagerly (see [Note: hooks under torch.compile])
            from torch import _dynamo

            return _dynamo.disable(_trap, recursive=True)(func, args, kwargs)
        return _trap(func, args, kwargs)

    def __repr__(self) -> str:
        with torch._C.DisableTorchFunctionSubclass():
            dtype = self.dtype
        return (
            f"<parameter {_name_of(self)!r} released by zero3 ({dtype}); "
            "read it inside `with engine.gathered_parameters():`>"
        )


def _trap(func, args, kwargs):
    """A torch call on a released parameter: fetch it and run the call, read metadata, or raise."""
    released = _first_released(args)
    if released is None:
        released = _first_released((kwargs or {}).values())
    if released is None:  # gathered since torch dispatched the call here (under torch.compile, between graphs)
        return func(*args, **(kwargs or {}))
    fetch = _fetchers.get(id(released))
    if fetch is not None and fetch(released):  # whole now: run on its values (see [Note: fetch on first read])
        if func in _DATA_ACCESS:  # a write through it is not seen otherwise ([Note: writes to gathered parameters])
            param_writes.note(released)
        return func(*args, **(kwargs or {}))
    if _is_metadata(func):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))
    raise ReleasedParameterError(
        f"{_describe(func)} on parameter {_name_of(released)!r}, which zero3 has released: "
        "between uses each rank holds only its shard, so this would see an empty tensor. "
        "Read parameters inside `with engine.gathered_parameters():` (collective: every rank "
        "enters it), take `engine.state_dict()` (collective) for the full state dict, or save "
        "with `engine.save_checkpoint(directory)`; `engine.module.state_dict()` cannot gather them"
    )


def _first_released(values) -> _ReleasedMixin | None:
    for value in values:
        if isinstance(value, _ReleasedMixin):
            return value
        if isinstance(value, (list, tuple)):  # torch.cat([...]) and the like
            found = _first_released(value)
            if found is not None:
                return found
    return None


# parameter class -> its released twin, and back
_released_classes: dict[type, type] = {}
_original_classes: dict[type, type] = {}
_NAME = "_zkernel_name"
# id of a parameter -> its fetcher (see set_fetcher). Keyed by id, not held on the parameter: a
# weak reference to it from a handle would stop torch.utils.swap_tensors (a closed model's release).
_fetchers: dict[int, Callable[[nn.Parameter], bool]] = {}


def _released_class(cls: type) -> type:
    released = _released_classes.get(cls)
    if released is None:
        released = type(f"Released{cls.__name__}", (_ReleasedMixin, cls), {"__module__": __name__})
        _released_classes[cls] = released
        _original_classes[released] = cls
    return released


def _name_of(param) -> str:
    return getattr(param, _NAME, "?")


def mark_released(param: nn.Parameter, name: str) -> None:
    """Make reads of ``param`` raise until `mark_gathered`. Call after pointing ``.data`` at the placeholder."""
    cls = param_writes.own_class(type(param))
    if cls in _original_classes:
        return
    setattr(param, _NAME, name)
    param.__class__ = _released_class(cls)


def mark_gathered(param: nn.Parameter) -> None:
    """Give ``param`` its own class back (unwatched: see `zkernel.params.param_writes`). Call before pointing
    ``.data`` at whole values."""
    cls = type(param)
    own = param_writes.own_class(_original_classes.get(cls, cls))
    if own is not cls:
        param.__class__ = own


def is_released(param: torch.Tensor) -> bool:
    return isinstance(param, _ReleasedMixin)


class _FetcherHandle:
    """Takes a fetcher off its parameter again (``remove``), like a hook's handle."""

    def __init__(self, key: int, fetch: Callable[[nn.Parameter], bool]) -> None:
        self._key, self._fetch = key, fetch

    def remove(self) -> None:
        if _fetchers.get(self._key) is self._fetch:
            del _fetchers[self._key]


def set_fetcher(param: nn.Parameter, fetch: Callable[[nn.Parameter], bool]) -> _FetcherHandle:
    """Give ``param`` the callable its trap asks before raising (see [Note: fetch on first read]).

    The trap calls ``fetch(param)`` when an operation reads the released parameter; ``fetch``
    returns True after making it whole (the operation then runs on its values) or False (the
    trap raises `ReleasedParameterError`). Returns a handle whose ``remove()`` takes it off.
    """
    _fetchers[id(param)] = fetch
    return _FetcherHandle(id(param), fetch)


def drop_fetcher(param: nn.Parameter) -> None:
    """Take whatever fetcher ``param`` has off it (the engine that set it is gone: a failed initialize)."""
    _fetchers.pop(id(param), None)
