"""Validators and converters of the config schema's fields (the core's and the families' sections).

Each takes the full dotted key, so that an error names it, the value and what
is valid, as a `ConfigError`. A component's own options use `zkernel.spec.options`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from zkernel.errors import ConfigError


def positive_int(key: str):
    def check(_inst, _attr, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key} must be an integer >= 1, got {value!r}")

    return check


def true_or_false(key: str):
    def check(_inst, _attr, value):
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")

    return check


def non_negative_number(key: str):
    def check(_inst, _attr, value):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ConfigError(f"{key} must be a number >= 0, got {value!r}")
        if math.isinf(value):
            raise ConfigError(f"{key} must be finite, got {value!r}")

    return check


def positive_number(key: str):
    def check(_inst, _attr, value):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
            raise ConfigError(f"{key} must be a finite number > 0, got {value!r}")

    return check


def non_negative_int(key: str):
    def check(_inst, _attr, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{key} must be an integer >= 0, got {value!r}")

    return check


def component_name(key: str):
    def check(_inst, _attr, value):
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{key} must be a non-empty string naming a component, got {value!r}")

    return check


def one_of(key: str, choices: tuple[str, ...]):
    def check(_inst, _attr, value):
        if value not in choices:
            raise ConfigError(f"{key} {value!r} is not valid; valid: {', '.join(choices)}")

    return check


def betas(key: str):
    """An attrs converter to Adam's ``(beta1, beta2)``; anything else is a `ConfigError` naming ``key``."""

    def convert(value: Any) -> tuple[float, float]:
        if (
            not isinstance(value, (list, tuple))
            or len(value) != 2
            or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in value)
        ):
            raise ConfigError(f"{key} must be two numbers in [0, 1), got {value!r}")
        b1, b2 = float(value[0]), float(value[1])
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ConfigError(f"{key} must be two numbers in [0, 1), got {value!r}")
        return (b1, b2)

    return convert


def str_tuple(key: str):
    """An attrs converter to a tuple of strings; anything else is a `ConfigError` naming ``key``."""

    def convert(value: Any) -> tuple[str, ...]:
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list of strings, got {value!r}")
        if not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{key} must be a list of strings, got {value!r}")
        return tuple(value)

    return convert


def options_table(value: Any) -> Mapping[str, Any]:
    return dict(value)


def table(key: str):
    def convert(value: Any) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key} must be a table (mapping), got {type(value).__name__}")
        return dict(value)

    return convert


def size(key: str):
    """Bytes from an integer or a string with a unit ("16GiB", "1.5TB"); None stays None."""

    def convert(value: Any) -> int | None:
        if value is None:
            return None
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        if isinstance(value, str):
            from zkernel.platform.sizes import parse_size

            try:
                return parse_size(value)
            except ValueError:
                pass
        raise ConfigError(
            f"{key} must be a size in bytes: an integer >= 0 or a string such as \"16GiB\" "
            f"(units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), got {value!r}"
        )

    return convert


def optional_positive_int(key: str):
    def check(_inst, _attr, value):
        if value is not None:
            positive_int(key)(_inst, _attr, value)

    return check


