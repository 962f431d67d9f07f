"""The controller sub-state of :class:`~gradzip.plan.auto.Auto`: a fresh one, the levels'
names and quality classes, and the check of a loaded one."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from gradzip.control.rule import REASONS
from gradzip.plan.candidates import default_candidates
from gradzip.spec import compressor_from_spec

__all__ = ["auto_problem", "fresh_controller", "level_qualities"]

_LIGHT = {"none": "lossless", "fp16": "gentle", "bf16": "gentle"}


def level_qualities(specs: Sequence[str]) -> dict[str, str]:
    """``label -> quality class`` of each level spec, in order.

    A spec among :func:`~gradzip.plan.candidates.default_candidates`' per-step ones takes
    that candidate's name and class (``"powersgd:rank=4"`` -> ``"powersgd-r4"``, gentle);
    ``none`` is lossless, the casts gentle, and any other spec aggressive under its own text.
    """
    known = {compressor_from_spec(c.spec).spec(): (c.name, c.quality)
             for c in default_candidates() if not c.outer_steps}
    out = {}
    for spec in specs:
        name, quality = known.get(spec, (spec, _LIGHT.get(spec, "aggressive")))
        out[name] = quality
    return out


def fresh_controller(shapes: Mapping[str, torch.Size], labels: Sequence[str],
                     warmup: int) -> dict[str, Any]:
    """The controller of a run that has not started: at the first level, critical."""
    return {
        "shapes": {n: list(s) for n, s in shapes.items()},
        "step": 0,  # optimizer steps completed
        "next": warmup,  # the step count at which the next decision falls due
        "current": labels[0],
        "critical": True,  # the early steps are critical
        "last_lr": None,
        "last_end": None,  # the clock at the last end_step
        "step_reduce": 0.0,  # seconds inside reduce during the current step
        "step_calls": 0,
        "step_wire": 0,
        "skip": False,  # the current step held a decision: not a sample
        "periods": [], "reduces": [], "calls": [], "wires": [],  # per step since the decision
        "acc": {n: None for n in shapes},  # sum of the averaged gradient since the decision
        "acc_steps": 0,
        "prev_norm": None,
        "last_compute": None,  # seconds, from the last decision that had timed steps
        "dropped": False,
        "pending": warmup == 0,  # warmup 0: the first decision opens step 0
        "overhead": {lb: None for lb in labels},  # seconds in reduce beyond the link's
        "log": [],
        "counts": {"decisions": 0, "switches": 0, "critical": 0,
                   "steps": {lb: 0 for lb in labels}, "critical_steps": 0, "steady_steps": 0,
                   "reasons": {r: 0 for r in REASONS}},
    }


def _bad_number(value: Any, *, integer: bool = False) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return True
    if integer and not isinstance(value, int):
        return True
    return not math.isfinite(value) or value < 0


def auto_problem(ctrl: Mapping[str, Any], labels: Sequence[str]) -> str | None:
    """The first value of a loaded controller that cannot be continued from, or ``None``.

    Args:
        ctrl: the loaded controller sub-state.
        labels: the levels' names of this configuration.

    Returns:
        ``"key: what it must be, got value"``, or ``None``.
    """
    if ctrl.get("current") not in labels:
        return f"current: must be one of {list(labels)}, got {ctrl.get('current')!r}"
    for key in ("step", "next", "step_calls", "step_wire", "acc_steps"):
        if _bad_number(ctrl.get(key), integer=True):
            return f"{key}: must be an integer >= 0, got {ctrl.get(key)!r}"
    for key in ("step_reduce",):
        if _bad_number(ctrl.get(key)):
            return f"{key}: must be a finite number >= 0, got {ctrl.get(key)!r}"
    for key in ("periods", "reduces", "calls", "wires"):
        values = ctrl.get(key)
        if not isinstance(values, list) or any(_bad_number(v) for v in values):
            return f"{key}: must be a list of finite numbers >= 0, got {values!r}"
    if len({len(ctrl[k]) for k in ("periods", "reduces", "calls", "wires")}) != 1:
        return "periods: must be as long as reduces, calls and wires"
    for key in ("last_end", "prev_norm", "last_lr", "last_compute"):
        value = ctrl.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
            return f"{key}: must be a finite number or None, got {value!r}"
    overhead = ctrl.get("overhead")
    if not isinstance(overhead, dict) or set(overhead) != set(labels) or any(
            v is not None and _bad_number(v) for v in overhead.values()):
        return f"overhead: must map every level to a number >= 0 or None, got {overhead!r}"
    counts = ctrl.get("counts")
    if not isinstance(counts, dict) or set(counts.get("steps", {})) != set(labels):
        return f"counts: must count steps of every level {list(labels)}, got {counts!r}"
    for key in ("decisions", "switches", "critical", "critical_steps", "steady_steps"):
        if _bad_number(counts.get(key), integer=True):
            return f"counts.{key}: must be an integer >= 0, got {counts.get(key)!r}"
    acc = ctrl.get("acc")
    if not isinstance(acc, dict) or not set(acc) <= set(ctrl.get("shapes", {})):
        return f"acc: must hold sums of known tensors only, got {sorted(acc or {})}"
    return None
