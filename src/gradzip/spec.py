"""The spec grammar: parsing, formatting and the registry of compressors and controllers.

Two forms, one grammar:

* a compressor: ``name`` or ``name:key=value,key=value`` (``"topk:ratio=0.01"``); values are
  typed by :func:`parse_value` (integer, float, ``true``/``false``, else the text);
* a level schedule (the CLI's ``--level-schedule``): ``gentle:A-B,aggressive:B-C,...`` in
  epochs (:func:`parse_level_schedule`);
* a controller: ``name(key=value,...)`` (``"accordion(steady=powersgd:rank=1,critical=...)"``);
  values may hold compressor specs (commas included), so a parameter starts only at a comma
  outside any parentheses followed by one of the controller's own keys; each key has a kind
  (:data:`KINDS`) that converts its text.

Whitespace: around ``:``, ``=``, ``,``, ``(``, ``)`` and at either end it is ignored, in every
form (``"topk : ratio = 0.01"`` is ``"topk:ratio=0.01"``); inside a name or a value it is
part of the text (and a name or number holding it is refused).

Numbers: ASCII digits only (full-width and other Unicode digits are refused); a number too
small or too large for a float (``1e-400``, ``1e400``) is refused as out of range, quoting
the text; an integral number written with an exponent (``interval=1e3``) is accepted where an
integer is expected. A key given twice, or a parameter given under its alias and its field
name (``powersgd:rank=1,matrix_rank=2``), is refused.

Nothing else in the package parses spec text: the runner, the CLI (``--set``), model specs
of the training tasks and the controllers themselves all come here.

Adding a compressor: write the class (a frozen dataclass subclassing
:class:`~gradzip.compressors.base.Compressor` with a ``spec_name``) and add it to
:data:`COMPRESSORS` below. Adding a controller: decorate its class with :func:`register_controller`
and give it ``spec_name`` and ``spec_kinds``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal
from typing import Any, TypeVar

from gradzip.compressors.base import Compressor
from gradzip.compressors.binmean import BinMean
from gradzip.compressors.chunktopk import ChunkTopK
from gradzip.compressors.lowprec import BF16, FP16
from gradzip.compressors.none import NoCompression
from gradzip.compressors.powersgd import PowerSGD
from gradzip.compressors.qsgd import QSGD
from gradzip.compressors.randk import RandK
from gradzip.compressors.scatterq import ScatterQuant
from gradzip.compressors.shared import SharedTopK
from gradzip.compressors.sign import Sign
from gradzip.compressors.threshold import HardThreshold
from gradzip.compressors.topk import TopK

__all__ = [
    "COMPRESSORS",
    "CONTROLLERS",
    "KINDS",
    "REGISTRY",
    "build",
    "compressor_from_spec",
    "register_controller",
    "controller_from_spec",
    "describe_compressors",
    "format_call",
    "format_ranges",
    "parse_call",
    "level_schedule_parts",
    "parse_level_schedule",
    "parse_ranges",
    "parse_spec",
    "parse_value",
]

#: The registry of compressors, in the order ``gradzip list`` shows them. One line per
#: compressor: adding one to this tuple makes it buildable from specs, listed by the CLI and
#: tested by the conformance suite.
COMPRESSORS: tuple[type[Compressor], ...] = (
    NoCompression, FP16, BF16, TopK, RandK, HardThreshold, PowerSGD, QSGD, Sign, ChunkTopK, BinMean,
    ScatterQuant, SharedTopK,
)
#: ``spec_name -> class`` of every compressor.
REGISTRY: dict[str, type[Compressor]] = {cls.spec_name: cls for cls in COMPRESSORS}
#: ``spec_name -> class`` of every controller (filled by :func:`register_controller`).
CONTROLLERS: dict[str, type[Compressor]] = {}

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_SCHEDULE_PART = re.compile(r"^\s*([^:]*?)\s*:(.*)$")
_EPOCHS = re.compile(r"^(\d+\.?\d*|\.\d+)$", re.ASCII)
_INT = re.compile(r"^[+-]?\d+$", re.ASCII)
_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$|^[+-]?(nan|inf)$",
                    re.IGNORECASE | re.ASCII)
# Integral values written with an exponent are integers up to this many digits (no more: the
# text "1e999999999" must not become a billion-digit integer).
_MAX_INT_DIGITS = 30

C = TypeVar("C", bound=type)


# -- values -----------------------------------------------------------------------------
def parse_value(text: str) -> Any:
    """The typed value of one spec value: ``int``, ``float``, ``bool`` (``true``/``false``,
    any case) or, failing those, the text itself."""
    if _INT.match(text):
        return int(text)
    if _FLOAT.match(text):
        return float(text)
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


def _number(key: str, text: str) -> Any:
    """:func:`parse_value` of a parameter's text, refusing non-ASCII digits and numbers a
    float cannot hold (rounded to 0 or infinity), naming ``key`` and quoting ``text``."""
    if not text.isascii() and any(ch.isdigit() or ch.isnumeric() for ch in text):
        raise ValueError(f"`{key}` must be written with ASCII digits, got {text!r}")
    value = parse_value(text)
    if isinstance(value, float) and _FLOAT.match(text) and "n" not in text.lower():
        mantissa = re.split("[eE]", text)[0]
        if math.isinf(value) or (value == 0 and re.search("[1-9]", mantissa)):
            raise ValueError(
                f"`{key}` must be within a float's range (it would round to {value!r}), "
                f"got {text!r}"
            )
    return value


def _as_int(text: str) -> int:
    """An integer's text (ASCII digits), also with an exponent when integral (``"1e3"``)."""
    text = text.strip()
    if _INT.match(text):
        return int(text)
    number = Decimal(text) if _FLOAT.match(text) else Decimal("nan")
    if (not number.is_finite() or number.adjusted() >= _MAX_INT_DIGITS
            or number != number.to_integral_value()):
        raise ValueError(text)
    return int(number)


def _as_float(text: str) -> float:
    """A float's text (ASCII digits; :func:`parse_call` refuses one out of a float's range)."""
    if not _FLOAT.match(text.strip()):
        raise ValueError(text)
    return float(text)


def parse_ranges(text: str) -> list[tuple[int, ...]]:
    """``"0-500;900-1000"`` -> ``[(0, 500), (900, 1000)]`` (validation is the caller's).

    Raises:
        ValueError: a bound that is not an integer (ASCII digits).
    """
    if not text.isascii():
        raise ValueError(f"`ranges` must be written with ASCII digits, got {text!r}")
    return [tuple(int(x) for x in part.split("-")) for part in text.split(";") if part.strip()]


def format_ranges(ranges: Sequence[tuple[int, int]]) -> str:
    """Inverse of :func:`parse_ranges`."""
    return ";".join(f"{a}-{b}" for a, b in ranges)


def parse_level_schedule(text: str) -> list[tuple[float, float]]:
    """The gentle ranges of a level schedule's text (the CLI's ``--level-schedule``), in epochs.

    ``"gentle:0-5,aggressive:5-15,gentle:15-18,aggressive:18-30"`` gives
    ``[(0, 5), (15, 18)]``; the aggressive parts only document the rest.

    Raises:
        ValueError: a part that is not ``gentle:A-B`` or ``aggressive:A-B`` with ``A`` and
            ``B`` plain decimal numbers, an empty range, or ranges (of either kind) that
            overlap or are out of order.
    """
    return [(a, b) for kind, a, b in level_schedule_parts(text) if kind == "gentle"]


def level_schedule_parts(text: str) -> list[tuple[str, float, float]]:
    """Every part of a level schedule's text as ``(kind, start, end)`` in epochs, checked as
    :func:`parse_level_schedule` checks them."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"`level_schedule` must look like 'gentle:0-5,aggressive:5-30', got {text!r}")
    parts: list[tuple[str, float, float]] = []
    for item in text.split(","):
        parts.append(_level_schedule_part(item))
    for i, (_, start, end) in enumerate(parts):  # both kinds: half-open, sorted, disjoint
        if end <= start:
            raise ValueError(f"`level_schedule` ranges must satisfy 0 <= start < end, got "
                             f"{(start, end)!r}")
        if i and start < parts[i - 1][2]:
            raise ValueError(f"`level_schedule` ranges must be sorted and disjoint, got "
                             f"{(start, end)!r} after {parts[i - 1][1:]!r}")
    return parts


def _level_schedule_part(item: str) -> tuple[str, float, float]:
    """One ``KIND:START-END`` part of a level schedule, its epochs plain decimal numbers."""
    match = _SCHEDULE_PART.match(item)
    if match is None:
        raise ValueError("`level_schedule` parts must be KIND:START-END with KIND 'gentle' or "
                         "'aggressive' and START, END in epochs (e.g. 'gentle:0-5'), got "
                         f"{item.strip()!r}")
    kind, span = match.group(1), match.group(2)
    where = item.strip()
    if kind not in ("gentle", "aggressive"):
        raise ValueError(f"`level_schedule` part kinds must be 'gentle' or 'aggressive', got "
                         f"{kind!r} in {where!r}")
    bounds = [b.strip() for b in span.split("-")]
    if len(bounds) != 2:
        raise ValueError(f"`level_schedule` ranges must be START-END in epochs (e.g. "
                         f"'gentle:0-5'), got {span.strip()!r} in {where!r}")
    for bound in bounds:
        if not _EPOCHS.match(bound):
            raise ValueError("`level_schedule` epochs must be plain decimal numbers such as 5 "
                             f"or 2.5 (no sign, exponent, nan or inf), got {bound!r} in "
                             f"{where!r}")
    return kind, float(bounds[0]), float(bounds[1])


def _as_bool(text: str) -> bool:
    if text not in ("True", "False", "true", "false"):
        raise ValueError
    return text.lower() == "true"


#: How a controller parameter's text becomes its value, by kind. ``level``: a compressor spec
#: kept as text (the controller builds it); ``str``: kept as text.
KINDS: dict[str, Callable[[str], Any]] = {
    "level": str, "str": str, "float": _as_float, "int": _as_int, "bool": _as_bool,
    "ranges": parse_ranges,
}
_KIND_NAMES = {"float": "a number", "int": "an integer", "bool": "True or False",
               "ranges": "integer steps"}


# -- the flat form ----------------------------------------------------------------------
def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """Split ``"name:key=value,key=value"`` into the name and typed values.

    Raises:
        TypeError: ``spec`` is not a string.
        ValueError: the string is malformed (naming the bad part).
    """
    if not isinstance(spec, str):
        raise TypeError(f"`spec` must be a string such as 'topk:ratio=0.01', got {spec!r}")
    name, _, rest = spec.strip().partition(":")
    name = name.strip()
    if not _NAME.match(name):
        raise ValueError(
            f"`spec` must start with a compressor name such as 'topk', got {spec!r}"
        )
    params: dict[str, Any] = {}
    if rest.strip():
        for item in rest.split(","):
            key, eq, value = (part.strip() for part in item.partition("="))
            if not eq or not _NAME.match(key) or not value:
                raise ValueError(
                    f"`spec` parameters must be key=value pairs separated by commas, "
                    f"got {item.strip()!r} in {spec!r}"
                )
            if key in params:
                raise ValueError(f"`spec` must not repeat a key, got {key!r} twice in {spec!r}")
            params[key] = _number(key, value)
    elif ":" in spec:
        raise ValueError(f"`spec` has ':' but no parameters, got {spec!r}")
    return name, params


# -- the call form ----------------------------------------------------------------------
def parse_call(spec: str, name: str, kinds: Mapping[str, str],
               required: Sequence[str]) -> dict[str, Any]:
    """Parse ``"name(key=value,...)"`` whose keys and their kinds are ``kinds``.

    Args:
        spec: the text.
        name: the controller's spec name.
        kinds: ``key -> kind`` (a key of :data:`KINDS`), in the order of the spec.
        required: keys that must be given.

    Returns:
        ``key -> value`` converted by kind, for the keys given.

    Raises:
        ValueError: not of that form, a missing, unknown or repeated key, or a value its kind
            rejects.
    """
    shape = f"{name}(" + ",".join(f"{k}=..." for k in required) + ")"
    match = re.match(rf"^\s*{name}\s*\((.*)\)\s*$", spec, re.DOTALL) if isinstance(spec, str) else None
    if match is None:
        raise ValueError(f"`spec` must look like '{shape}', got {spec!r}")
    texts: dict[str, str] = {}
    for item in _split_call(match.group(1), kinds):
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq or key not in kinds or key in texts:
            raise ValueError(
                f"`spec` parameters must be distinct among {', '.join(kinds)}, got {item!r}"
            )
        texts[key] = value
    missing = [k for k in required if k not in texts]
    if missing:
        raise ValueError(
            f"`spec` must give both {' and '.join(k + '=' for k in required)}, got {spec!r}"
        )
    values: dict[str, Any] = {}
    for key, text in texts.items():
        kind = kinds[key]
        if kind in ("float", "int") and not text.isascii():
            raise ValueError(f"`{key}` must be written with ASCII digits, got {text!r}")
        if kind == "float" and _FLOAT.match(text):
            _number(key, text)  # out of a float's range: refused quoting the text
        try:
            values[key] = KINDS[kind](text)
        except ValueError:
            what = _KIND_NAMES.get(kind, kind)
            if kind == "ranges":
                raise ValueError(f"`spec` must give {what}, got {spec!r}") from None
            raise ValueError(f"`{key}` must be {what}, got {text!r}") from None
    return values


def _split_call(body: str, kinds: Mapping[str, str]) -> list[str]:
    """The parameters of a call's body: split at each comma outside parentheses followed by
    one of ``kinds``' keys (a nested call's commas and keys stay inside its value)."""
    starts = re.compile(r"\s*(?:" + "|".join(map(re.escape, kinds)) + r")\s*=")
    items, depth, start = [], 0, 0
    for i, ch in enumerate(body):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0 and starts.match(body, i + 1):
            items.append(body[start:i])
            start = i + 1
    items.append(body[start:])
    return items


def format_call(name: str, values: Mapping[str, Any]) -> str:
    """``name(key=value,...)`` from already formatted values (compressors by their spec,
    ranges by :func:`format_ranges`, numbers by ``repr``)."""
    return f"{name}(" + ",".join(f"{k}={v}" for k, v in values.items()) + ")"


def register_controller(cls: C) -> C:
    """Class decorator: register a controller under its ``spec_name``.

    The class declares ``spec_kinds`` (``key -> kind``, see :data:`KINDS`; its ``level``
    keys are required) and is built with those keys as keyword arguments.
    """
    CONTROLLERS[cls.spec_name] = cls  # type: ignore[attr-defined]
    return cls


def controller_from_spec(cls: type[Compressor], spec: str) -> Compressor:
    """Build controller ``cls`` from its spec ``"name(key=value,...)"``.

    Raises:
        ValueError: not of that form, or a missing, unknown or invalid parameter.
    """
    kinds: Mapping[str, str] = cls.spec_kinds  # type: ignore[attr-defined]
    required = [k for k, kind in kinds.items() if kind == "level"]
    return cls(**parse_call(spec, cls.spec_name, kinds, required))


# -- building ---------------------------------------------------------------------------
def compressor_from_spec(spec: str | Compressor) -> Compressor:
    """Build a compressor from a spec string (a compressor passes through unchanged).

    Examples: ``"none"``, ``"fp16"``, ``"topk:ratio=0.01"``, ``"threshold:budget=0.01"``,
    ``"powersgd:rank=2"``, ``"qsgd:levels=8"``, ``"sign"``, and a controller's own spec,
    ``"accordion(steady=powersgd:rank=1,critical=powersgd:rank=4,eta=0.5,interval=100,...)"``.

    Raises:
        ValueError: unknown name, unknown parameter, or an invalid value (the compressor's
            own validation names the constraint).
        TypeError: a value of the wrong type.
    """
    if isinstance(spec, Compressor):
        return spec
    if isinstance(spec, str):
        for name, cls in CONTROLLERS.items():
            if re.match(rf"\s*{name}\s*\(", spec):
                return controller_from_spec(cls, spec.strip())
            if spec.strip() == name and not any(
                    kind == "level" for kind in cls.spec_kinds.values()):  # type: ignore[attr-defined]
                return cls()  # a controller needing no parameters, by its name alone
    name, params = parse_spec(spec)
    cls = REGISTRY.get(name)
    if cls is None:
        raise ValueError(
            f"`spec` must name one of {', '.join(sorted(REGISTRY))}, got {name!r} in {spec!r}"
        )
    fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    given: dict[str, str] = {}
    types = {f.name: f.type for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    for key, value in params.items():
        field = cls.spec_aliases.get(key, key)
        if field in given:
            raise ValueError(
                f"`{name}` must give {field!r} once (under one of its names), got both "
                f"{given[field]!r} and {key!r} in {spec!r}"
            )
        given[field] = key
        if field not in fields:
            known = sorted(set(cls.spec_aliases) | fields - set(cls.spec_aliases.values()))
            raise ValueError(
                f"`{name}` parameters must be among {', '.join(known) or '(none)'}, "
                f"got {key!r} in {spec!r}"
            )
        if (types.get(field) == "int" and isinstance(value, float) and value.is_integer()
                and abs(value) < 2**53):
            value = int(value)  # "levels=1e1": an integer written with an exponent
        kwargs[field] = value
    return cls(**kwargs)


#: Short name of :func:`compressor_from_spec`.
build = compressor_from_spec


def describe_compressors() -> list[dict[str, Any]]:
    """Every compressor with its parameters and defaults (what ``gradzip list --json`` prints)."""
    rows = []
    for name, cls in REGISTRY.items():
        key_of = {field: key for key, field in cls.spec_aliases.items()}
        doc = (cls.__doc__ or "").strip().split("\n\n")[0]
        rows.append(
            {
                "name": name,
                "class": cls.__name__,
                "error_feedback_default": cls.biased,
                "description": " ".join(doc.split()),
                "parameters": [
                    {
                        "name": key_of.get(f.name, f.name),
                        "type": str(f.type),
                        "default": f.default,
                    }
                    for f in dataclasses.fields(cls)  # type: ignore[arg-type]
                ],
            }
        )
    return rows
