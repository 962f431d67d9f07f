"""The decision log of Accordion's controller: records, counts, forced switches.

Plain functions over the controller's sub-state (a dict of plain data), shared by the
compressor's steps and its static helpers.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from gradzip.compressors.base import StepContext
from gradzip.control.rule import CRITICAL

__all__ = [
    "LOG_POINTS",
    "MODEL",
    "controller",
    "force_critical",
    "key_levels",
    "log_decisions",
    "record",
    "set_levels",
]

log = logging.getLogger(__name__)

#: The decision key when the whole model is judged at once (``per_layer=False``).
MODEL = "model"

#: Decision points whose records the state keeps (one record per decision key each).
LOG_POINTS = 8


def controller(state: Any) -> dict[str, Any]:
    """The controller sub-state of an Accordion state (or of an engine holding one)."""
    if hasattr(state, "compressor_state"):
        state = state.compressor_state
    if not isinstance(state, Mapping) or not isinstance(state.get("controller"), dict):
        raise TypeError(
            "`state` must be an Accordion compressor state (engine.compressor_state) or an "
            f"engine using Accordion, got {type(state).__name__}"
        )
    return state["controller"]


def record(step: int, interval: int, key: str, norm: float | None, prev: float | None,
           change: float | None, level: str, reason: str) -> dict[str, Any]:
    """One decision record (its ``decision`` number is set by :func:`log_decisions`)."""
    return {"decision": 0, "step": step, "interval": interval, "name": key, "norm": norm,
            "prev_norm": prev, "rel_change": change, "level": level, "reason": reason}


def key_levels(ctrl: dict[str, Any]) -> dict[str, str]:
    """Current level per decision key (tensor names, or ``"model"``); tensors that both levels
    send dense (``ctrl["fixed"]``) take no decisions and are left out."""
    fixed = set(ctrl.get("fixed", ()))
    levels = {n: lv for n, lv in ctrl["level"].items() if n not in fixed}
    if ctrl["per_layer"]:
        return levels
    return {MODEL: next(iter(levels.values()), CRITICAL)}


def force_critical(ctrl: dict[str, Any], step: int | None, reason: str = "lr_drop") -> None:
    """Every deciding tensor critical from ``step`` on, recorded as one decision point.

    What happens next is the caller's: Accordion holds the level for an interval (or until
    the current one ends), a schedule until its next switch.

    Args:
        ctrl: the controller sub-state (entries are replaced, never mutated in place).
        step: the engine step from which it applies; ``None``: the controller's step count.
        reason: the records' reason.
    """
    before = key_levels(ctrl)
    when = ctrl["step"] if step is None else step
    records = [
        record(when, ctrl["interval"], key, None, ctrl.get("prev_norm", {}).get(key), None,
               CRITICAL, reason)
        for key in before
    ]
    fixed = set(ctrl.get("fixed", ()))
    ctrl["level"] = {n: (lv if n in fixed else CRITICAL) for n, lv in ctrl["level"].items()}
    log_decisions(ctrl, records, before, None)


def set_levels(ctrl: dict[str, Any], chosen: Mapping[str, str], records: list[dict[str, Any]],
               ctx: StepContext | None) -> None:
    """Apply one decision point: ``chosen`` maps decision keys to levels (fixed tensors keep
    theirs), and the point's records are logged."""
    before = key_levels(ctrl)
    fixed = set(ctrl.get("fixed", ()))
    ctrl["level"] = {
        n: (lv if n in fixed else chosen[n if ctrl["per_layer"] else MODEL])
        for n, lv in ctrl["level"].items()
    }
    log_decisions(ctrl, records, before, ctx)


def log_decisions(ctrl: dict[str, Any], records: list[dict[str, Any]], before: Mapping[str, str],
                  ctx: StepContext | None) -> None:
    """Number a decision point, count its choices and switches, append it to the bounded log.

    Args:
        ctrl: the controller sub-state.
        records: the point's records, one per decision key.
        before: the level of each decision key before the point (to count switches).
        ctx: the step, when known (debug logging on the worker of rank 0 only).
    """
    counts = dict(ctrl["counts"])
    reasons = dict(counts["reasons"])
    for r in records:
        counts[r["level"]] += 1
        reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
        counts["switches"] += int(before.get(r["name"], r["level"]) != r["level"])
    point = counts["decisions"]
    counts["decisions"] += 1
    counts["reasons"] = reasons
    ctrl["counts"] = counts
    for r in records:
        r["decision"] = point
    kept = [r for r in ctrl["log"] if r["decision"] > point - LOG_POINTS]
    ctrl["log"] = kept + records
    if ctx is None or 0 in ctx.ranks:
        critical = sum(r["level"] == CRITICAL for r in records)
        log.debug("accordion: interval %d from step %d: %d of %d critical (%s)",
                  records[0]["interval"] if records else ctrl["interval"],
                  records[0]["step"] if records else ctrl["step"], critical, len(records),
                  ", ".join(sorted({r["reason"] for r in records})))
