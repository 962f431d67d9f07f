"""Eager validation helpers shared by every public entry point.

Messages follow one template: ``"`name` must be <constraint>, got <value>"`` so that a user
reading an error knows which parameter, which rule and which value.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from numbers import Integral, Real
from typing import Any

import torch
from torch import nn

__all__ = [
    "GRADIENT_DTYPES",
    "check_bool",
    "check_choice",
    "check_grad_dtype",
    "check_int",
    "check_real",
    "check_shape",
    "named_params_and_shapes",
]

#: The gradient dtypes gradzip averages: real floating point. Complex gradients would lose
#: their imaginary part and integer ones would be truncated by the averaging, silently.
GRADIENT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_PARAMS_FORM = (
    "a module, an iterable of (name, parameter) pairs such as model.named_parameters(), "
    "or a mapping name -> shape or tensor"
)


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


def check_shape(name: str, value: Any) -> torch.Size:
    """Validate a tensor shape: a sequence of non-negative integers (bools refused).

    Args:
        name: how the shape is named in the message (e.g. ``"`params`['w']"``).
        value: a ``torch.Size``, tuple or list.

    Returns:
        The shape as a ``torch.Size``.

    Raises:
        TypeError: ``value`` is not a sequence of integers.
        ValueError: a dimension is negative.
    """
    if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list, torch.Size)):
        raise TypeError(
            f"{name} must be a shape (a tuple of non-negative integers), got {value!r}"
        )
    dims = []
    for dim in value:
        if isinstance(dim, bool) or not isinstance(dim, Integral):
            raise TypeError(
                f"{name} must be a shape (a tuple of non-negative integers), got {value!r}"
            )
        if dim < 0:
            raise ValueError(
                f"{name} must be a shape of non-negative dimensions, got {tuple(value)!r}"
            )
        dims.append(int(dim))
    return torch.Size(dims)


def _check_param_name(name: Any, where: str) -> str:
    if not isinstance(name, str) or not name:
        raise TypeError(f"`params` must be {_PARAMS_FORM}; {where} has name {name!r}, "
                        f"expected a non-empty string")
    return name


def named_params_and_shapes(
    params: Any,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Size]]:
    """Parse what an engine is built from into its parameters and their shapes.

    Args:
        params: a module (its trainable named parameters), an iterable of
            ``(name, tensor)`` pairs, or a mapping ``name -> shape`` or ``name -> tensor``.

    Returns:
        ``(parameters, shapes)``: ``name -> tensor`` (empty for a mapping, whose values only
        describe shapes) and ``name -> torch.Size``, in the order given.

    Raises:
        TypeError: ``params`` is none of these forms (an iterable of bare tensors such as
            ``model.parameters()`` included: the tensors carry no names), or an entry is
            malformed; the message gives the expected form.
        ValueError: a shape has a negative dimension, or a name appears twice.
    """
    if isinstance(params, nn.Module):
        named = {n: p for n, p in params.named_parameters() if p.requires_grad}
        return named, _checked_shapes(named)
    if isinstance(params, Mapping):
        shapes: dict[str, torch.Size] = {}
        for key, value in params.items():
            _check_param_name(key, f"the entry {key!r}")
            if isinstance(value, torch.Tensor):
                shapes[key] = check_grad_dtype(key, value, "parameter").shape
            else:
                shapes[key] = check_shape(f"`params`[{key!r}]", value)
        return {}, shapes
    if isinstance(params, (str, bytes, torch.Tensor)) or not isinstance(params, Iterable):
        raise TypeError(f"`params` must be {_PARAMS_FORM}, got {type(params).__name__}")
    named = {}
    for index, entry in enumerate(params):
        if isinstance(entry, torch.Tensor):
            raise TypeError(
                f"`params` must be {_PARAMS_FORM}; entry {index} is a bare "
                f"{type(entry).__name__} with no name (pass model.named_parameters(), "
                f"not model.parameters())"
            )
        if not isinstance(entry, (tuple, list)) or len(entry) != 2:
            raise TypeError(
                f"`params` must be {_PARAMS_FORM}; entry {index} is {entry!r}, expected a "
                f"(name, tensor) pair"
            )
        name, tensor = entry
        _check_param_name(name, f"entry {index}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"`params` must be {_PARAMS_FORM}; entry {index} ({name!r}) holds "
                f"{type(tensor).__name__} {tensor!r}, expected a tensor"
            )
        if name in named:
            raise ValueError(f"`params` names must be unique, got {name!r} twice")
        named[name] = tensor
    return named, _checked_shapes(named)


def _checked_shapes(named: dict[str, torch.Tensor]) -> dict[str, torch.Size]:
    # Checked here, not only when gradients arrive: DDP hands a hook a complex parameter's
    # gradient as a real view of half its length, which no later check could tell apart
    # from a real gradient.
    return {n: check_grad_dtype(n, p, "parameter").shape for n, p in named.items()}


def check_grad_dtype(name: str, grad: torch.Tensor, what: str = "gradient") -> torch.Tensor:
    """Refuse a gradient whose dtype gradzip does not average, naming the dtype.

    Args:
        name: the gradient's parameter name.
        grad: the gradient (or the parameter it belongs to).
        what: how the message names the tensor.

    Returns:
        ``grad`` itself.

    Raises:
        TypeError: ``grad`` is complex, integer, bool or another unsupported dtype.
    """
    if grad.dtype not in GRADIENT_DTYPES:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in GRADIENT_DTYPES)
        raise TypeError(
            f"{what} `{name}` must have a dtype in ({allowed}), got "
            f"{str(grad.dtype).removeprefix('torch.')}"
        )
    return grad
