"""The step in progress as one object: its snapshot, its calls, its non-finite flags.

A step is a transaction over the engine's compression state (every compressor's state and
every residual). Its first call *begins* it (a snapshot of that state); the call that
finishes it *commits* it; an exception inside it *rolls it back* to the snapshot. In
between, a step of several calls (a DDP bucket per call) carries what its earlier calls
decided: everything of that kind lives on :class:`Step`, and nothing else in the engine
outlives a step but the state itself and the counters.

Everything here is plain data; what a decision does to the engine's state is done by the
engine (:mod:`gradzip.engine.core`) and the non-finite policy (:mod:`gradzip.engine.policy`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gradzip.statecheck import snapshot_tree

__all__ = ["ResidualRow", "Saved", "SkipCount", "Step", "or_flag"]


@dataclass
class Saved:
    """Every compressor's state and every residual at one moment.

    The trees' dicts are copied and their tensors (and lists) shared: state is replaced,
    never mutated in place, so a shared tensor never changes under a copy (see
    :func:`~gradzip.statecheck.snapshot_tree`).

    Attributes:
        states: every compressor's state, the main one first (see
            :meth:`~gradzip.engine.base.EngineBase.states`).
        residuals: ``name -> residual``.
    """

    states: list[Any]
    residuals: dict[str, torch.Tensor]

    @classmethod
    def take(cls, states: list[Any], residuals: dict[str, torch.Tensor]) -> Saved:
        """A copy of ``states`` and ``residuals`` that later replacements leave unchanged."""
        return cls([snapshot_tree(state) for state in states], dict(residuals))

    def copy(self) -> Saved:
        """A copy to restore from (the engine writes into what it restores)."""
        return Saved.take(self.states, self.residuals)


def or_flag(flag: torch.Tensor | None, more: torch.Tensor) -> torch.Tensor:
    """``flag | more`` for 0-d bool tensors, where ``None`` is a flag not raised yet."""
    return more if flag is None else flag | more


@dataclass(frozen=True)
class ResidualRow:
    """The residuals one call of the segment path made: views of one row, in the order of
    ``names``, and those they replaced (views of the previous row).

    Attributes:
        names: the tensors.
        before, after: their residuals before and after the call, in ``names``' order.
        before_row, after_row: the rows those views tile.
    """

    names: list[str]
    before: list[torch.Tensor]
    after: list[torch.Tensor]
    before_row: torch.Tensor
    after_row: torch.Tensor


class Step:
    """The state of the step in progress (fresh between steps).

    Attributes:
        snapshot: the compression state where the step began (``None``: no step begun).
        call: the calls completed so far in this step.
        poisoned: ``"skip"`` decided on the host that the step is non-finite: every later
            call of the step returns NaN and sends its header only.
        handled: the non-finite policy handled a call of this step on the host (the step
            counts in ``skipped_steps``).
        poison_dev, handled_dev: the same two decisions kept on the device (0-d bool
            tensors, ``None`` while no call decided on the device), see
            :mod:`gradzip.engine.device`.
        desync_dev: on the device, whether a call's header found ranks out of step (read
            once, at the step's end).
        error_sums: the compression-error meter's pending norms of this step, per group
            (all, gentle, aggressive), summed when the step commits (see
            :mod:`gradzip.engine.error`).
        rows: the residual rows the segment path made in this step, each with the row it
            replaced (see :class:`ResidualRow`): the device rollback decides each with one
            ``where``.
    """

    def __init__(self) -> None:
        self._clear()

    def _clear(self) -> None:
        self.snapshot: Saved | None = None
        self.call = 0
        self.poisoned = False
        self.handled = False
        self.poison_dev: torch.Tensor | None = None
        self.handled_dev: torch.Tensor | None = None
        self.desync_dev: torch.Tensor | None = None
        self.error_sums: list[Any] = [None, None, None]
        self.rows: list[ResidualRow] = []

    @property
    def begun(self) -> bool:
        """Whether a step is in progress (a call of it has started)."""
        return self.snapshot is not None

    @property
    def decided_on_device(self) -> bool:
        """Whether an earlier call of the step kept a non-finite decision on the device (a
        later call that decides on the host must first settle it)."""
        return self.poison_dev is not None or self.handled_dev is not None

    def begin(self, saved: Saved) -> None:
        """Begin the step at ``saved`` (the state before its first call)."""
        assert self.snapshot is None, "a step is already in progress"
        self.snapshot = saved

    def complete_call(self) -> None:
        """Count a call of the step that completed."""
        self.call += 1

    def commit(self) -> None:
        """End the step: its effects stand; every flag is forgotten."""
        self._clear()

    def roll_back(self) -> Saved | None:
        """Abandon the step: every flag is forgotten; returns the state to restore (``None``
        when no step was begun)."""
        saved = self.snapshot
        self._clear()
        return saved

    def started_at(self) -> Saved:
        """The snapshot of the step in progress."""
        assert self.snapshot is not None, "no step in progress"
        return self.snapshot


class SkipCount:
    """``skipped_steps``: an int on the host plus a count still on the device (steps whose
    decision stayed there), added when someone reads it.

    Args:
        value: the starting count.
    """

    def __init__(self, value: int = 0) -> None:
        self.host = int(value)
        #: Skipped steps decided on the device and not yet read (an int64 0-d tensor).
        self.pending: torch.Tensor | None = None

    def read(self) -> int:
        """The count (a host read where some of it is still on the device)."""
        if self.pending is not None:
            self.host += int(self.pending)
            self.pending = None
        return self.host

    def add(self, count: int) -> None:
        """Add steps skipped on the host."""
        self.host = self.read() + count

    def add_on_device(self, count: torch.Tensor) -> None:
        """Add a 0-d count (int64, or bool for one step) without reading it."""
        if self.pending is None:
            self.pending = count.to(torch.int64)
        else:
            self.pending = self.pending + count  # int64 + bool stays int64: one op
