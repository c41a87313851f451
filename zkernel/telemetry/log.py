"""zkernel's loggers: structlog key-value events delivered through the standard `logging` logger ``zkernel``.

[Note: library logging] A library must not decide what a program prints.
Every zkernel event goes to a `logging.Logger` under ``zkernel`` (``zkernel``,
``zkernel.kernel.trace``, ``zkernel.cli.demo``, ...), so the program's logging
configuration decides what shows: with none, Python's last-resort handler
shows WARNING and above on stderr and nothing else, as with torch's own
loggers. ``logging.getLogger("zkernel").setLevel(logging.DEBUG)`` (or
``logging.basicConfig(level=logging.DEBUG)``) shows the debug events.

The events stay structured: `get_logger` returns a structlog bound logger
wrapping that `logging.Logger`. Its level is checked first, so a disabled
debug event costs one ``isEnabledFor`` call and no processing. Then the
event runs through

* the application's processor chain, when the application configured
  structlog (``structlog.configure``): its context, renderers and stdlib
  integration (``structlog.stdlib.ProcessorFormatter``) apply to zkernel's
  events as to its own, and ``structlog.testing.capture_logs`` sees them;
* otherwise a minimal chain of zkernel's own: the ``structlog.contextvars``
  context (the rank and step the engine binds) and the fields are rendered
  into the record's message as ``event key=value ...`` (keys sorted). structlog's
  unconfigured default (which prints every level to stdout) is never used.

zkernel never calls ``structlog.configure``; front-ends (the CLI, the demo)
do, in `zkernel.cli.commands.configure_logging`.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog

ROOT = "zkernel"

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "exception": logging.ERROR,
    "critical": logging.CRITICAL,
    "fatal": logging.CRITICAL,
}


def _format_value(value: Any) -> str:
    if isinstance(value, str) and value and not any(c.isspace() or c in "='\"" for c in value):
        return value
    return repr(value)


def _render_message(_logger: Any, _method: str, event_dict: dict) -> tuple[tuple[str], dict]:
    """Last processor of zkernel's own chain: ``event key=value ...`` as the record's message."""
    kwargs = {k: event_dict.pop(k) for k in ("exc_info", "stack_info") if k in event_dict}
    event = event_dict.pop("event", "")
    fields = " ".join(f"{k}={_format_value(event_dict[k])}" for k in sorted(event_dict))
    return ((f"{event} {fields}" if fields else str(event),), kwargs)


_OWN_CHAIN = (structlog.contextvars.merge_contextvars, _render_message)


class _CurrentChain:
    """The processors of the moment: the application's when it configured structlog, else zkernel's own.

    Resolved at each event, so configuring structlog after zkernel was
    imported (or inside ``capture_logs``) takes effect at once.
    """

    def __iter__(self):
        if structlog.is_configured():
            return iter(structlog.get_config()["processors"])
        return iter(_OWN_CHAIN)


class LibraryLogger(structlog.stdlib.BoundLogger):
    """A structlog stdlib logger that checks the `logging` level before running any processor."""

    def _proxy_to_logger(self, method_name: str, event: str | None = None, *event_args: Any, **event_kw: Any) -> Any:
        if not self._logger.isEnabledFor(_LEVELS.get(method_name, logging.CRITICAL)):
            return None
        return super()._proxy_to_logger(method_name, event, *event_args, **event_kw)


def get_logger(name: str = ROOT) -> LibraryLogger:
    """The structlog logger over ``logging.getLogger(name)``; ``name`` is ``zkernel`` or below it."""
    if name != ROOT and not name.startswith(ROOT + "."):
        raise ValueError(f"zkernel logger names start with {ROOT!r}, got {name!r}")
    return LibraryLogger(logging.getLogger(name), _CurrentChain(), {})
