"""What :class:`~gradzip.Outer` checks and resolves at construction: the engine's options, the
models and inner optimizers, and a level schedule counted in inner steps.

Pure functions of the constructor's arguments, kept apart so the outer loop itself stays
readable.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from gradzip.compressors.base import Compressor
from gradzip.control.schedule import Schedule
from gradzip.options import EngineOptions
from gradzip.outer.fragments import FragmentPlan
from gradzip.spec import compressor_from_spec

__all__ = ["check_models", "check_optimizers", "engine_options", "schedule_in_syncs"]

# Engine options that concern gradients of a loss, not pseudo-gradients.
_GRADIENT_ONLY = ("optimizer", "grad_scaler")


def engine_options(kind: str, given: dict[str, Any]) -> tuple[EngineOptions, str]:
    """The engine's options record and ``decide_on``, from ``options=`` and keywords alike.

    The record and the keywords are merged first (keywords replace the record's fields, as
    :class:`~gradzip.Engine` does), and every check reads the merged record, so an option
    set either way is seen.

    Args:
        kind: the outer optimizer's kind.
        given: the constructor's engine keywords (``options``, ``decide_on`` and the
            :class:`~gradzip.EngineOptions` fields).

    Returns:
        ``(options, decide_on)``: under ``ef-momentum`` error feedback is on (its residual is
        the outer momentum).

    Raises:
        TypeError: an unknown keyword, or ``options`` not an ``EngineOptions``.
        ValueError: a gradient-only option, or error feedback turned off under
            ``ef-momentum``.
    """
    given = dict(given)
    record = given.pop("options", None)
    decide_on = given.pop("decide_on", "auto")
    options = EngineOptions.build(record, **given)
    for key in _GRADIENT_ONLY:
        value = getattr(options, key)
        if value is not None:
            raise ValueError(f"`{key}` applies to gradients, not pseudo-gradients: the outer "
                             f"loop does not take it, got {key}={value!r}")
    if kind == "ef-momentum":
        if options.error_feedback is False:
            raise ValueError("`error_feedback` must be on for the ef-momentum `outer_optimizer` "
                             "(its residual is the momentum), got error_feedback=False")
        options = dataclasses.replace(options, error_feedback=True)
    return options, decide_on


def check_models(models: nn.Module | Sequence[nn.Module], workers: int) -> list[nn.Module]:
    """One module per local worker.

    Raises:
        TypeError: not a module or a sequence of modules.
        ValueError: another count than ``workers``.
    """
    listed = [models] if isinstance(models, nn.Module) else models
    if not isinstance(listed, Sequence) or not all(isinstance(m, nn.Module) for m in listed):
        raise TypeError(f"`models` must be a module or a sequence of modules, got {type(models).__name__}")
    if len(listed) != workers:
        raise ValueError(f"`models` must hold one module per local worker ({workers}), got {len(listed)}")
    return list(listed)


def check_optimizers(
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None, models: int
) -> list[torch.optim.Optimizer]:
    """One inner optimizer per model, or none.

    Raises:
        ValueError: another count, or something else than optimizers.
    """
    if optimizers is None:
        return []
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    if len(optimizers) != models or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
        raise ValueError(f"`inner_optimizers` must hold one optimizer per model ({models}), "
                         f"got {len(optimizers)}")
    return list(optimizers)


def _sync_range(start: int, end: int, period: int) -> tuple[int, int]:
    """The synchronisations sent inside inner steps ``[start, end)`` (0-based): sync ``k`` is
    sent after 0-based inner step ``(k + 1) * period - 1``."""
    first = -(-(start + 1) // period) - 1
    stop = -(-(end + 1) // period) - 1
    return first, stop


def schedule_in_syncs(compressor: Compressor | str, plan: FragmentPlan) -> Compressor:
    """``compressor``, with a :class:`~gradzip.Schedule`'s ranges moved from inner steps to
    synchronisations (what the engine counts under the outer loop).

    A range ``[a, b)`` of inner steps becomes the synchronisations sent after one of those
    steps; ``after_drop`` is rounded up to whole synchronisations. Any other compressor is
    returned as built.

    Raises:
        ValueError: a gentle range holds no synchronisation (it would do nothing).
    """
    built = compressor_from_spec(compressor)
    if not isinstance(built, Schedule):
        return built
    period = plan.period
    ranges = []
    for start, end in built.gentle_steps:
        first, stop = _sync_range(start, end, period)
        if stop <= first:
            raise ValueError(
                f"`compressor`'s gentle range {start}-{end} (inner steps) must hold a "
                f"synchronisation, but with one sent every {period} inner steps it holds none")
        ranges.append((first, stop))
    return Schedule(built.gentle, built.aggressive, gentle_steps=ranges,
                    after_drop=-(-built.after_drop // period))
