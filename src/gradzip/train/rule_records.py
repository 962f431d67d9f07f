"""What controllers and per-parameter rules add to a run's records.

The main compressor's report fills an epoch record's ``density``, ``levels`` and
``critical_fraction`` and the summary's ``accordion_counts``; a rule's compressor (an
Accordion or a level schedule given as a rule, a Top-k for some layers) reports alike, and
its report goes under ``rules``, keyed by the rule's text (``"enc.*=topk:ratio=0.1"``), so the
records show what every compressor did, not only the main one's. Each function asks the
compressor to report (``Compressor.report``) and never inspects types or state keys.

Running marks (what was reported at the end of the previous epoch, decisions already logged)
live in the loop's ``marks`` dict, under keys prefixed by the rule's text, so a checkpoint of
the loop carries them and a resumed run continues the same spans.
"""

from __future__ import annotations

from typing import Any

from gradzip.compressors.base import Compressor

__all__ = ["control_fields", "new_rule_decisions", "rule_counts", "rule_fields", "rule_reports"]


def control_fields(report: dict[str, Any], batch_controller: Any,
                   marks: dict[str, Any]) -> dict[str, Any]:
    """The main controller's and the batch-size controller's fields of an epoch record
    (``report``: the main compressor's ``report``, ``{}`` if none); updates ``marks`` in place."""
    rec: dict[str, Any] = {}
    if "counts" in report:
        counts = report["counts"]
        crit = counts["critical_steps"] - marks.get("critical_steps", 0)
        steady = counts["steady_steps"] - marks.get("steady_steps", 0)
        marks.update(critical_steps=counts["critical_steps"], steady_steps=counts["steady_steps"])
        levels = report["levels"]
        rec["critical"] = sum(v == "critical" for v in levels.values())
        # Fraction of (tensor, step) pairs of this epoch reduced at the critical level.
        rec["critical_fraction"] = crit / max(crit + steady, 1)
        rec["levels"] = levels
    ctl = batch_controller
    if ctl is not None:
        counts = ctl.counts
        crit = counts["critical_rounds"] - marks.get("critical_rounds", 0)
        steady = counts["steady_rounds"] - marks.get("steady_rounds", 0)
        marks.update(critical_rounds=counts["critical_rounds"], steady_rounds=counts["steady_rounds"])
        rec["batch_level"] = ctl.level
        rec["global_batch"] = ctl.batch_size
        rec["batch_critical_fraction"] = crit / max(crit + steady, 1)
    return rec


def rule_reports(engine: Any) -> list[tuple[str, Compressor, dict[str, Any]]]:
    """``(rule text, compressor, report)`` for each rule with a compressor (a dense rule has
    nothing to report); empty without an engine (before the process group exists)."""
    if engine is None:
        return []
    out = []
    for rule, state in zip(engine.options.rules, engine.rule_states, strict=True):
        if rule.compressor is not None:
            out.append((rule.describe(), rule.compressor, rule.compressor.report(state)))
    return out


def rule_fields(engine: Any, marks: dict[str, Any]) -> dict[str, Any]:
    """The epoch record's ``rules`` field: per rule, the epoch's ``density`` (where its
    compressor tells one), and a controller's ``levels``, ``critical`` tensors and
    ``critical_fraction`` of the epoch's tensor-steps. Updates ``marks`` in place.

    Returns:
        ``{"rules": {text: fields}}``, or ``{}`` when no rule reports anything.
    """
    out: dict[str, dict[str, Any]] = {}
    for text, _, report in rule_reports(engine):
        fields: dict[str, Any] = {}
        parts = report.get("density_parts")
        if parts is not None:
            sent0, offered0 = marks.get(f"{text} density", (0, 0))
            offered = parts[1] - offered0
            fields["density"] = (parts[0] - sent0) / offered if offered else None
            marks[f"{text} density"] = [parts[0], parts[1]]
        elif report.get("density") is not None:
            fields["density"] = report["density"]
        counts = report.get("counts")
        if counts is not None:
            crit = counts["critical_steps"] - marks.get(f"{text} critical_steps", 0)
            steady = counts["steady_steps"] - marks.get(f"{text} steady_steps", 0)
            marks[f"{text} critical_steps"] = counts["critical_steps"]
            marks[f"{text} steady_steps"] = counts["steady_steps"]
            levels = report["levels"]
            fields["critical"] = sum(v == "critical" for v in levels.values())
            fields["critical_fraction"] = crit / max(crit + steady, 1)
            fields["levels"] = levels
        if fields:
            out[text] = fields
    return {"rules": out} if out else {}


def rule_counts(engine: Any) -> dict[str, Any]:
    """The summary's ``rule_counts``: each controller rule's cumulative counts (as
    ``accordion_counts`` for the main compressor); ``{}`` when no rule is a controller."""
    out = {text: report["counts"] for text, _, report in rule_reports(engine)
           if report.get("counts") is not None}
    return {"rule_counts": out} if out else {}


def new_rule_decisions(engine: Any, marks: dict[str, Any]) -> list[dict[str, Any]]:
    """Decision records that controller rules took since the last call, each with its
    ``rule`` text added. Updates ``marks`` in place."""
    records: list[dict[str, Any]] = []
    if engine is None:
        return records
    for rule, state in zip(engine.options.rules, engine.rule_states, strict=True):
        compressor = rule.compressor
        counts = None if compressor is None else compressor.report(state).get("counts")
        if counts is None:
            continue
        text = rule.describe()
        seen = marks.get(f"{text} decisions", 0)
        if counts["decisions"] != seen:
            # A compressor reporting counts offers decisions(state, since) (Compressor.report).
            new = compressor.decisions(state, since=seen)  # type: ignore[attr-defined]
            records.extend({**r, "rule": text} for r in new)
            marks[f"{text} decisions"] = counts["decisions"]
    return records
