"""Eager validation helpers shared by every public entry point.

Messages follow one template: ``"`name` must be <constraint>, got <value>"`` so that a user
reading an error knows which parameter, which rule and which value.
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any

__all__ = [
    "check_bool",
    "check_choice",
    "check_int",
    "check_real",
]


def _fail(name: str, constraint: str, value: Any, exc: type[Exception] = ValueError) -> Exception:
    return exc(f"`{name}` must be {constraint}, got {value!r}")


def check_bool(name: str, value: Any) -> bool:
    """Return ``value`` if it is a bool, else raise ``TypeError``."""
    if not isinstance(value, bool):
        raise _fail(name, "a bool", value, TypeError)
    return value


def check_int(
    name: str,
    value: Any,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
) -> int:
    """Validate an integer (bools are refused) within ``[minimum, maximum]``.

    Raises:
        TypeError: ``value`` is not an integer.
        ValueError: ``value`` is out of range.
    """
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise _fail(name, "an integer", value, TypeError)
    value = int(value)
    if minimum is not None and value < minimum:
        rule = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise _fail(name, rule, value)
    if maximum is not None and value > maximum:
        rule = f"<= {maximum}" if minimum is None else f"in [{minimum}, {maximum}]"
        raise _fail(name, rule, value)
    return value


def check_real(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """Validate a finite real number in an interval.

    Args:
        name: the parameter's name, quoted in the message.
        value: the value received.
        low, high: interval bounds (``None`` for unbounded).
        low_open, high_open: whether each bound is excluded.

    Raises:
        TypeError: ``value`` is not a real number.
        ValueError: ``value`` is NaN, infinite, or outside the interval.
    """
    if isinstance(value, bool) or not isinstance(value, Real):
        raise _fail(name, "a real number", value, TypeError)
    value = float(value)
    left = "(" if low_open else "["
    right = ")" if high_open else "]"
    lo = "-inf" if low is None else f"{low:g}"
    hi = "inf" if high is None else f"{high:g}"
    if low is not None and high is not None:
        rule = f"in {left}{lo}, {hi}{right}"
    elif low is not None:
        rule = f"{'>' if low_open else '>='} {lo}"
    elif high is not None:
        rule = f"{'<' if high_open else '<='} {hi}"
    else:
        rule = "finite"
    if not math.isfinite(value):
        raise _fail(name, rule if rule != "finite" else "finite", value)
    if low is not None and (value < low or (low_open and value == low)):
        raise _fail(name, rule, value)
    if high is not None and (value > high or (high_open and value == high)):
        raise _fail(name, rule, value)
    return value


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    """Validate that ``value`` is one of ``choices`` (strings)."""
    if not isinstance(value, str):
        raise _fail(name, "a string", value, TypeError)
    if value not in choices:
        raise _fail(name, "one of " + ", ".join(repr(c) for c in choices), value)
    return value
