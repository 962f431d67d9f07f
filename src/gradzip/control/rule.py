"""The critical-regime rule of Accordion, shared by the compression and batch-size controllers.

Pure functions of plain numbers: no state, no tensors beyond a norm helper, no collectives.
Every worker that feeds them the same aggregated quantities gets the same answer, which is
what lets the controllers switch levels on every worker at once without a broadcast.

References:
    Agarwal, Wang, Lee, Venkataraman and Papailiopoulos, "Adaptive Gradient Communication via
    Critical Learning Regime Identification" (Accordion), MLSys 2021.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from gradzip._validate import check_real

__all__ = [
    "CRITICAL",
    "LR_DROP_RATIO",
    "LR_HOLDS",
    "REASONS",
    "STEADY",
    "Decision",
    "critical_regime",
    "decide",
    "is_lr_drop",
    "joint_norm",
]

CRITICAL = "critical"
STEADY = "steady"
#: Why a level was chosen: the first intervals (nothing to compare with yet), a learning-rate
#: decrease, a large relative change of the accumulated gradient norm, or a small one.
REASONS = ("first", "lr_drop", "norm_change", "steady")
#: What a learning-rate drop does, for every controller that reacts to one (Accordion, the
#: batch-size controller; a level schedule holds for a fixed number of steps instead):
#: ``"interval"`` (the paper's code) makes the gentle level hold for one whole interval from
#: the drop, overridden by no check; the interval restarts at the drop, so the next decision
#: compares a measurement taken entirely after the drop with the last one taken before it.
#: ``"boundary"`` (gradzip's first rule) holds until the current interval ends, whose
#: decision compares as usual.
LR_HOLDS = ("interval", "boundary")
#: A learning rate counts as dropped when it falls below this fraction of the previous step's.
#: Step schedules (divide by 10) always qualify; the per-step decrease of a smooth schedule
#: (cosine, linear decay) stays far above it except in its last few steps.
LR_DROP_RATIO = 0.9


def critical_regime(prev_norm: float | None, curr_norm: float, eta: float) -> tuple[bool, float | None]:
    """Accordion's test: is training in a critical regime?

    Critical when ``|prev_norm - curr_norm| / prev_norm >= eta``. A missing (``None``) or zero
    previous norm, or a non-finite current one, counts as critical, with no relative change.

    Args:
        prev_norm: norm of the gradient accumulated over the previous interval, or ``None``.
        curr_norm: norm of the gradient accumulated over the interval that just ended.
        eta: the threshold on the relative change (> 0; 0.5 in the paper).

    Returns:
        ``(critical, relative_change)``; ``relative_change`` is ``None`` where undefined.

    Raises:
        ValueError: a negative norm, or ``eta`` not > 0.
    """
    eta = check_real("eta", eta, low=0, low_open=True)
    if prev_norm is not None and prev_norm < 0:
        raise ValueError(f"`prev_norm` must be >= 0, got {prev_norm!r}")
    if curr_norm < 0:
        raise ValueError(f"`curr_norm` must be >= 0, got {curr_norm!r}")
    if prev_norm is None or prev_norm == 0 or not math.isfinite(prev_norm):
        return True, None
    if not math.isfinite(curr_norm):
        return True, None
    change = abs(prev_norm - curr_norm) / prev_norm
    return change >= eta, change


@dataclass(frozen=True)
class Decision:
    """One application of the rule.

    Attributes:
        critical: whether the gentle (critical-regime) level was chosen.
        rel_change: the relative change of the norm, when defined.
        reason: one of :data:`REASONS`.
    """

    critical: bool
    rel_change: float | None
    reason: str

    @property
    def level(self) -> str:
        """``"critical"`` or ``"steady"``."""
        return CRITICAL if self.critical else STEADY


def decide(prev_norm: float | None, curr_norm: float, eta: float, *, lr_dropped: bool = False) -> Decision:
    """The rule with its reason: a learning-rate drop forces critical, then
    :func:`critical_regime` decides (``"first"`` when there is no previous norm).

    Args:
        prev_norm, curr_norm, eta: as for :func:`critical_regime`.
        lr_dropped: whether the learning rate dropped (forces the critical level).

    Returns:
        The :class:`Decision`.
    """
    critical, change = critical_regime(prev_norm, curr_norm, eta)
    if lr_dropped:
        return Decision(True, change, "lr_drop")
    if prev_norm is None:
        return Decision(True, None, "first")
    return Decision(critical, change, "norm_change" if critical else "steady")


def is_lr_drop(previous_lr: float | None, lr: float | None) -> bool:
    """Whether ``lr`` is a drop from ``previous_lr`` (below :data:`LR_DROP_RATIO` of it).

    Either being ``None`` (unknown) is not a drop.
    """
    if previous_lr is None or lr is None:
        return False
    return lr < LR_DROP_RATIO * previous_lr


def joint_norm(tensors: Iterable[torch.Tensor]) -> float:
    """The Euclidean norm of several tensors taken together, computed in float64.

    Deterministic for given inputs, so workers holding bit-identical tensors get the same
    float (float64 keeps the rounding far from any threshold that matters).
    """
    total = 0.0
    for t in tensors:
        total += float(torch.linalg.vector_norm(t.detach().to(torch.float64)).item()) ** 2
    return math.sqrt(total)
