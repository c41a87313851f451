"""The options toolkit: how a component declares its own config options and how they are checked.

A component's options are a frozen attrs class of its own; its fields use the
validators here (`choice`, `integer`, `number`, `boolean`) so that an error
names the full key, the value and what is valid. `build_options` builds the
class from the user's mapping.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

from zkernel.errors import ConfigError

# -- component options ------------------------------------------------------------
#
# [Note: option errors] A component's options are an attrs class of its own
# (`registry.add(..., options_cls=...)`); `build_options` checks each given key
# against its field before the class is built, so every error names the full key
# (``partitioner_options.units``), the value, and what is valid, like the
# top-level keys do. What is valid comes from the field's validator when it is
# one of the helpers below (`choice`, `integer`, `number`, `boolean`), from
# attrs' ``in_`` validator's options, or from the field's type annotation
# (bool, int, float, str, optionally ``| None``) for fields with no validator.


@attrs.frozen
class OptionValidator:
    """An attrs validator for a component option that can say what is valid."""

    test: Any  # Callable[[Any], bool]
    valid: str  # what is valid, as it ends an error message: "an integer >= 1"

    def __call__(self, _instance: Any, attribute: Any, value: Any) -> None:
        if not self.test(value):
            raise ConfigError(f"{attribute.name} {value!r} is not valid; valid: {self.valid}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _maybe_none(validator: OptionValidator, optional: bool) -> OptionValidator:
    if not optional:
        return validator
    return OptionValidator(lambda v: v is None or validator.test(v), f"{validator.valid}, or null (left out)")


def choice(*options: Any) -> OptionValidator:
    """Valid: one of ``options``."""
    return OptionValidator(lambda v: v in options, ", ".join(str(o) for o in options))


def integer(*, minimum: int | None = None, optional: bool = False) -> OptionValidator:
    """Valid: an integer (not a bool), at least ``minimum``; None too when ``optional``."""
    valid = "an integer" if minimum is None else f"an integer >= {minimum}"
    return _maybe_none(OptionValidator(lambda v: _is_int(v) and (minimum is None or v >= minimum), valid), optional)


def number(*, minimum: float | None = None, above: float | None = None, optional: bool = False) -> OptionValidator:
    """Valid: a finite int or float, at least ``minimum`` / greater than ``above``; None too when ``optional``."""
    bounds = [f">= {minimum}"] * (minimum is not None) + [f"> {above}"] * (above is not None)
    valid = " ".join(["a number", " and ".join(bounds)]).rstrip()

    def test(v: Any) -> bool:
        return _is_number(v) and (minimum is None or v >= minimum) and (above is None or v > above)

    return _maybe_none(OptionValidator(test, valid), optional)


def boolean() -> OptionValidator:
    """Valid: true or false."""
    return OptionValidator(lambda v: isinstance(v, bool), "true or false")


def _annotation_check(annotation: Any) -> tuple[Any, str] | None:
    """(test, what is valid) for a simple annotation, None for any other."""
    import types
    import typing

    simple = {
        bool: (lambda v: isinstance(v, bool), "true or false"),
        int: (_is_int, "an integer"),
        float: (_is_number, "a number"),
        str: (lambda v: isinstance(v, str), "a string"),
    }
    if annotation in simple:
        return simple[annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        inner = _annotation_check(args[0]) if len(args) == 1 else None
        if inner is not None and len(typing.get_args(annotation)) == 2:
            test, valid = inner
            return (lambda v: v is None or test(v)), f"{valid}, or null (left out)"
    return None


def _field_types(options_cls: type) -> dict[str, Any]:
    import typing

    try:
        return typing.get_type_hints(options_cls)
    except Exception:  # noqa: BLE001 - an annotation we cannot resolve is simply not type-checked
        return {}


def _reason(exc: BaseException) -> str:
    """The message of a validator's exception (attrs puts the message first in ``args``)."""
    if exc.args and isinstance(exc.args[0], str):
        return exc.args[0]
    return str(exc)


def _check_option(owner: str, field: Any, annotation: Any, value: Any) -> None:
    """Raise `ConfigError` naming ``owner.field``, the value and what is valid, if ``value`` is not."""
    key = f"{owner}.{field.name}"
    validator = field.validator
    if isinstance(validator, OptionValidator):
        valid = validator.valid
    elif getattr(validator, "options", None) is not None:  # attrs.validators.in_
        valid = ", ".join(str(o) for o in validator.options)
    else:
        valid = None
    simple = _annotation_check(annotation)
    if simple is not None and not isinstance(validator, OptionValidator) and not simple[0](value):
        raise ConfigError(f"{key} {value!r} is not valid; valid: {valid or simple[1]}")
    try:
        converted = field.converter(value) if field.converter is not None else value
        if validator is not None:
            validator(None, field, converted)
    except (TypeError, ValueError) as exc:
        reason = _reason(exc)
        if valid is None and reason.startswith(key):  # the validator's own message names the key already
            raise ConfigError(reason) from None
        what = valid or (simple[1] + f" ({reason})" if simple else reason)
        raise ConfigError(f"{key} {value!r} is not valid; valid: {what}") from None


def build_options(
    owner: str, options_cls: type | None, options: Mapping[str, Any], common: tuple[str, ...] = ()
) -> Any:
    """Validate a component's own options against its attrs class (None if it takes none).

    ``owner`` is the config key the options sit under (``partitioner_options``,
    ``optimizer``, ``offload``); ``common`` are the section's own keys, listed in
    the error beside the component's. See [Note: option errors].
    """
    if options_cls is None:
        if options:
            key = sorted(options)[0]
            valid = ", ".join(common) or "(none)"
            raise ConfigError(f"unknown config key {owner}.{key}; valid: {valid} (the selected component takes no extra options)")
        return None
    fields = {a.name: a for a in attrs.fields(options_cls) if a.init}
    valid = [*common, *fields]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ConfigError(
            f"unknown config key {owner}.{unknown[0]}; valid: {', '.join(valid) or '(none)'}"
        )
    types = _field_types(options_cls)
    for name, value in options.items():
        _check_option(owner, fields[name], types.get(name), value)
    try:
        return options_cls(**options)
    except (TypeError, ValueError) as exc:
        # Only a check across several options (``__attrs_post_init__``) gets here.
        raise ConfigError(f"{owner}: {_reason(exc)}") from exc
