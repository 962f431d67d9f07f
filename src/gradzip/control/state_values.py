"""Value checks of a loaded two-level controller state (Accordion, level schedules).

``Engine.load_state_dict`` first compares a loaded state with a fresh one (structure, shapes,
dtypes, kinds of values, finiteness); these pure functions check what that cannot: level
names, ranges of counters and norms, and the consistency of the controller's step, decision
due and hold. Each returns the first problem as ``"path: constraint, got value"`` (the path within the
compressor's state), or ``None``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from numbers import Real
from typing import Any

import torch

from gradzip.control.rule import CRITICAL, STEADY
from gradzip.statecheck import nonneg_int

__all__ = ["accordion_problem", "schedule_problem", "step_count", "two_level_problem"]



def _optional_step(value: Any, upto: int) -> bool:
    """``None`` or an integer in ``[0, upto]``."""
    return value is None or (nonneg_int(value) and int(value) <= upto)


def _norm_ok(value: Any) -> bool:
    """``None`` or a finite real number >= 0 (a norm not measured yet, or measured)."""
    return value is None or (
        isinstance(value, Real) and not isinstance(value, bool)
        and math.isfinite(float(value)) and float(value) >= 0
    )


def step_count(value: Any) -> int | None:
    """A step count held as an integer or as a 0-d int64 tensor (Accordion's, see
    :mod:`gradzip.control.accordion_state`), or ``None`` where ``value`` is neither or is
    negative."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype != torch.int64:
            return None
        value = int(value)
    return int(value) if nonneg_int(value) else None


def two_level_problem(ctrl: Mapping[str, Any], fresh: Mapping[str, Any]) -> str | None:
    """What every two-level controller's sub-state must satisfy.

    Args:
        ctrl: the loaded ``controller`` sub-state.
        fresh: the fresh one (``init_state``) for the same tensors.
    """
    path = "controller"
    if step_count(ctrl["step"]) is None:
        return f"{path}.step: must be an integer >= 0, got {ctrl['step']!r}"
    fixed = fresh["fixed"]
    if ctrl["fixed"] != fixed:
        return f"{path}.fixed: must be {fixed!r} (the tensors both levels send dense), got {ctrl['fixed']!r}"
    for name, level in ctrl["level"].items():
        want = ("dense",) if name in fixed else (CRITICAL, STEADY)
        if level not in want:
            return f"{path}.level.{name}: must be one of {list(want)}, got {level!r}"
    last_lr = ctrl["last_lr"]
    if last_lr is not None and not (
        isinstance(last_lr, Real) and not isinstance(last_lr, bool)
        and math.isfinite(float(last_lr)) and float(last_lr) >= 0
    ):
        return f"{path}.last_lr: must be None or a finite number >= 0, got {last_lr!r}"
    counts = ctrl["counts"]
    for key, value in [*counts.items(), *counts["reasons"].items()]:
        if key != "reasons" and not nonneg_int(value):
            return f"{path}.counts.{key}: must be an integer >= 0, got {value!r}"
    if counts["decisions"] < 1:
        return f"{path}.counts.decisions: must be >= 1 (the first decision), got {counts['decisions']}"
    log = ctrl["log"]
    if not isinstance(log, list):
        return f"{path}.log: must be a list of decision records, got {type(log).__name__}"
    for i, rec in enumerate(log):
        # The log is read by people; only the point numbers are used (to keep the last points).
        if not isinstance(rec, Mapping) or not nonneg_int(rec.get("decision")):
            return f"{path}.log[{i}]: must be a decision record with a `decision` >= 0, got {rec!r}"
    return None


def accordion_problem(
    ctrl: Mapping[str, Any],
    fresh: Mapping[str, Any],
    *,
    signal: str,
    shapes: Mapping[str, torch.Size],
    workers: int,
) -> str | None:
    """Accordion's controller sub-state, beyond :func:`two_level_problem`.

    Args:
        ctrl: the loaded ``controller`` sub-state.
        fresh: the fresh one.
        signal: the Accordion's ``signal`` (``"raw"`` window sums carry the worker axis).
        shapes: the tensors Accordion reduces.
        workers: the local workers.
    """
    found = two_level_problem(ctrl, fresh)
    if found:
        return found
    path = "controller"
    for key in ("per_layer", "hold"):
        if ctrl[key] != fresh[key]:
            return f"{path}.{key}: must be {fresh[key]!r} (this Accordion's configuration), got {ctrl[key]!r}"
    step, interval = step_count(ctrl["step"]), fresh["hold"]["interval"]
    assert step is not None  # checked by two_level_problem
    if not nonneg_int(ctrl["interval"]):
        return f"{path}.interval: must be an integer >= 0 (decisions taken), got {ctrl['interval']!r}"
    if not nonneg_int(ctrl["offset"]):
        return f"{path}.offset: must be an integer >= 0 (engine steps not counted), got {ctrl['offset']!r}"
    if ctrl["host_step"] is not None and not nonneg_int(ctrl["host_step"]):
        return f"{path}.host_step: must be None or an integer >= 0, got {ctrl['host_step']!r}"
    for key, value in ctrl["tally"].items():
        if step_count(value) is None:
            return f"{path}.tally.{key}: must be an integer >= 0, got {value!r}"
    # The next decision falls due at most one interval later, and not before this step: a
    # value below the step would never be reached, and no decision would ever be taken
    # again. With signal="raw" a decision due at this step is taken at its first call.
    nxt = ctrl["next"]
    low = step if signal == "raw" else step + 1
    if not nonneg_int(nxt) or not low <= nxt <= step + interval:
        return f"{path}.next: must be an integer in [{low}, {step + interval}], got {nxt!r}"
    if not _optional_step(ctrl["drop_step"], step):
        return f"{path}.drop_step: must be None or an integer in [0, {step}], got {ctrl['drop_step']!r}"
    for key, norm in ctrl["prev_norm"].items():
        if not _norm_ok(norm):
            return f"{path}.prev_norm.{key}: must be None or a finite number >= 0, got {norm!r}"
    for name, acc in ctrl["acc"].items():
        if acc is None:
            continue
        want = (workers, *shapes[name]) if signal == "raw" else tuple(shapes[name])
        if not isinstance(acc, torch.Tensor) or acc.dtype != torch.float32 or tuple(acc.shape) != want:
            got = f"{acc.dtype} {tuple(acc.shape)}" if isinstance(acc, torch.Tensor) else repr(acc)
            return f"{path}.acc.{name}: must be None or a float32 tensor of shape {want}, got {got}"
    return None


def schedule_problem(ctrl: Mapping[str, Any], fresh: Mapping[str, Any]) -> str | None:
    """A level schedule's controller sub-state, beyond :func:`two_level_problem`."""
    found = two_level_problem(ctrl, fresh)
    if found:
        return found
    path = "controller"
    if ctrl["per_layer"] is not False:
        return f"{path}.per_layer: must be False (a schedule decides for the whole model), got {ctrl['per_layer']!r}"
    for key in ("interval", "drop_until"):
        if not nonneg_int(ctrl[key]):
            return f"{path}.{key}: must be an integer >= 0, got {ctrl[key]!r}"
    if not _optional_step(ctrl["drop_step"], ctrl["step"]):
        return f"{path}.drop_step: must be None or an integer in [0, {ctrl['step']}], got {ctrl['drop_step']!r}"
    return None
