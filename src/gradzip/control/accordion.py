"""Accordion: switch between a gentle and an aggressive compression level by training regime.

State layout (plain data inside the engine's ``compressor_state``, so ``Engine.state_dict``
checkpoints it)::

    {"steady": <steady level's state>, "critical": <critical level's state>,
     "controller": {"per_layer", "step", "interval", "level", "acc", "prev_norm", "lr_drop",
                    "last_lr", "log", "counts"}}

Each level keeps its own state (PowerSGD's warm-start ``Q`` of rank 1 and of rank 4 live side
by side and each resumes where it stopped); the error-feedback residual lives in the engine,
in gradient space, so it carries over a switch unchanged.

References:
    Agarwal, Wang, Lee, Venkataraman and Papailiopoulos, "Adaptive Gradient Communication via
    Critical Learning Regime Identification" (Accordion), MLSys 2021.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch

from gradzip._validate import check_bool, check_int, check_real
from gradzip.comm.base import Collective
from gradzip.compressors.base import Compressor, Job, StepContext
from gradzip.compressors.none import NoCompression
from gradzip.compressors.spec import compressor_from_spec
from gradzip.control.levels import check_levels
from gradzip.control.records import (
    LOG_POINTS,
    MODEL,
    controller,
    force_critical,
    key_levels,
    log_decisions,
    record,
)
from gradzip.control.rule import CRITICAL, STEADY, decide, is_lr_drop, joint_norm

__all__ = ["LOG_POINTS", "MODEL", "Accordion"]


_KEYS = ("steady", "critical", "eta", "interval", "per_layer", "lr_drop")
_SPEC = re.compile(r"^\s*accordion\s*\((.*)\)\s*$", re.DOTALL)
_SPLIT = re.compile(r",(?=\s*(?:" + "|".join(_KEYS) + r")\s*=)")


def _zeros(shape: torch.Size, device: torch.device | None = None) -> torch.Tensor:
    # A stride-0 view of one zero: an accumulator of the right shape that costs no memory
    # until the first gradient is added (additions return new, full tensors).
    return torch.zeros((), dtype=torch.float32, device=device).expand(shape)


@dataclass(frozen=True)
class Accordion(Compressor):
    """Adaptive compression: a gentle level in critical regimes, an aggressive one otherwise.

    Over each interval of ``interval`` optimizer steps the controller accumulates the
    *aggregated* gradient of every tensor (``job.averaged``, the average over all workers,
    identical on every worker). At the interval's end it compares the accumulated norm with
    the previous interval's: critical when ``|prev - curr| / prev >= eta`` (a zero previous
    norm counts as critical). The first two intervals run critical (no comparison is possible
    before two intervals were accumulated). A learning-rate drop (``ctx.lr`` falling below
    ``0.9x`` the previous step's, or :meth:`signal_lr_drop`) makes every tensor critical until
    the interval's end. Decisions are per tensor (``per_layer=True``, the paper's choice) or
    for the whole model. Since they come from aggregated values, every worker takes the same
    decision without a broadcast.

    Args:
        steady: the aggressive level (a compressor or spec, e.g. ``"powersgd:rank=1"``).
        critical: the gentle level: the same kind of compressor (``"powersgd:rank=4"``), or
            ``"none"`` for dense exchange in critical regimes.
        eta: threshold on the relative change of the accumulated norm (> 0).
        interval: optimizer steps per interval (>= 1); the paper used 10 epochs (CIFAR).
        per_layer: decide per tensor, or once for the whole model.
        lr_drop: react to learning-rate drops seen in ``StepContext.lr``.

    Raises:
        TypeError: a level that is not a compressor or spec string, or is itself an Accordion;
            a parameter of the wrong type.
        ValueError: levels of different kinds, ``eta <= 0``, ``interval < 1``.

    Example:
        >>> acc = Accordion("powersgd:rank=1", "powersgd:rank=4", interval=500)
        >>> engine = Engine(model, acc, optimizer=opt)   # reads the LR for drops
        >>> Accordion.levels(engine)                      # {"fc.weight": "critical", ...}

    References:
        Agarwal et al., "Adaptive Gradient Communication via Critical Learning Regime
        Identification", MLSys 2021.
    """

    steady: Compressor | str
    critical: Compressor | str
    eta: float = 0.5
    interval: int = 100
    per_layer: bool = True
    lr_drop: bool = True
    spec_name: ClassVar[str] = "accordion"

    def __post_init__(self) -> None:
        levels = {}
        for name in ("steady", "critical"):
            value = getattr(self, name)
            if not isinstance(value, (Compressor, str)):
                raise TypeError(
                    f"`{name}` must be a Compressor or a spec string such as 'powersgd:rank=1', "
                    f"got {type(value).__name__}"
                )
            level = compressor_from_spec(value)
            if isinstance(level, Accordion):
                raise TypeError(f"`{name}` must be a plain compressor, not an Accordion, got {level.spec()!r}")
            levels[name] = level
            object.__setattr__(self, name, level)
        steady, critical = levels["steady"], levels["critical"]
        if type(critical) is not type(steady) and not isinstance(critical, NoCompression):
            raise ValueError(
                f"`critical` must be the same kind of compressor as `steady` "
                f"({steady.spec_name}) or 'none', got {critical.spec()!r}"
            )
        check_levels(steady, critical)
        object.__setattr__(self, "eta", check_real("eta", self.eta, low=0, low_open=True))
        object.__setattr__(self, "interval", check_int("interval", self.interval, minimum=1))
        check_bool("per_layer", self.per_layer)
        check_bool("lr_drop", self.lr_drop)
        # Error feedback by default when either level drops information.
        object.__setattr__(self, "biased", bool(steady.biased or critical.biased))

    # -- construction and identity ---------------------------------------------------------
    @property
    def levels_pair(self) -> tuple[Compressor, Compressor]:
        """``(steady, critical)`` as compressors."""
        return cast(Compressor, self.steady), cast(Compressor, self.critical)

    @classmethod
    def from_specs(
        cls,
        compressor_spec: str | Compressor,
        accordion_spec: str | Compressor,
        eta: float = 0.5,
        interval: int = 100,
        *,
        per_layer: bool = True,
        lr_drop: bool = True,
    ) -> Accordion:
        """Build from the CLI's ``--compressor SPEC --accordion SPEC`` pair.

        Args:
            compressor_spec: the steady (aggressive) level.
            accordion_spec: the critical (gentle) level, or ``"none"``.
            eta, interval, per_layer, lr_drop: as for the constructor.
        """
        return cls(compressor_spec, accordion_spec, eta=eta, interval=interval,
                   per_layer=per_layer, lr_drop=lr_drop)

    @classmethod
    def from_spec(cls, spec: str) -> Accordion:
        """Rebuild from :meth:`spec` output, e.g.
        ``"accordion(steady=powersgd:rank=1,critical=powersgd:rank=4,eta=0.5,interval=100)"``.

        Raises:
            ValueError: not of that form, or a missing, unknown or invalid parameter.
        """
        match = _SPEC.match(spec) if isinstance(spec, str) else None
        if match is None:
            raise ValueError(f"`spec` must look like 'accordion(steady=...,critical=...)', got {spec!r}")
        kwargs: dict[str, Any] = {}
        for item in _SPLIT.split(match.group(1)):
            key, eq, value = (part.strip() for part in item.partition("="))
            if not eq or key not in _KEYS or key in kwargs:
                raise ValueError(
                    f"`spec` parameters must be distinct among {', '.join(_KEYS)}, got {item!r}"
                )
            kwargs[key] = value
        if "steady" not in kwargs or "critical" not in kwargs:
            raise ValueError(f"`spec` must give both steady= and critical=, got {spec!r}")
        for key, convert in (("eta", float), ("interval", int)):
            if key in kwargs:
                try:
                    kwargs[key] = convert(kwargs[key])
                except ValueError:
                    raise ValueError(f"`{key}` must be a number, got {kwargs[key]!r}") from None
        for key in ("per_layer", "lr_drop"):
            if key in kwargs:
                if kwargs[key] not in ("True", "False", "true", "false"):
                    raise ValueError(f"`{key}` must be True or False, got {kwargs[key]!r}")
                kwargs[key] = kwargs[key].lower() == "true"
        return cls(**kwargs)

    def spec(self) -> str:
        """A stable, readable description, stored in checkpoints and compared on load."""
        steady, critical = self.levels_pair
        return (
            f"accordion(steady={steady.spec()},critical={critical.spec()},eta={self.eta!r},"
            f"interval={self.interval},per_layer={self.per_layer},lr_drop={self.lr_drop})"
        )

    # -- state -----------------------------------------------------------------------------
    def init_state(self, shapes: Mapping[str, torch.Size]) -> dict[str, Any]:
        steady, critical = self.levels_pair
        names = list(shapes)
        keys = names if self.per_layer else [MODEL]
        first = [record(0, 0, k, None, None, None, CRITICAL, "first") for k in keys]
        return {
            "steady": steady.init_state(shapes),
            "critical": critical.init_state(shapes),
            "controller": {
                "per_layer": self.per_layer,
                "step": 0,  # optimizer steps completed (skipped steps are not counted)
                "interval": 0,  # index of the current interval
                "level": {n: CRITICAL for n in names},
                "acc": {n: _zeros(torch.Size(s)) for n, s in shapes.items()},
                "prev_norm": {k: None for k in keys},
                "lr_drop": False,  # a drop forced every tensor critical in this interval
                "last_lr": None,
                "log": first,
                "counts": {
                    "decisions": 1,
                    "critical": len(keys),
                    "steady": 0,
                    "switches": 0,
                    "critical_steps": 0,
                    "steady_steps": 0,
                    "reasons": {"first": len(keys), "lr_drop": 0, "norm_change": 0, "steady": 0},
                },
            },
        }

    # -- the step --------------------------------------------------------------------------
    def reduce(
        self, jobs: Sequence[Job], state: dict[str, Any], comm: Collective, ctx: StepContext
    ) -> None:
        steady, critical = self.levels_pair
        ctrl = state["controller"]
        if self.lr_drop and not ctrl["lr_drop"] and is_lr_drop(ctrl["last_lr"], ctx.lr):
            # last_lr changes only in end_step, so every call of a step (one per DDP bucket)
            # sees the same drop; the flag makes the switch happen once.
            force_critical(ctrl, ctx.step)
        level = ctrl["level"]
        unknown = [j.name for j in jobs if j.name not in level]
        if unknown:
            raise ValueError(f"job names must be tensors given to init_state, got {unknown[:3]}")
        # Levels are identical on every worker, so each worker splits the jobs identically
        # and issues the same collectives in the same order.
        by_level = {
            STEADY: [j for j in jobs if level[j.name] == STEADY],
            CRITICAL: [j for j in jobs if level[j.name] == CRITICAL],
        }
        for key, compressor in ((STEADY, steady), (CRITICAL, critical)):
            if by_level[key]:
                compressor.reduce(by_level[key], state[key], comm, ctx)
        acc = dict(ctrl["acc"])
        for job in jobs:
            assert job.averaged is not None, job.name
            avg = job.averaged.to(torch.float32)
            acc[job.name] = acc[job.name].to(avg.device) + avg  # a new tensor: state is never mutated
        ctrl["acc"] = acc
        counts = dict(ctrl["counts"])
        counts["steady_steps"] += len(by_level[STEADY])
        counts["critical_steps"] += len(by_level[CRITICAL])
        ctrl["counts"] = counts

    def end_step(self, state: dict[str, Any], ctx: StepContext) -> None:
        steady, critical = self.levels_pair
        steady.end_step(state["steady"], ctx)
        critical.end_step(state["critical"], ctx)
        ctrl = state["controller"]
        if ctx.lr is not None:
            ctrl["last_lr"] = float(ctx.lr)
        ctrl["step"] += 1
        if ctrl["step"] % self.interval == 0:
            self._end_interval(ctrl, ctx)

    def _end_interval(self, ctrl: dict[str, Any], ctx: StepContext) -> None:
        acc = ctrl["acc"]
        if self.per_layer:
            norms = {n: joint_norm([t]) for n, t in acc.items()}
        else:
            norms = {MODEL: joint_norm(acc.values())}
        before = key_levels(ctrl)
        interval = ctrl["interval"] + 1
        records, chosen = [], {}
        for key, norm in norms.items():
            prev = ctrl["prev_norm"][key]
            decision = decide(prev, norm, self.eta)
            chosen[key] = decision.level
            records.append(record(ctx.step + 1, interval, key, norm, prev,
                                  decision.rel_change, decision.level, decision.reason))
        ctrl["prev_norm"] = norms
        ctrl["acc"] = {n: _zeros(t.shape, t.device) for n, t in acc.items()}
        ctrl["level"] = {n: chosen[n if self.per_layer else MODEL] for n in ctrl["level"]}
        ctrl["lr_drop"] = False
        ctrl["interval"] = interval
        log_decisions(ctrl, records, before, ctx)

    # -- observability and user signals ----------------------------------------------------
    @staticmethod
    def signal_lr_drop(state: Any) -> None:
        """Mark a learning-rate drop: every tensor is critical until the interval's end.

        For training loops whose engine was given no optimizer. Call between steps, with the
        same timing on every worker (e.g. right after the scheduler lowered the LR).

        Args:
            state: ``engine.compressor_state`` of an engine using Accordion (or the engine).
        """
        ctrl = controller(state)
        if not ctrl["lr_drop"]:
            force_critical(ctrl, None)

    @staticmethod
    def levels(state: Any) -> dict[str, str]:
        """Current level of every tensor: ``name -> "critical" | "steady"``."""
        return dict(controller(state)["level"])

    @staticmethod
    def decisions(state: Any, since: int | None = None) -> list[dict[str, Any]]:
        """Decision records: one per tensor (or one named ``"model"``) per decision point.

        A decision point is the start (``"first"``), an interval's end, or a learning-rate
        drop; one step may hold two (a drop seen in an interval's last step). The state keeps
        the records of the last :data:`LOG_POINTS` points.

        Args:
            state: ``engine.compressor_state`` (or the engine).
            since: return the points numbered ``since`` and later (a poller passes the
                ``counts(state)["decisions"]`` it saw last time); ``None``: the latest point.

        Returns:
            Records, oldest first: ``decision`` (the point's number, from 0), ``step`` (first
            optimizer step the level applies to), ``interval``, ``name``, ``norm`` and
            ``prev_norm`` (accumulated norms; ``None`` where not measured), ``rel_change``,
            ``level`` and ``reason`` (``"first"``, ``"lr_drop"``, ``"norm_change"`` or
            ``"steady"``).
        """
        records = controller(state)["log"]
        if since is None:
            since = max((r["decision"] for r in records), default=0)
        return [dict(r) for r in records if r["decision"] >= since]

    def current_levels(self, state: Any) -> dict[str, str]:
        """:meth:`levels`, for callers that ask any compressor for its current choice."""
        return Accordion.levels(state)

    @staticmethod
    def counts(state: Any) -> dict[str, Any]:
        """Cumulative counts: ``decisions`` taken, ``critical``/``steady`` choices (one per
        tensor, or per model, per decision), level ``switches``, tensor-steps reduced at each
        level (``critical_steps``/``steady_steps``) and choices per reason."""
        counts = controller(state)["counts"]
        return {**counts, "reasons": dict(counts["reasons"])}
