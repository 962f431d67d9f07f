"""What Accordion and level schedules share: two compression levels and the switch between them.

A two-level controller is a compressor whose state holds both levels' states side by side and a
controller sub-state of plain data::

    {"steady": <aggressive level's state>, "critical": <gentle level's state>,
     "controller": {"step", "level", "fixed", "last_lr", "log", "counts", ...}}

``level`` maps every tensor to ``"critical"`` (the gentle level) or ``"steady"`` (the
aggressive one). Tensors that both levels send dense (``fixed``; e.g. biases under PowerSGD, or
any 1-D tensor when the gentle level is ``none``) are reduced with the gentle level but take no
decisions and are counted apart (``dense_steps``): calling them "gentle" would inflate the share
of gentle tensors without changing a byte.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch

from gradzip.comm.base import Collective
from gradzip.compressors.base import Compressor, Job, SegmentPlan, StepContext
from gradzip.compressors.none import NoCompression
from gradzip.compressors.powersgd import PowerSGD, reduce_row, reduce_together, row_plan
from gradzip.control.records import controller
from gradzip.control.rule import CRITICAL, STEADY
from gradzip.spec import compressor_from_spec, controller_from_spec

__all__ = ["DENSE", "TwoLevel", "build_levels", "sends_dense"]

#: The level reported for tensors that both levels send dense.
DENSE = "dense"


def sends_dense(compressor: Compressor, shape: torch.Size) -> bool:
    """Whether ``compressor`` always sends a tensor of ``shape`` dense (whatever the world size).

    Known for ``none`` and for PowerSGD (tensors below two dimensions or not worth a low-rank
    approximation); ``False`` for compressors whose choice depends on the data or the world.
    """
    if isinstance(compressor, NoCompression):
        return True
    rank_for = getattr(compressor, "matrix_rank_for", None)
    return bool(callable(rank_for) and rank_for(torch.Size(shape)) == 0)


def build_levels(owner: str, steady: Compressor | str, critical: Compressor | str,
                 names: tuple[str, str] = ("steady", "critical")) -> tuple[Compressor, Compressor]:
    """Validate and build a level pair.

    Args:
        owner: the controller's spec name (for messages).
        steady, critical: the aggressive and gentle levels (compressors or spec strings).
        names: the parameter names used in messages.

    Raises:
        TypeError: a level that is not a compressor or spec string, or is itself a controller.
        ValueError: levels of different kinds (the gentle one may always be ``none``).
    """
    built = []
    for name, value in zip(names, (steady, critical), strict=True):
        if not isinstance(value, (Compressor, str)):
            raise TypeError(
                f"`{name}` must be a Compressor or a spec string such as 'powersgd:rank=1', "
                f"got {type(value).__name__}"
            )
        try:
            level = compressor_from_spec(value)
        except (TypeError, ValueError) as exc:
            # A level's own message names its parameter, not which level it came from.
            raise type(exc)(f"`{name}` of {owner} ({value!r}): {exc}") from None
        if isinstance(level, TwoLevel):
            raise TypeError(f"`{name}` must be a plain compressor, not a {owner}, got {level.spec()!r}")
        built.append(level)
    low, high = built
    if type(high) is not type(low) and not isinstance(high, NoCompression):
        raise ValueError(
            f"`{names[1]}` must be the same kind of compressor as `{names[0]}` "
            f"({low.spec_name}) or 'none', got {high.spec()!r}"
        )
    return low, high


class TwoLevel(Compressor):
    """Base of controllers that switch tensors between a steady and a critical level.

    Subclasses are frozen dataclasses with ``steady`` and ``critical`` fields holding
    compressors; they decide levels, this class runs them.
    """

    steady: Compressor | str
    critical: Compressor | str
    #: ``key -> kind`` of the spec's parameters (see :data:`gradzip.spec.KINDS`).
    spec_kinds: ClassVar[dict[str, str]] = {}

    @classmethod
    def parse(cls, spec: str) -> Any:
        """Rebuild from :meth:`spec` output (what :func:`gradzip.compressor_from_spec` does
        for this controller's specs).

        Raises:
            ValueError: not of this controller's form, or a missing, unknown or invalid
                parameter.
        """
        return controller_from_spec(cls, spec)

    @property
    def level_compressors(self) -> tuple[Compressor, Compressor]:
        """``(steady, critical)``: the compressors of the aggressive and the gentle level."""
        return cast(Compressor, self.steady), cast(Compressor, self.critical)

    def fixed_names(self, shapes: Mapping[str, torch.Size]) -> list[str]:
        """The tensors both levels send dense (they take no decision), sorted."""
        steady, critical = self.level_compressors
        return sorted(n for n, s in shapes.items()
                      if sends_dense(steady, s) and sends_dense(critical, s))

    def _pair_state(self, shapes: Mapping[str, torch.Size], first: list[dict[str, Any]],
                    level: str, **extra: Any) -> dict[str, Any]:
        """The shared state: both levels' states and a controller sub-state.

        Args:
            shapes: the tensors the controller sees.
            first: the records of the start (decision point 0).
            level: every deciding tensor's level at the start.
            extra: further controller entries of the subclass.
        """
        steady, critical = self.level_compressors
        fixed = self.fixed_names(shapes)
        reasons = {"first": 0, "lr_drop": 0, "norm_change": 0, "steady": 0, "schedule": 0}
        for r in first:
            reasons[r["reason"]] += 1
        return {
            "steady": steady.init_state(shapes),
            "critical": critical.init_state(shapes),
            "controller": {
                "step": 0,  # optimizer steps completed (skipped steps are not counted)
                "level": {n: (DENSE if n in fixed else level) for n in shapes},
                "fixed": fixed,
                "last_lr": None,
                "log": first,
                "counts": {
                    "decisions": 1,
                    "critical": sum(r["level"] == CRITICAL for r in first),
                    "steady": sum(r["level"] == STEADY for r in first),
                    "switches": 0,
                    "critical_steps": 0,
                    "steady_steps": 0,
                    "dense_steps": 0,
                    "reasons": reasons,
                },
                **extra,
            },
        }

    def init_group_state(
        self, shapes: Mapping[str, torch.Size], world_size: int, local_workers: int
    ) -> dict[str, Any]:
        """:meth:`init_state`, each level's state made for the group (see
        ``Compressor.init_group_state``)."""
        state = self.init_state(shapes)
        for level, key in zip(self.level_compressors, (STEADY, CRITICAL), strict=True):
            state[key] = level.init_group_state(shapes, world_size, local_workers)
        return state

    def _levels_problem(
        self, state: Mapping[str, Any], fresh: Mapping[str, Any],
        shapes: Mapping[str, torch.Size], workers: int,
    ) -> str | None:
        """The first problem in either level's own state (see ``Compressor.check_state``)."""
        for level, key in zip(self.level_compressors, (STEADY, CRITICAL), strict=True):
            found = level.check_state(state[key], fresh=fresh[key], shapes=shapes, workers=workers)
            if found:
                return f"{key}.{found}"
        return None

    def _run_levels(self, jobs: Sequence[Job], state: dict[str, Any], comm: Collective,
                    ctx: StepContext) -> None:
        """Reduce every job at its tensor's level and count tensor-steps per level."""
        steady, critical = self.level_compressors
        ctrl = state["controller"]
        level = ctrl["level"]
        unknown = [j.name for j in jobs if j.name not in level]
        if unknown:
            raise ValueError(f"job names must be tensors given to init_state, got {unknown[:3]}")
        # Levels are identical on every worker, so each worker splits the jobs identically
        # and issues the same collectives in the same order.
        low = [j for j in jobs if level[j.name] == STEADY]
        high = [j for j in jobs if level[j.name] != STEADY]
        if low and high and isinstance(steady, PowerSGD) and steady.shares_exchange(critical):
            # PowerSGD at two ranks: both levels' factors in the same two all-reduces (each
            # matrix computed as its level's own reduce computes it), not two of each; with
            # ``none`` as the gentle level, its tensors ride in the first (two, not three).
            reduce_together([(steady, low, state[STEADY]), (critical, high, state[CRITICAL])],
                            comm, ctx)
        else:
            if low:
                steady.reduce(low, state[STEADY], comm, ctx)
            if high:
                critical.reduce(high, state[CRITICAL], comm, ctx)
        self._count_levels(ctrl, _level_steps(level, [j.name for j in jobs]),
                           jobs[0].tensor.device if jobs else None)

    # -- a call as one row (the engine's segment path) ------------------------------------
    def _levels_share_row(self) -> bool:
        """Whether the levels exchange together: PowerSGD at two ranks, or PowerSGD and
        ``none`` (the only pairs with a one-row form:
        :func:`~gradzip.compressors.powersgd.row_plan`)."""
        steady, critical = self.level_compressors
        return isinstance(steady, PowerSGD) and steady.shares_exchange(critical)

    def _levels_key(self, state: Mapping[str, Any]) -> Any:
        """What the row's plan depends on: every tensor's level (a decision changes it, and
        the engine then asks for a new plan); ``None`` where the levels have no row form."""
        if not self._levels_share_row():
            return None
        return tuple(state["controller"]["level"].items())

    def _levels_row_plan(
        self, names: Sequence[str], sizes: Sequence[int], shapes: Sequence[torch.Size] | None,
        state: Mapping[str, Any] | None,
    ) -> SegmentPlan | None:
        """The row of a call at the tensors' present levels (see
        :meth:`~gradzip.compressors.base.Compressor.segment_plan`): PowerSGD's groups of both
        levels in one row, laid out as :func:`~gradzip.compressors.powersgd.row_plan` lays
        out the exchange :meth:`_run_levels` makes. ``None`` where the levels have no row
        form, or a tensor has no level (the ordinary call then says why)."""
        if shapes is None or state is None or not self._levels_share_row():
            return None
        level = state["controller"]["level"]
        if any(n not in level for n in names):
            return None
        steady, critical = self.level_compressors
        part_of = [0 if level[n] == STEADY else 1 for n in names]
        plan = row_plan([steady, critical], part_of, names, sizes, shapes)
        return SegmentPlan(plan.order, _LevelsRow(
            plan.data, tuple(names[i] for i in plan.order),
            tuple(torch.Size(shapes[i]) for i in plan.order), _level_steps(level, names)))

    def _reduce_levels_row(self, flat: torch.Tensor, plan: SegmentPlan, state: dict[str, Any],
                           comm: Collective, ctx: StepContext) -> torch.Tensor:
        """:meth:`_run_levels` of a row laid out by :meth:`_levels_row_plan`: the same
        exchange, state, counts and bits; the ``[N]`` average in the row's order."""
        data: _LevelsRow = plan.data
        steady, _ = self.level_compressors
        average = reduce_row(cast(PowerSGD, steady), flat, data.rows,
                             [state[STEADY], state[CRITICAL]], comm, ctx)
        self._count_levels(state["controller"], data.added, flat.device)
        return average

    def _count_levels(self, ctrl: dict[str, Any], added: Mapping[str, int],
                      device: torch.device | None) -> None:
        """Count the tensor-steps a call reduced at each level (plain counts here)."""
        counts = dict(ctrl["counts"])
        for key, n in added.items():
            counts[key] += n
        ctrl["counts"] = counts

    def _count_step(self, ctrl: dict[str, Any]) -> None:
        """Count one optimizer step (a plain count here)."""
        ctrl["step"] += 1

    @staticmethod
    def _track_lr(ctrl: dict[str, Any], ctx: StepContext) -> None:
        """Record ``ctx.lr`` as the last learning rate, only when it changed (a plain value)."""
        if ctx.lr is not None and ctrl["last_lr"] != float(ctx.lr):
            ctrl["last_lr"] = float(ctx.lr)

    def _end_levels(self, state: dict[str, Any], ctx: StepContext, *,
                    track_lr: bool = True) -> None:
        """Both levels' ``end_step``; the step count and (``track_lr``) the last learning
        rate."""
        steady, critical = self.level_compressors
        steady.end_step(state[STEADY], ctx)
        critical.end_step(state[CRITICAL], ctx)
        ctrl = state["controller"]
        if track_lr:
            self._track_lr(ctrl, ctx)
        self._count_step(ctrl)

    def _levels_host_call(self, state: Mapping[str, Any], ctx: StepContext,
                          finish_step: bool) -> bool:
        """Whether either level's own state needs the host in this call."""
        return any(level.host_call(state[key], ctx, finish_step=finish_step)
                   for level, key in zip(self.level_compressors, (STEADY, CRITICAL), strict=True))

    # -- observability ---------------------------------------------------------------------
    def tensor_levels(self, state: Mapping[str, Any]) -> dict[str, str] | None:
        """Every tensor's level in ``state`` (see :meth:`levels`)."""
        return self.levels(state)

    @staticmethod
    def levels(state: Any) -> dict[str, str]:
        """Level of every tensor for the next step: ``name -> "critical" | "steady" |
        "dense"`` (``"dense"``: both levels send it dense, so it has no level to choose)."""
        return dict(controller(state)["level"])

    @staticmethod
    def decisions(state: Any, since: int | None = None) -> list[dict[str, Any]]:
        """Decision records: one per decision key per decision point.

        Args:
            state: ``engine.compressor_state`` (or the engine).
            since: return the points numbered ``since`` and later (a poller passes the
                ``counts(state)["decisions"]`` it saw last time); ``None``: the latest point.

        Returns:
            Records, oldest first: ``decision`` (the point's number, from 0), ``step`` (first
            optimizer step the level applies to), ``interval``, ``name``, ``norm`` and
            ``prev_norm`` (``None`` where not measured), ``rel_change``, ``level`` and
            ``reason`` (``"first"``, ``"lr_drop"``, ``"norm_change"``, ``"steady"`` or
            ``"schedule"``).
        """
        records = controller(state)["log"]
        if since is None:
            since = max((r["decision"] for r in records), default=0)
        return [dict(r) for r in records if r["decision"] >= since]

    def report(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Levels, counts, and the density where both levels tell one.

        The density is summed over both levels' own counts where both count what they send
        (threshold); where both have a fixed density (top-k, ``none`` as 1), it is their mean
        over the tensor-steps reduced at each level (tensors sent dense at both levels left
        out); else none.
        """
        steady, critical = self.level_compressors
        counts = TwoLevel.counts(state)
        out: dict[str, Any] = {"levels": TwoLevel.levels(state), "counts": counts}
        parts = [level.report(state[key]) for level, key in ((steady, STEADY),
                                                              (critical, CRITICAL))]
        if all("density_parts" in p for p in parts):
            sent, offered = zip(*(p["density_parts"] for p in parts), strict=True)
            out["density_parts"] = (sum(sent), sum(offered))
            return out
        fixed = [1.0 if isinstance(level, NoCompression) else p.get("density")
                 for level, p in zip((steady, critical), parts, strict=True)]
        if fixed[0] is not None and fixed[1] is not None:
            steps = (counts["steady_steps"], counts["critical_steps"])
            out["density_parts"] = (fixed[0] * steps[0] + fixed[1] * steps[1], sum(steps))
        return out

    @staticmethod
    def counts(state: Any) -> dict[str, Any]:
        """Cumulative counts: ``decisions`` taken, ``critical``/``steady`` choices (one per
        decision key per decision), level ``switches``, tensor-steps reduced at each level
        (``critical_steps``/``steady_steps``; ``dense_steps`` for tensors both levels send
        dense) and choices per reason."""
        ctrl = controller(state)
        counts = ctrl["counts"]
        # Counts kept on the device (Accordion's, see gradzip.control.accordion_state): one
        # host read each, here only.
        tally = {k: int(v) for k, v in ctrl.get("tally", {}).items()}
        return {**counts, **tally, "reasons": dict(counts["reasons"])}


def _level_steps(level: Mapping[str, str], names: Sequence[str]) -> dict[str, int]:
    """The tensor-steps a call of ``names`` adds at each level (``level``: every tensor's)."""
    dense = sum(level[n] == DENSE for n in names)
    steady = sum(level[n] == STEADY for n in names)
    return {"steady_steps": steady, "critical_steps": len(names) - steady - dense,
            "dense_steps": dense}


@dataclass(frozen=True)
class _LevelsRow:
    """A two-level controller's segment plan's data: PowerSGD's row plan of both levels
    (``rows``), the row's tensors (names and shapes, in the row's order) and the tensor-steps
    the call adds at each level."""

    rows: Any
    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    added: dict[str, int]
