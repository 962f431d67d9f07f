"""The non-finite policy, in its two forms: decided on the host, or kept on the device.

Every worker learns together that a call was non-finite (a gradient plus its residual holds
NaN or Inf, or compression overflowed: the average or a compressor's state turned
non-finite), and applies the engine's ``nonfinite`` option alike:

* ``"skip"``: the whole step is rolled back, and this call and every later call of the step
  return NaN (so the optimizer step is skipped);
* ``"zero"``: this call is dropped (its tensors' state as before the call, zeros returned);
  earlier and later calls of the step stand;
* ``"raise"``: ``FloatingPointError`` and the step is abandoned.

The **host form** (:meth:`NonfinitePolicy.on_host`) acts on a decision read on the host. The
**device form** (:meth:`~NonfinitePolicy.on_device`, :meth:`~NonfinitePolicy.finish_on_device`)
acts on a 0-d bool tensor without reading it, by ``torch.where``: bit for bit what the host
form gives (see :mod:`gradzip.engine.device` for where it applies). :meth:`~NonfinitePolicy.settle`
turns device decisions into host ones when a later call of the step decides on the host.
"""

from __future__ import annotations

import logging
import operator

import torch

from gradzip.compressors.base import Job, leftovers
from gradzip.engine.base import EngineBase
from gradzip.engine.call import Call, end_compressors_step, filled
from gradzip.engine.deferred import memory_runs, where_many, where_tree
from gradzip.engine.step import ResidualRow, Saved, Step, or_flag
from gradzip.ops.flat import pack, unpack_like

__all__ = ["NonfinitePolicy"]

log = logging.getLogger("gradzip.engine")


class NonfinitePolicy:
    """One engine's non-finite policy.

    Args:
        name: ``"skip"``, ``"zero"`` or ``"raise"`` (validated by
            :class:`~gradzip.EngineOptions`).
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def restore_point(self, engine: EngineBase, step: Step) -> Saved:
        """What a non-finite call goes back to: for ``"zero"`` the state before this call;
        otherwise the step's start (leaves unchanged since then need no second finiteness
        test)."""
        return engine._save() if self.name == "zero" else step.started_at()

    # -- the host form ---------------------------------------------------------------------
    def on_host(
        self, engine: EngineBase, step: Step, call: Call, before: Saved, what: str
    ) -> dict[str, torch.Tensor]:
        """Apply the policy to a call decided non-finite on the host (every worker reaches
        it together); returns the call's results (NaN for ``"skip"``, zeros for ``"zero"``).

        Raises:
            FloatingPointError: with ``"raise"``.
        """
        names = call.names
        shown = f"{names[:5]}{'...' if len(names) > 5 else ''}"
        if self.name == "raise":
            raise FloatingPointError(
                f"{what} at step {engine.step} (on at least one worker; a gradient plus its "
                f"residual that overflows counts as non-finite); tensors in this call: {shown}"
            )
        log.warning("%s at step %d (tensors %s): handled by nonfinite=%r",
                    what, engine.step, shown, self.name)
        step.handled = True
        if self.name == "skip":
            engine._restore(step.started_at())
            step.poisoned = True
            return filled(engine, call, float("nan"))
        engine._restore(before)
        if call.finish_step and end_compressors_step(engine, before.states) is not None:
            engine._set_states(before.copy().states)  # the end of step itself overflows
        return filled(engine, call, 0.0)

    def settle(self, engine: EngineBase, step: Step) -> None:
        """Bring the step's device decisions to the host (a host read), as if every earlier
        call of the step had decided on the host."""
        poison, handled = step.poison_dev, step.handled_dev
        step.poison_dev = step.handled_dev = None
        if handled is not None and bool(handled):
            step.handled = True
        if poison is not None and bool(poison):
            engine._restore(step.started_at())
            step.poisoned = step.handled = True

    # -- the device form -------------------------------------------------------------------
    def on_device(
        self, engine: EngineBase, step: Step, jobs: list[Job], before: Saved, flag: torch.Tensor
    ) -> tuple[torch.Tensor, float]:
        """Keep a call's residuals and apply the policy to the call whose non-finite flag
        ``flag`` (0-d bool) stays on the device; returns ``(mask, fill)``: where ``mask``
        holds, the call's results are ``fill``.

        ``"skip"`` masks this and every later call of the step with NaN (the state rolls back
        at the step's end, :meth:`finish_on_device`); ``"zero"`` masks the call with zeros
        and restores its own residuals and state at once.
        """
        kept = engine.error_feedback and jobs
        names = [j.name for j in jobs] if kept else []
        return self.keep_on_device(engine, step, names, leftovers(jobs) if kept else [],
                                   before, flag)

    def keep_on_device(
        self, engine: EngineBase, step: Step, names: list[str], rests: list[torch.Tensor],
        before: Saved, flag: torch.Tensor, *, one_buffer: bool = False,
    ) -> tuple[torch.Tensor, float]:
        """:meth:`on_device` given the call's residuals: ``rests[i]`` of tensor ``names[i]``
        (none where the call keeps none); ``one_buffer``: the caller made them as views that
        tile one buffer, in order (nothing to look up)."""
        zero = self.name == "zero"
        if names:
            # The call's residuals in few buffers (the compressor's own where it made them
            # so, else one copy, see gradzip.ops.flat.pack): "zero" restores them by one
            # ``where`` per buffer now, "skip" by one per buffer at the step's end (see
            # where_many). Why two buffers are left as they are: a copy into one costs a
            # launch and a view per tensor, where the second ``where`` costs one launch.
            # (Runs of adjacent memory, found by addresses: asking each tensor for its
            # storage costs a Python object per tensor.)
            if not one_buffer and memory_runs(rests, _BUFFERS) is None:
                rests = unpack_like(pack(rests), rests)
            if zero:
                rests = where_many(flag, [before.residuals[n] for n in names], rests)
            engine.residuals.update(zip(names, rests, strict=True))
        if zero:
            engine.compressor_state = where_tree(flag, before.states[0], engine.compressor_state)
            step.handled_dev = or_flag(step.handled_dev, flag)
            return flag, 0.0
        step.poison_dev = or_flag(step.poison_dev, flag)
        return step.poison_dev, float("nan")

    def finish_on_device(
        self, engine: EngineBase, step: Step, start: object, end_bad: torch.Tensor | None,
        device: torch.device,
    ) -> torch.Tensor:
        """Apply the policy at the end of a step decided on the device (``start``: the
        compressor's state before its end of step; ``end_bad``: whether the end of step
        turned it non-finite, ``None`` where it changed no tensor); returns whether the
        policy handled the step (0-d bool on ``device``)."""
        if self.name == "zero":
            if end_bad is not None:
                engine.compressor_state = where_tree(end_bad, start, engine.compressor_state)
            return _raised(step.handled_dev, end_bad, device)
        poison = _raised(step.poison_dev, end_bad, device)
        snap = step.started_at()
        if any(n not in snap.residuals for n in engine.residuals):
            # A residual made this step by a call that decided on the host has nothing to go
            # back to on the device: decide on the host (first steps only).
            if bool(poison):
                engine._restore(snap)
        else:
            engine.compressor_state = where_tree(poison, snap.states[0], engine.compressor_state)
            engine.residuals = _rolled_back(poison, snap.residuals, engine.residuals, step.rows)
        return poison


#: A call's residuals spread over more buffers than this are copied into one (see
#: :meth:`NonfinitePolicy.on_device`).
_BUFFERS = 2


def _rolled_back(
    flag: torch.Tensor, before: dict[str, torch.Tensor], after: dict[str, torch.Tensor],
    rows: list[ResidualRow],
) -> dict[str, torch.Tensor]:
    """``before``'s residuals where ``flag`` holds, else ``after``'s (those that changed in
    the step decided together, see :func:`~gradzip.engine.deferred.where_many`); the rows of
    the segment path (``rows``) whose views are still the residuals on both sides, by one
    ``where`` each."""
    done: set[str] = set()
    for row in rows:
        names = row.names
        if (all(map(operator.is_, [after[n] for n in names], row.after))
                and all(map(operator.is_, [before.get(n) for n in names], row.before))):
            # In place, as below: the row is the engine's own, made in this step.
            torch.where(flag, row.before_row, row.after_row, out=row.after_row)
            done.update(names)
    changed = [n for n, rest in after.items() if rest is not before[n] and n not in done]
    if not changed:
        return dict(after)
    # In place: the residuals the step made are the engine's own, replaced by the result.
    kept = where_many(flag, [before[n] for n in changed], [after[n] for n in changed],
                      in_place=True)
    return {**after, **dict(zip(changed, kept, strict=True))}


def _raised(
    flag: torch.Tensor | None, more: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """``flag | more`` as a 0-d bool on ``device``, where ``None`` is a flag not raised."""
    if more is not None:
        return or_flag(flag, more)
    return torch.zeros((), dtype=torch.bool, device=device) if flag is None else flag
