"""The engine's compression-error meter: how much of each compressed tensor stays unsent.

One :class:`ErrorMeter` per :class:`~gradzip.Engine`. For every step and
every tensor that keeps a residual (error feedback on, tensor not routed dense), the
compressor's input is ``x = gradient + residual`` and what it leaves unsent is the new
residual ``e`` (recorded through :meth:`~gradzip.compressors.base.Job.keep`). The meter sums
``||e||^2`` and ``||x||^2`` over the steps and tensors since it was last read, and over this
process's workers (every worker of a simulated group, the one worker of a process). The
**relative compression error** of that span is ``sqrt(sum ||e||^2 / sum ||x||^2)``.

Choices, documented in IMPLEMENTING.md:

* Tensors routed dense (``dense_1d``, ``min_numel``, a dense rule) never reach a compressor:
  they are left out (not counted with ``e = 0``), so the ratio describes compression only.
* Where no tensor keeps a residual, the error is ``0.0`` when every compressor in use is
  exact (``none``), else unknown (``None``: fp16, QSGD, error feedback off).
* Steps handled by the non-finite policy (counted in ``stats["skipped_steps"]``) are left
  out whole.
* With a two-level controller (Accordion, level schedules) the same ratio is also kept per
  level: ``gentle`` (the tensors reduced at the critical level) and ``aggressive`` (the
  steady level); tensors that both levels send dense (level ``"dense"``) count in the
  overall ratio only.

Cost: two norms per tensor per call (one multi-tensor op), their squares summed once per step
on the device where the data is; nothing is read
on the host until :meth:`compression_error` (once per epoch in the training loop), so no call
waits for the device. The sums are not part of ``state_dict()``: the training loop reads
(and so resets) them before each checkpoint, and a resumed run records the same values.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch

from gradzip._validate import check_bool
from gradzip.compressors.base import Job

__all__ = ["ERROR_KEYS", "ErrorMeter", "relative_error"]

#: The keys :meth:`ErrorMeter.compression_error` returns (per-level ones with a controller).
ERROR_KEYS = ("compression_error", "compression_error_gentle", "compression_error_aggressive")

# A controller's level name -> the meter's group (what ``Compressor.tensor_levels`` reports).
_GROUPS = {"critical": 1, "steady": 2}


def relative_error(error_sq: float, input_sq: float) -> float:
    """``sqrt(error_sq / input_sq)``; ``0.0`` when the input is zero (nothing to lose)."""
    return math.sqrt(error_sq / input_sq) if input_sq > 0 else 0.0


#: A step's pending norms of one group: (residual norms, input norms), 0-d fp32 tensors.
Pending = tuple[list[torch.Tensor], list[torch.Tensor]]


def _group(pending: list[Pending | None], i: int) -> Pending:
    """The step's norms of group ``i`` (made empty on first use)."""
    group = pending[i]
    if group is None:
        group = pending[i] = ([], [])
    return group


def _sums(pending: Pending) -> torch.Tensor:
    """``[2]`` float64: ``sum ||residual||^2`` and ``sum ||input||^2`` of a step's norms."""
    left, whole = pending
    return torch.stack(left + whole).to(torch.float64).square().view(2, -1).sum(1)


class ErrorMeter:
    """The compression-error sums of one engine (see the module docstring).

    The sums of the step in progress live on the engine's
    :class:`~gradzip.engine.step.Step` (``error_sums``) and move here when the step commits.

    Args:
        feedback: the tensors that keep a residual (the only ones measured).
        exact: whether every compressor in use sends tensors unchanged (``none``).
    """

    def __init__(self, feedback: frozenset[str], *, exact: bool) -> None:
        self.feedback = feedback
        self.exact = exact
        #: Per group (all, gentle, aggressive): ``[2]`` float64 sums of completed steps since
        #: the last read (``None`` where nothing was added).
        self.totals: list[torch.Tensor | None] = [None, None, None]

    def add(
        self, pending: list[Pending | None], jobs: Sequence[Job],
        levels: Callable[[], Mapping[str, str] | None],
    ) -> None:
        """Add the norms of a call's jobs that keep a residual to the step's ``pending``
        norms per group (in place; one multi-tensor norm per call, a launch on CUDA; the
        squares are summed once, when the step commits).

        Args:
            pending: the step's norms per group (all, gentle, aggressive).
            jobs: the call's compressed jobs, reduced.
            levels: the main compressor's ``tensor_levels`` of its state now (after
                ``reduce``, before ``end_step``: the levels the jobs were reduced at).
        """
        jobs = [j for j in jobs if j.name in self.feedback]
        if not jobs:
            return
        norms = torch._foreach_norm([j.leftover() for j in jobs] + [j.tensor for j in jobs])
        count = len(jobs)
        self.add_norms(pending, [j.name for j in jobs], norms[:count], norms[count:], levels)

    def add_norms(
        self, pending: list[Pending | None], names: Sequence[str],
        left: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
        levels: Callable[[], Mapping[str, str] | None],
    ) -> None:
        """:meth:`add` with the norms already taken: ``left[i]`` and ``inputs[i]`` are the
        residual's and the compressor input's norms of tensor ``names[i]`` (each a tensor
        that keeps a residual), in the call's order."""
        everything = _group(pending, 0)  # every tensor, in order: no index per tensor
        everything[0].extend(left)
        everything[1].extend(inputs)
        found = levels()
        if found is None:
            return
        members: dict[int, list[int]] = {}
        for at, name in enumerate(names):
            where = _GROUPS.get(found.get(name, ""))
            if where is not None:
                members.setdefault(where, []).append(at)
        for i, chosen in members.items():
            group = _group(pending, i)
            group[0].extend(left[at] for at in chosen)
            group[1].extend(inputs[at] for at in chosen)

    def commit(self, pending: list[Pending | None], dropped: torch.Tensor | None = None) -> None:
        """Add a step's norms to the totals (``dropped``: a 0-d bool tensor deciding on the
        device that the non-finite policy handled the step, so it counts zero)."""
        for i, norms in enumerate(pending):
            if norms is None:
                continue
            part = _sums(norms)
            if dropped is not None:
                part = part.masked_fill(dropped, 0.0)
            total = self.totals[i]
            self.totals[i] = part if total is None else total + part

    def read(
        self, *, per_level: bool, reset: bool = True,
        pool: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> dict[str, float | None]:
        """The relative compression error since the last reset (see the module docstring).

        Args:
            per_level: whether the main compressor is a two-level controller (its ratios
                per level are then returned too).
            reset: start a new span after reading (the training loop reads once per epoch).
            pool: where each process holds its own workers, a function that sums a float64
                tensor over every process (an all-reduce, e.g. ``torch.distributed``'s
                ``all_reduce`` wrapped to return its input): the ratios are then over every
                worker of the group, and every process must call this alike. ``None``: over
                this process's workers (every worker of a simulated group).

        Returns:
            ``compression_error``: ``sqrt(sum ||e||^2 / sum ||x||^2)``, or ``0.0`` where
            every compressor is exact and no tensor keeps a residual, or ``None`` where it
            cannot be known (no residual kept by a lossy compressor, or no step in the
            span); with a two-level controller also ``compression_error_gentle`` and
            ``compression_error_aggressive`` (``None`` for a level no tensor took in the
            span). One host read of the device sums.

        Raises:
            TypeError: ``reset`` is not a bool, or ``pool`` is not callable.
        """
        check_bool("reset", reset)
        if pool is not None and not callable(pool):
            raise TypeError(f"`pool` must be a callable or None, got {type(pool).__name__}")
        totals = self.totals
        if reset:
            self.totals = [None, None, None]
        # Which groups hold sums is the same on every process (same tensors, steps and
        # levels), so only those travel, in a fixed order.
        known = [i for i, t in enumerate(totals) if t is not None]
        values: list[list[float] | None] = [None, None, None]
        if known:
            flat = torch.cat([t.to(torch.float64).cpu() for t in totals if t is not None])
            if pool is not None:
                flat = pool(flat)
            got = [float(v) for v in flat.tolist()]
            for n, i in enumerate(known):
                values[i] = got[2 * n:2 * n + 2]
        out: dict[str, float | None] = {}
        first = values[0]
        if first is not None:
            out[ERROR_KEYS[0]] = relative_error(*first)
        else:
            exact = not self.feedback and self.exact
            out[ERROR_KEYS[0]] = 0.0 if exact else None
        if per_level:
            for key, value in zip(ERROR_KEYS[1:], values[1:], strict=True):
                out[key] = None if value is None else relative_error(*value)
        return out
