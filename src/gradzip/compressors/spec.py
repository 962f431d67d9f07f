"""Spec strings (``"topk:ratio=0.01"``) and the registry of compressors."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from gradzip.compressors.base import Compressor
from gradzip.compressors.lowprec import BF16, FP16
from gradzip.compressors.none import NoCompression
from gradzip.compressors.powersgd import PowerSGD
from gradzip.compressors.qsgd import QSGD
from gradzip.compressors.randk import RandK
from gradzip.compressors.sign import Sign
from gradzip.compressors.threshold import HardThreshold
from gradzip.compressors.topk import TopK

__all__ = ["REGISTRY", "compressor_from_spec", "describe_compressors", "parse_spec"]

REGISTRY: dict[str, type[Compressor]] = {
    cls.spec_name: cls
    for cls in (NoCompression, FP16, BF16, TopK, RandK, HardThreshold, PowerSGD, QSGD, Sign)
}

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_INT = re.compile(r"^[+-]?\d+$")
_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$|^[+-]?(nan|inf)$", re.IGNORECASE)


def _parse_value(text: str) -> Any:
    if _INT.match(text):
        return int(text)
    if _FLOAT.match(text):
        return float(text)
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """Split ``"name:key=value,key=value"`` into the name and typed values.

    Raises:
        TypeError: ``spec`` is not a string.
        ValueError: the string is malformed (naming the bad part).
    """
    if not isinstance(spec, str):
        raise TypeError(f"`spec` must be a string such as 'topk:ratio=0.01', got {spec!r}")
    name, _, rest = spec.strip().partition(":")
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
            params[key] = _parse_value(value)
    elif ":" in spec:
        raise ValueError(f"`spec` has ':' but no parameters, got {spec!r}")
    return name, params


def compressor_from_spec(spec: str | Compressor) -> Compressor:
    """Build a compressor from a spec string (a compressor passes through unchanged).

    Examples: ``"none"``, ``"fp16"``, ``"topk:ratio=0.01"``, ``"threshold:budget=0.01"``,
    ``"powersgd:rank=2"``, ``"qsgd:levels=8"``, ``"sign"``, and an Accordion's own spec,
    ``"accordion(steady=powersgd:rank=1,critical=powersgd:rank=4,eta=0.5,interval=100,...)"``.

    Raises:
        ValueError: unknown name, unknown parameter, or an invalid value (the compressor's
            own validation names the constraint).
        TypeError: a value of the wrong type.
    """
    if isinstance(spec, Compressor):
        return spec
    if isinstance(spec, str) and spec.strip().startswith("accordion("):
        # Imported here: the control package builds on this module.
        from gradzip.control.accordion import Accordion

        return Accordion.from_spec(spec.strip())
    if isinstance(spec, str) and spec.strip().startswith("schedule("):
        from gradzip.control.schedule import Schedule

        return Schedule.from_spec(spec.strip())
    name, params = parse_spec(spec)
    cls = REGISTRY.get(name)
    if cls is None:
        raise ValueError(
            f"`spec` must name one of {', '.join(sorted(REGISTRY))}, got {name!r} in {spec!r}"
        )
    fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs = {}
    for key, value in params.items():
        field = cls.spec_aliases.get(key, key)
        if field not in fields:
            known = sorted(set(cls.spec_aliases) | fields - set(cls.spec_aliases.values()))
            raise ValueError(
                f"`{name}` parameters must be among {', '.join(known) or '(none)'}, "
                f"got {key!r} in {spec!r}"
            )
        kwargs[field] = value
    return cls(**kwargs)


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
