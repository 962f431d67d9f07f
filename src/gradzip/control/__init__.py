"""Control of communication over training: Accordion's critical-regime rule applied to the
compression level (:class:`Accordion`) and to the global batch size
(:class:`BatchSizeController`), and fixed level schedules (:class:`Schedule`)."""

from gradzip.control.accordion import LOG_POINTS, LR_HOLDS, MODEL, SIGNALS, Accordion
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
from gradzip.control.schedule import Schedule
from gradzip.control.switch import DENSE, TwoLevel
from gradzip.spec import parse_level_schedule

__all__ = [
    "CRITICAL",
    "DENSE",
    "LR_HOLDS",
    "SIGNALS",
    "Schedule",
    "TwoLevel",
    "parse_level_schedule",
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
