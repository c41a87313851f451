"""Which engine holds which module, and what is cleaned up at close and at interpreter exit.

[Note: engine lifecycle] An engine rewrites its model in place: parameters
become views of flat buffers or, under ZeRO-3, empty between uses, and hooks
drive them. So a module belongs to at most one live engine: `claim` refuses a
module (or any submodule) that a live engine holds, and one whose engine was
dropped without `Engine.close` (its parameters may hold nothing). `close`
gives the module back whole (`release`).

What an engine holds outside Python's reach (swap files, page-locked memory,
the host worker thread, the process group zkernel created) is freed by
`Engine.close`, by a finalizer when the engine is garbage-collected, and at
interpreter exit for engines still alive then. The finalizer and the exit
handler run only local clean-up, never a collective: other ranks may be gone.
The process group zkernel created stays up after `Engine.close` (the next
engine of the job reuses it: destroying and re-creating the default group in
one process has hung in ``init_process_group``) and is destroyed at
interpreter exit, so a job that never calls ``destroy_process_group`` still
exits cleanly.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Callable, Iterable

import torch.distributed as dist
from torch import nn

from zkernel.telemetry.log import get_logger

log = get_logger()

_LIVE = "live"
_ABANDONED = "abandoned"

_lock = threading.Lock()
# module -> (state, description of the engine)
_holders: weakref.WeakKeyDictionary[nn.Module, tuple[str, str]] = weakref.WeakKeyDictionary()
# Clean-up callables of live engines, run at interpreter exit.
_cleanups: dict[int, Callable[[], None]] = {}
_owned_group = False


def claim(model: nn.Module, description: str) -> None:
    """Record that an engine holds ``model`` and its submodules, or raise if one is taken."""
    with _lock:
        for name, module in model.named_modules():
            held = _holders.get(module)
            if held is None:
                continue
            state, owner = held
            where = f"module {name!r} ({type(module).__name__})" if name else f"the model ({type(module).__name__})"
            if state == _LIVE:
                raise RuntimeError(
                    f"{where} is held by a live zkernel engine ({owner}); call engine.close() on it "
                    "before initializing another engine with this model"
                )
            raise RuntimeError(
                f"{where} was wrapped by a zkernel engine ({owner}) that was dropped without "
                "engine.close(), so its parameters may hold no values (ZeRO-3 releases them between "
                "uses); call engine.close() before dropping an engine whose model you keep, or build the model anew"
            )
        for module in model.modules():
            _holders[module] = (_LIVE, description)


def release(model: nn.Module) -> None:
    """``model`` is whole again (`Engine.close`): any engine may take it."""
    with _lock:
        for module in model.modules():
            _holders.pop(module, None)


def abandon(modules: Iterable[weakref.ref]) -> None:
    """The engine holding these modules was dropped without close."""
    with _lock:
        for ref in modules:
            module = ref()
            if module is not None and module in _holders:
                _holders[module] = (_ABANDONED, _holders[module][1])


def register_cleanup(key: int, cleanup: Callable[[], None]) -> None:
    """Run ``cleanup`` at interpreter exit unless `unregister_cleanup(key)` came first."""
    _cleanups[key] = cleanup


def unregister_cleanup(key: int) -> None:
    _cleanups.pop(key, None)


def own_process_group() -> None:
    """zkernel created the default process group: it destroys it when no engine needs it."""
    global _owned_group
    _owned_group = True


def destroy_owned_process_group() -> None:
    """Destroy the process group zkernel created, once no live engine is left (at exit)."""
    global _owned_group
    if _owned_group and not _cleanups and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        _owned_group = False
        log.debug("zkernel.dist.destroyed")


@atexit.register
def _at_exit() -> None:
    for key, cleanup in list(_cleanups.items()):
        try:
            cleanup()
        except Exception as exc:  # noqa: BLE001 - exit must go on
            log.warning("zkernel.exit.cleanup_failed", error=str(exc))
        _cleanups.pop(key, None)
    try:
        destroy_owned_process_group()
    except Exception as exc:  # noqa: BLE001
        log.warning("zkernel.exit.destroy_failed", error=str(exc))
