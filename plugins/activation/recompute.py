"""Activation checkpointing ``recompute``: selected modules recompute their activations in backward.

Algorithm. Each module ``[activation_checkpointing] modules`` selects (a
class name such as ``"Block"``, or an fnmatch pattern of module names such
as ``"blocks.*"``; only the outermost of nested matches) gets its
``forward`` run through ``torch.utils.checkpoint`` (non-reentrant, RNG state
preserved, so dropout draws the same mask again): its forward keeps only its
inputs, and backward recomputes the rest just before it needs it. Positional
and keyword arguments, tensors or not, nested in lists, tuples and dicts,
are flattened into the checkpoint's own inputs, so every tensor among them is
saved (and offloaded) like a positional one. A Hugging Face key/value cache
among them is not passed in training (see [Note: key/value caches under
recompute]).

With ``offload = "cpu"`` those saved inputs wait in host memory instead of
on the device (see [Note: saved-input offload] in `_offload`): activation
memory on the device stays about one checkpointed module deep, at the price
of one copy out and one copy in per module, overlapped with compute.

Under zero3 the scheduler recognises the recomputation (see [Note:
recompute] in `zkernel.kernel.scheduler`): each unit of the module is gathered once
for its recomputation and its backward together. Under every other
partitioner parameters are whole and nothing changes for them.
`Engine.close` gives every module its own ``forward`` back.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys

import attrs
import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

from zkernel.spec import hookimpl
from zkernel.spec.config import ConfigError
from zkernel.telemetry.log import get_logger
from zkernel.params.module_select import select_modules

from ._offload import SavedInputOffloader

log = get_logger()

_MISSING = object()


@attrs.frozen(kw_only=True)
class RecomputeOptions:
    """``[activation_checkpointing]`` options of the ``recompute`` component."""

    # With offload = "cpu": checkpointed modules whose inputs are brought back ahead of their backward.
    prefetch: int = attrs.field(default=1, validator=attrs.validators.ge(0))
    # Page-lock the host copies: None = where CUDA is available.
    pin_memory: bool | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(bool))
    )


def _is_kv_cache(value) -> bool:
    """Whether ``value`` is a Hugging Face key/value cache (``transformers.cache_utils.Cache``); without
    transformers imported there is none."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    cache_cls = getattr(cache_utils, "Cache", None)
    return cache_cls is not None and isinstance(value, cache_cls)


# [Note: key/value caches under recompute]
# A Hugging Face decoder layer appends this step's keys and values to the cache object it is passed
# (`past_key_values`). Recomputing the layer in backward calls it again with the same object, which
# appends them a second time: attention then runs over twice the sequence and fails with a shape
# error, or, where shapes happen to agree, attends to stale entries. Hugging Face's own gradient
# checkpointing turns `use_cache` off in training for this reason, and so does this wrapper at the
# layer: in training, a checkpointed module is passed None for the cache (a WARNING, once per engine,
# says so), and ``use_cache=False`` where its forward takes that argument (by keyword or by position):
# a recurrent layer (RecurrentGemma's) keeps its state on the module itself when asked to cache,
# so its recomputation would start from the state the first pass left. Outside training (an
# evaluation with gradients on) the module runs without checkpointing, so a cache being filled for
# generation stays right.


class CheckpointedForward:
    """A module's ``forward`` run under ``torch.utils.checkpoint``; set as the module's ``forward`` attribute."""

    def __init__(
        self, forward, offloader: SavedInputOffloader | None, name: str = "", warned: set[str] | None = None
    ) -> None:
        self.forward = forward
        self.offloader = offloader
        self.name = name
        self.warned = set() if warned is None else warned  # shared by one engine's modules: each warning once
        self.signature: inspect.Signature | bool | None = None  # the forward's, once a cache was dropped (False: none)

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        leaves, spec = tree_flatten((args, kwargs), is_leaf=_is_kv_cache)
        caches = [i for i, leaf in enumerate(leaves) if _is_kv_cache(leaf)]
        if caches:
            module = getattr(self.forward, "__self__", None)
            if module is not None and not module.training:
                return self.forward(*args, **kwargs)
            if "cache" not in self.warned:
                self.warned.add("cache")
                log.warning(
                    "zkernel.activation.cache_dropped",
                    module=self.name,
                    cache=type(leaves[caches[0]]).__name__,
                    hint="a checkpointed module is recomputed in backward and would add its keys and values to "
                    "the cache twice, so in training it gets none, and use_cache=False where it takes that "
                    "(so do the other checkpointed modules); "
                    "pass use_cache=False to the model to silence this",
                )
            for i in caches:
                leaves[i] = None
            if self.signature is None:
                self.signature = _signature(self.forward)
            leaves, spec = tree_flatten(_caching_off(self.signature, *tree_unflatten(leaves, spec)), is_leaf=_is_kv_cache)
        run = functools.partial(_run_unflattened, self.forward, spec)
        with self.offloader.region() if self.offloader is not None else contextlib.nullcontext():
            return checkpoint(run, *leaves, use_reentrant=False, preserve_rng_state=True)


def _signature(forward) -> inspect.Signature | bool:
    try:
        return inspect.signature(forward)
    except (TypeError, ValueError):  # a callable without one
        return False


def _caching_off(signature: inspect.Signature | bool, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with a true ``use_cache`` argument (of the forward with ``signature``) made False."""
    try:
        bound = signature.bind_partial(*args, **kwargs) if signature else None
    except TypeError:  # arguments the signature does not fit: leave them to the forward
        bound = None
    if bound is None or not bound.arguments.get("use_cache"):
        return args, kwargs
    bound.arguments["use_cache"] = False
    return bound.args, bound.kwargs


def _run_unflattened(forward, spec, *leaves):
    args, kwargs = tree_unflatten(list(leaves), spec)
    return forward(*args, **kwargs)


@attrs.frozen
class _Wrapped:
    module: nn.Module
    previous: object  # the instance attribute ``forward`` had before, or _MISSING


class Recompute:
    """Checkpoints the selected modules, offloading their saved inputs when asked."""

    def __init__(self, context) -> None:
        self.section = context.config.activation_checkpointing
        self.options = context.options or RecomputeOptions()
        self.offloader = (
            SavedInputOffloader(
                context.device, context.streams, prefetch=self.options.prefetch, pin_memory=self.options.pin_memory
            )
            if self.section.offload == "cpu"
            else None
        )
        self.wrapped: list[_Wrapped] = []
        self.warned: set[str] = set()

    @hookimpl
    def zkernel_apply_activation_checkpointing(self, module, context):
        for name, target in select_modules(module, self.section.modules, "activation_checkpointing.modules"):
            if isinstance(target.__dict__.get("forward"), CheckpointedForward):
                raise ConfigError(
                    f"activation_checkpointing: module {name!r} is checkpointed already (by another engine "
                    "that was not closed?)"
                )
            previous = target.__dict__.get("forward", _MISSING)
            target.forward = CheckpointedForward(target.forward, self.offloader, name, self.warned)
            self.wrapped.append(_Wrapped(target, previous))
        if self.wrapped:
            log.debug(
                "zkernel.activation.checkpointed", modules=len(self.wrapped), offload=self.section.offload
            )

    @hookimpl
    def zkernel_restore_module(self, module):
        for entry in reversed(self.wrapped):
            if entry.previous is _MISSING:
                del entry.module.forward
            else:
                entry.module.forward = entry.previous
        self.wrapped.clear()


@hookimpl
def zkernel_register_activation_checkpointers(registry) -> None:
    registry.add(
        "recompute",
        Recompute,
        description="recomputes the selected modules in backward (torch checkpoint); offload = 'cpu' keeps their inputs on the host",
        options_cls=RecomputeOptions,
    )
