"""Level schedules: the gentle level in given ranges of steps, the aggressive one elsewhere.

"Dense for the first N steps, then compress" (PyTorch's ``start_powerSGD_iter``, DeepSpeed's
``freeze_step``) is :meth:`Schedule.warmup`; a list of ranges gives any fixed timing, e.g. the
critical-regime ablation of the Accordion paper (gentle only in the first epochs and after
each learning-rate drop). It shares Accordion's state layout, level machinery, records and
checkpoints (:class:`~gradzip.control.switch.TwoLevel`), so the runner, the DDP hook and the
simulator treat both alike.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from gradzip._validate import check_int
from gradzip.comm.base import Collective
from gradzip.compressors.base import Compressor, Job, StepContext
from gradzip.control.level_order import check_level_order
from gradzip.control.records import MODEL, force_critical, key_levels, record, set_levels
from gradzip.control.rule import CRITICAL, STEADY, is_lr_drop
from gradzip.control.state_values import schedule_problem
from gradzip.control.switch import TwoLevel, build_levels
from gradzip.spec import (
    format_call,
    format_ranges,
    level_schedule_parts,
    parse_level_schedule,
    register_controller,
)

__all__ = ["Schedule"]


def _ranges(name: str, value: Any, convert: Any) -> tuple[tuple[Any, Any], ...]:
    """Validate ``[(start, end), ...]``: half-open, non-empty, sorted, disjoint."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"`{name}` must be a sequence of (start, end) pairs, got {value!r}")
    out: list[tuple[Any, Any]] = []
    for item in value:
        if not isinstance(item, Sequence) or len(item) != 2:
            raise TypeError(f"`{name}` must hold (start, end) pairs, got {item!r}")
        start, end = convert(item[0]), convert(item[1])
        if start < 0 or end <= start:
            raise ValueError(f"`{name}` ranges must satisfy 0 <= start < end, got {tuple(item)!r}")
        if out and start < out[-1][1]:
            raise ValueError(f"`{name}` ranges must be sorted and disjoint, got {tuple(item)!r} "
                             f"after {out[-1]!r}")
        out.append((start, end))
    return tuple(out)


def _step(value: Any) -> int:
    return check_int("gentle_steps", value, minimum=0)


def _epoch(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"`gentle_epochs` bounds must be numbers, got {value!r}")
    if not math.isfinite(value):  # NaN compares false with every bound and slips through
        raise ValueError(f"`gentle_epochs` bounds must be finite numbers, got {value!r}")
    return float(value)


@register_controller
@dataclass(frozen=True)
class Schedule(TwoLevel):
    """A fixed timing of levels: ``gentle`` during the given step ranges, ``aggressive``
    elsewhere, the same for every tensor on every worker.

    Ranges are half-open ``[start, end)`` in optimizer steps (``gentle_steps``), or in epochs
    (``gentle_epochs`` with ``steps_per_epoch``; bounds are rounded to steps). Optionally, a
    learning-rate drop (the rule Accordion uses: the rate falls below 0.9x the previous
    step's) makes every tensor gentle for ``after_drop`` steps. Steps are counted like
    Accordion's (optimizer steps completed; skipped steps do not count), so a resumed run
    continues the schedule where it stopped.

    Args:
        gentle: the level inside the ranges (a compressor or spec, or ``"none"``).
        aggressive: the level elsewhere, the same kind of compressor as ``gentle`` unless
            ``gentle`` is ``none``.
        gentle_steps: ``[(start, end), ...]`` in steps, sorted and disjoint.
        gentle_epochs: the same in epochs (needs ``steps_per_epoch``; exclusive with
            ``gentle_steps``).
        steps_per_epoch: optimizer steps per epoch (>= 1), for ``gentle_epochs``.
        after_drop: steps kept gentle after each learning-rate drop (>= 0; 0: ignore drops).

    Raises:
        TypeError, ValueError: invalid levels or ranges, naming the parameter.

    Examples:
        >>> Schedule.warmup("powersgd:rank=2", steps=1000)            # dense, then rank 2
        >>> Schedule("powersgd:rank=4", "powersgd:rank=1", gentle_epochs=[(0, 5), (15, 18)],
        ...          steps_per_epoch=391)
    """

    gentle: Compressor | str
    aggressive: Compressor | str
    gentle_steps: Sequence[tuple[int, int]] = ()
    gentle_epochs: Sequence[tuple[float, float]] | None = None
    steps_per_epoch: int | None = None
    after_drop: int = 0
    spec_name: ClassVar[str] = "schedule"
    spec_kinds: ClassVar[dict[str, str]] = {
        "gentle": "level", "aggressive": "level", "gentle_steps": "ranges", "after_drop": "int"}

    def __post_init__(self) -> None:
        aggressive, gentle = build_levels("Schedule", self.aggressive, self.gentle,
                                          names=("aggressive", "gentle"))
        object.__setattr__(self, "gentle", gentle)
        object.__setattr__(self, "aggressive", aggressive)
        check_level_order(aggressive, gentle)
        steps = _ranges("gentle_steps", self.gentle_steps, _step)
        if self.gentle_epochs is not None:
            if steps:
                raise ValueError("`gentle_steps` must be empty when `gentle_epochs` is given, "
                                 f"got {self.gentle_epochs!r} and {steps!r}")
            if self.steps_per_epoch is None:
                raise ValueError("`steps_per_epoch` must be given with `gentle_epochs`, got None")
            per = check_int("steps_per_epoch", self.steps_per_epoch, minimum=1)
            epochs = _ranges("gentle_epochs", self.gentle_epochs, _epoch)
            rounded = [(round(a * per), round(b * per)) for a, b in epochs]
            for (a, b), (first, end) in zip(epochs, rounded, strict=True):
                # A range shorter than a step would be dropped and the schedule would do
                # nothing there, silently: the user asked for a gentle stretch.
                if end <= first:
                    raise ValueError(
                        f"`gentle_epochs` range {a:g}-{b:g} must cover at least one step, but "
                        f"at {per} steps per epoch it rounds to steps {first}-{end} (none)")
            steps = _ranges("gentle_epochs", rounded, _step)
        object.__setattr__(self, "gentle_steps", steps)
        # The epochs are converted once: the steps alone define the schedule (and its spec).
        object.__setattr__(self, "gentle_epochs", None)
        object.__setattr__(self, "steps_per_epoch", None)
        object.__setattr__(self, "after_drop", check_int("after_drop", self.after_drop, minimum=0))
        object.__setattr__(self, "biased", bool(gentle.biased or aggressive.biased))

    @property
    def level_compressors(self) -> tuple[Compressor, Compressor]:
        """``(aggressive, gentle)``: the steady and critical levels of the shared state."""
        return self.aggressive, self.gentle  # type: ignore[return-value]

    @property
    def steady(self) -> Compressor:  # type: ignore[override]
        return self.aggressive  # type: ignore[return-value]

    @property
    def critical(self) -> Compressor:  # type: ignore[override]
        return self.gentle  # type: ignore[return-value]

    @classmethod
    def warmup(cls, compressor: Compressor | str, steps: int, gentle: Compressor | str = "none") -> Schedule:
        """``gentle`` (dense by default) for the first ``steps`` steps, then ``compressor``.

        Raises:
            ValueError: ``steps < 1``.
        """
        steps = check_int("steps", steps, minimum=1)
        return cls(gentle, compressor, gentle_steps=[(0, steps)])

    @classmethod
    def from_text(cls, text: str, aggressive: Compressor | str, *, steps_per_epoch: int,
                  gentle: Compressor | str = "none") -> Schedule:
        """The schedule of a level-schedule text in epochs (the CLI's ``--level-schedule``,
        parsed by :func:`~gradzip.spec.parse_level_schedule`): ``gentle`` in its gentle
        ranges, ``aggressive`` elsewhere.

        Examples:
            >>> Schedule.from_text("gentle:0-5,aggressive:5-30", "powersgd:rank=1",
            ...                    gentle="powersgd:rank=4", steps_per_epoch=391)

        Raises:
            ValueError: malformed text, or invalid levels or ranges.
        """
        per = check_int("steps_per_epoch", steps_per_epoch, minimum=1)
        for kind, a, b in level_schedule_parts(text):
            # An aggressive part shorter than a step would vanish between its neighbours: the
            # text would promise a stretch the schedule never runs.
            if kind == "aggressive" and round(b * per) <= round(a * per):
                raise ValueError(
                    f"`level_schedule` part aggressive:{a:g}-{b:g} must cover at least one "
                    f"step, but at {per} steps per epoch it rounds to steps "
                    f"{round(a * per)}-{round(b * per)} (none)")
        return cls(gentle, aggressive, gentle_epochs=parse_level_schedule(text),
                   steps_per_epoch=steps_per_epoch)

    # -- identity --------------------------------------------------------------------------
    def spec(self) -> str:
        """``schedule(gentle=...,aggressive=...,gentle_steps=0-500;900-1000,after_drop=0)``."""
        return format_call(self.spec_name, {
            "gentle": self.gentle.spec(), "aggressive": self.aggressive.spec(),
            "gentle_steps": format_ranges(self.gentle_steps), "after_drop": self.after_drop})

    # -- the schedule ----------------------------------------------------------------------
    def gentle_at(self, step: int) -> bool:
        """Whether the schedule's ranges put ``step`` at the gentle level."""
        return any(a <= step < b for a, b in self.gentle_steps)

    def init_state(self, shapes: Mapping[str, torch.Size]) -> dict[str, Any]:
        level = CRITICAL if self.gentle_at(0) else STEADY
        first = [record(0, 0, MODEL, None, None, None, level, "schedule")]
        return self._pair_state(shapes, first, level, per_layer=False, interval=0,
                                drop_until=0, drop_step=None)

    def check_state(self, state: Mapping[str, Any], *, fresh: Mapping[str, Any],
                    shapes: Mapping[str, torch.Size], workers: int) -> str | None:
        """Level names and counters, then each level's own state (see
        ``Compressor.check_state``)."""
        return schedule_problem(state["controller"], fresh["controller"]) or self._levels_problem(
            state, fresh, shapes, workers)

    def _follow(self, ctrl: dict[str, Any], ctx: StepContext | None) -> None:
        """Set the level of step ``ctrl["step"]`` from the ranges and any drop's hold."""
        step = ctrl["step"]
        want = CRITICAL if (self.gentle_at(step) or step < ctrl["drop_until"]) else STEADY
        if key_levels(ctrl).get(MODEL, want) == want or not set(ctrl["level"]) - set(ctrl["fixed"]):
            return
        ctrl["interval"] += 1
        set_levels(ctrl, {MODEL: want},
                   [record(step, ctrl["interval"], MODEL, None, None, None, want, "schedule")], ctx)

    def reduce(self, jobs: Sequence[Job], state: dict[str, Any], comm: Collective,
               ctx: StepContext) -> None:
        ctrl = state["controller"]
        # last_lr changes only in end_step: every call of a step sees the same drop; the
        # drop step makes it act once.
        if (self.after_drop and ctrl["drop_step"] != ctrl["step"]
                and is_lr_drop(ctrl["last_lr"], ctx.lr)):
            ctrl["drop_step"] = ctrl["step"]
            ctrl["drop_until"] = ctrl["step"] + self.after_drop
            if key_levels(ctrl).get(MODEL) != CRITICAL:
                force_critical(ctrl, ctx.step)
        self._run_levels(jobs, state, comm, ctx)

    def end_step(self, state: dict[str, Any], ctx: StepContext) -> None:
        self._end_levels(state, ctx)
        self._follow(state["controller"], ctx)
