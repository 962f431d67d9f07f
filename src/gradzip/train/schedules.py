"""Learning-rate schedules for data-parallel training.

Implements the linear scaling rule with gradual warm-up (Goyal et al., 2017)
followed by step decay at fixed epoch milestones.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

import torch

from gradzip._validate import check_int, check_real

logger = logging.getLogger(__name__)


def lr_at(epoch_float: float, *, base_lr: float, warmup_epochs: float,
          milestones: Sequence[float], gamma: float = 0.1, workers: int = 1,
          scale_with_workers: bool = True) -> float:
    """Learning rate at a (fractional) epoch.

    The peak rate is ``base_lr * workers`` when ``scale_with_workers`` and
    ``base_lr`` otherwise. During the first ``warmup_epochs`` the rate grows
    linearly from ``base_lr`` to the peak (a constant when the two are
    equal). The result is multiplied by ``gamma`` once for every milestone
    ``m`` with ``epoch_float >= m``.

    Args:
        epoch_float: Progress in epochs, e.g. ``epoch + step / steps_per_epoch``.
        base_lr: Single-worker learning rate (> 0).
        warmup_epochs: Warm-up length in epochs (>= 0; 0 disables warm-up).
        milestones: Non-decreasing, non-negative decay epochs.
        gamma: Decay factor per milestone (> 0).
        workers: Number of data-parallel workers (>= 1).
        scale_with_workers: Apply the linear scaling rule.

    Returns:
        The learning rate.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range or milestones are unsorted.
    """
    epoch = check_real("epoch_float", epoch_float, low=0)
    base = check_real("base_lr", base_lr, low=0, low_open=True)
    warmup = check_real("warmup_epochs", warmup_epochs, low=0)
    decay = check_real("gamma", gamma, low=0, low_open=True)
    check_int("workers", workers, minimum=1)
    if not isinstance(scale_with_workers, bool):
        raise TypeError(f"`scale_with_workers` must be a bool, got {scale_with_workers!r}")
    if isinstance(milestones, (str, bytes)) or not isinstance(milestones, Sequence):
        raise TypeError(f"`milestones` must be a sequence of numbers, got {milestones!r}")
    marks = [check_real("milestones", m, low=0) for m in milestones]
    if any(b < a for a, b in itertools.pairwise(marks)):
        raise ValueError(f"`milestones` must be non-decreasing, got {list(milestones)!r}")
    peak = base * workers if scale_with_workers else base
    lr = base + (peak - base) * (epoch / warmup) if epoch < warmup else peak
    passed = sum(1 for m in marks if epoch >= m)
    return lr * decay**passed


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group of ``optimizer``.

    Args:
        optimizer: Any torch optimizer.
        lr: New learning rate (finite, >= 0).

    Raises:
        TypeError: If ``optimizer`` is not an optimizer or ``lr`` not a number.
        ValueError: If ``lr`` is negative or not finite.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"`optimizer` must be a torch.optim.Optimizer, got {optimizer!r}")
    value = check_real("lr", lr, low=0)
    for group in optimizer.param_groups:
        group["lr"] = value


def batch_scaled_lr(base_lr: float, batch: int, reference_batch: int) -> float:
    """Linear scaling rule: ``base_lr * batch / reference_batch``.

    Args:
        base_lr: Learning rate tuned for ``reference_batch`` (> 0).
        batch: Actual (global) batch size (>= 1).
        reference_batch: Batch size ``base_lr`` was tuned for (>= 1).

    Returns:
        The scaled learning rate.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range.
    """
    base = check_real("base_lr", base_lr, low=0, low_open=True)
    check_int("batch", batch, minimum=1)
    check_int("reference_batch", reference_batch, minimum=1)
    return base * batch / reference_batch


def milestone_epochs(cfg: Any) -> list[float]:
    """Milestones of a resolved run configuration in epochs: values below 1 are fractions of
    ``cfg.epochs``."""
    assert cfg.milestones is not None and cfg.epochs is not None
    return [m * cfg.epochs if m < 1 else float(m) for m in cfg.milestones]
