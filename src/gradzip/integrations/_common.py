"""What the framework adapters share: the missing-framework error, option routing, metrics."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import gradzip.ddp
from gradzip._validate import check_bool
from gradzip.options import EngineOptions

__all__ = ["ENGINE_OPTIONS", "hook_metrics", "missing_framework", "split_engine_options",
           "with_optimizer"]

# The keywords that configure the hook: the fields of the options record (so an option added
# there is accepted here too), the record itself, and the hook's `overlap` and `fuse_buckets`.
# `process_group` stays with the framework: the hook reduces over the group the framework's
# DDP model was built with.
HOOK_OPTIONS = ("overlap", "fuse_buckets")
ENGINE_OPTIONS: frozenset[str] = frozenset((*EngineOptions.names(), "options", *HOOK_OPTIONS))


def missing_framework(module: str, package: str, error: ImportError) -> ImportError:
    """The one-line error raised when ``module`` is imported without its framework.

    Args:
        module: the integration module (``"gradzip.integrations.lightning"``).
        package: the pip package it needs (``"lightning"``).
        error: the original import error, re-raised unchanged when it is about another
            package (a broken install should not be reported as a missing one).

    Returns:
        The error to raise.
    """
    top = (error.name or "").split(".")[0]
    if top != package.replace("-", "_"):
        return error
    return ImportError(
        f"{module} needs the `{package}` package: pip install {package} (or the `integrations` "
        "extra: pip install -e '.[integrations]' in gradzip's source tree)"
    )


def split_engine_options(
    options: Mapping[str, Any], where: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split keyword arguments into the hook's options and the framework's own.

    Args:
        options: the keywords a user passed.
        where: the callable's name, for error messages.

    Returns:
        ``(engine_options, other_options)``.

    Raises:
        TypeError, ValueError: an invalid engine option (named), or a keyword that would
            register a second communication hook.
    """
    engine = {k: v for k, v in options.items() if k in ENGINE_OPTIONS}
    # Validated now, so a bad option fails where it is written, not at the first fit.
    EngineOptions.build(engine.get("options"), **{
        k: v for k, v in engine.items() if k not in ("options", *HOOK_OPTIONS)})
    for key in HOOK_OPTIONS:
        if key in engine:
            check_bool(key, engine[key])
    other = {k: v for k, v in options.items() if k not in ENGINE_OPTIONS}
    for key in ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper"):
        if key in other:
            raise ValueError(
                f"`{key}` must not be given to {where}, got {other[key]!r}: gradzip registers "
                "the communication hook itself"
            )
    return engine, other


def with_optimizer(engine_options: Mapping[str, Any], optimizer: Any) -> dict[str, Any]:
    """``engine_options`` with the framework's ``optimizer`` unless the user gave one (as a
    keyword, or inside an ``options`` record).

    Args:
        engine_options: the hook's keywords as the user gave them.
        optimizer: the framework's optimizer (read for the learning rate), or ``None``.

    Returns:
        The keywords for :func:`gradzip.ddp.register`.
    """
    record = engine_options.get("options")
    if "optimizer" in engine_options or (record is not None and record.optimizer is not None):
        return dict(engine_options)
    return {**engine_options, "optimizer": optimizer}


def hook_metrics(state: gradzip.ddp.GradzipHookState, prefix: str = "gradzip/") -> dict[str, float]:
    """This rank's counters as flat numbers for a framework's loggers.

    Args:
        state: the hook state.
        prefix: put before every name.

    Returns:
        ``steps``, ``skipped_steps``, ``payload_bytes``, ``wire_bytes``, ``dense_wire_bytes``,
        ``compression_rate`` (once bytes were sent) and, for a compressor that reports levels
        (an Accordion), ``level_share/<level>``: the fraction of tensors at each level.
    """
    stats = state.stats
    out: dict[str, float] = {
        key: float(stats[key])
        for key in ("steps", "skipped_steps", "payload_bytes", "wire_bytes", "dense_wire_bytes")
    }
    if stats["compression_rate"] is not None:
        out["compression_rate"] = float(stats["compression_rate"])
    levels = stats["levels"]
    if isinstance(levels, Mapping) and levels:
        values = [str(v) for v in levels.values()]
        for level in sorted(set(values)):
            out[f"level_share/{level}"] = values.count(level) / len(values)
    return {prefix + key: value for key, value in out.items()}
