"""Adaptive control of communication: Accordion's critical-regime rule applied to the
compression level (:class:`Accordion`) and to the global batch size
(:class:`BatchSizeController`)."""

from gradzip.control.accordion import LOG_POINTS, MODEL, Accordion
from gradzip.control.batch import BatchPlan, BatchSizeController
from gradzip.control.rule import (
    CRITICAL,
    LR_DROP_RATIO,
    REASONS,
    STEADY,
    Decision,
    critical_regime,
    decide,
    is_lr_drop,
    joint_norm,
)

__all__ = [
    "CRITICAL",
    "LOG_POINTS",
    "LR_DROP_RATIO",
    "MODEL",
    "REASONS",
    "STEADY",
    "Accordion",
    "BatchPlan",
    "BatchSizeController",
    "Decision",
    "critical_regime",
    "decide",
    "is_lr_drop",
    "joint_norm",
]
