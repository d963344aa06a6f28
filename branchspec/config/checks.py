"""The one validation family every configuration and entry point uses.

A wrong type raises `ConfigTypeError` (a TypeError), a value that cannot work raises
`ConfigError` (a ValueError); both name the field, as ``Owner.field`` (``field`` alone for
a model config, whose fields are config.json keys). A `ConfigTypeError` is also a
`ConfigError`, so ``except ConfigError`` catches every bad value of a config file.
"""

from __future__ import annotations

import math
import numbers
import operator


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the field."""


class ConfigTypeError(ConfigError, TypeError):
    """A configuration value of the wrong type; the message names the field."""


def field_name(owner: str | None, name: str) -> str:
    return f"{owner}.{name}" if owner else name


def require(condition: bool, message: str) -> None:
    """ConfigError(message) unless condition holds."""
    if not condition:
        raise ConfigError(message)


def check_int(owner: str | None, name: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    """An integer (numpy integers accepted, returned as a plain int) within bounds.

    Bools and floats are refused, 256.0 included: a size is always an int, so a float means
    a hand edit, and truncating 256.5 would build something else.
    """
    where = field_name(owner, name)
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        hint = f"; write {int(value)}" if isinstance(value, float) and value.is_integer() else ""
        raise ConfigTypeError(f"{where} must be an integer, got {type(value).__name__} {value!r}{hint}")
    try:
        value = operator.index(value)
    except (TypeError, ValueError):   # an array or tensor of several elements, say
        raise ConfigTypeError(f"{where} must be an integer, got {_shown(value)}") from None
    if minimum is not None and value < minimum:
        raise ConfigError(f"{where} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{where} must be <= {maximum}, got {value}")
    return value


def check_float(owner: str | None, name: str, value) -> float:
    """A finite real number as a float (ints accepted; bools, NaN and infinities refused)."""
    where = field_name(owner, name)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) and not hasattr(value, "__float__"):
        raise ConfigTypeError(f"{where} must be a number, got {type(value).__name__} {value!r}")
    try:
        value = float(value)
    except OverflowError:  # an int too large for a float
        raise ConfigError(f"{where} must be a finite number, got an integer too large for a float") from None
    except (TypeError, ValueError):   # an array or tensor of several elements, say
        raise ConfigTypeError(f"{where} must be a number, got {_shown(value)}") from None
    if not math.isfinite(value):  # json.loads accepts NaN and Infinity
        raise ConfigError(f"{where} must be a finite number, got {value}")
    return value


def _shown(value) -> str:
    """A value as an error shows it: its type, and its shape where it has one (an array or
    a tensor, whose repr can run to pages)."""
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"{type(value).__name__} of shape {tuple(shape)}; give a single number"
    return f"{type(value).__name__} {value!r}"


def check_bool(owner: str | None, name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ConfigTypeError(f"{field_name(owner, name)} must be true or false, got {type(value).__name__} {value!r}")
    return value
