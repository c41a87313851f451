"""The guard on a closed engine's methods: a clear error instead of work on freed state.

[Note: a closed engine] `Engine.close` gives the model back and frees the
tiers, threads and swap files the engine's methods work on. Some methods would
still run afterwards and say nothing wrong (``memory_report()`` counted a
closed engine's stale buffers, the ``lr`` setter changed a rate no step would
use), others failed deep inside a tier. Every method that works on the
engine's state is marked `requires_open`, and raises `EngineClosedError`
naming itself; `Engine.close` itself stays a no-op when called again, and
``engine.module`` (the user's model again), ``engine.closed`` and the
read-only counters stay available.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class EngineClosedError(RuntimeError):
    """A method of a zkernel engine was called after `Engine.close`."""


def closed_error(name: str | None) -> EngineClosedError:
    """The error for calling ``engine.<name>`` (None: some method) on a closed engine."""
    called = f"engine.{name} was called" if name else "a method of a zkernel engine was called"
    return EngineClosedError(
        f"{called} after engine.close(): this zkernel engine is closed and holds no model "
        "state any more (engine.module is the plain model again); initialize a new engine to train again"
    )


def requires_open(name: str) -> Callable[[F], F]:
    """Mark an `Engine` method that raises `EngineClosedError` (naming ``name``) once the engine is closed."""

    def mark(method: F) -> F:
        @functools.wraps(method)
        def guarded(self, *args: Any, **kwargs: Any) -> Any:
            if self._closed:
                raise closed_error(name)
            return method(self, *args, **kwargs)

        return guarded  # type: ignore[return-value]

    return mark
