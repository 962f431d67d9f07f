"""Accordion: switch between a gentle and an aggressive compression level by training regime.

State layout (plain data inside the engine's ``compressor_state``, so ``Engine.state_dict``
checkpoints it)::

    {"steady": <steady level's state>, "critical": <critical level's state>,
     "controller": {"per_layer", "step", "offset", "tally", "interval", "next", "level",
                    "fixed", "acc", "prev_norm", "held", "drop_step", "last_lr", "log",
                    "counts"}}

What changes every step (``step``, ``tally``, ``acc``) is tensors, read on the host only at a
decision (see :mod:`gradzip.control.accordion_state`), so the engine can keep every other
call's non-finite decision on the device.

Each level keeps its own state (PowerSGD's warm-start ``Q`` of rank 1 and of rank 4 live side
by side and each resumes where it stopped); the error-feedback residual lives in the engine,
in gradient space, so it carries over a switch unchanged.

References:
    Agarwal, Wang, Lee, Venkataraman and Papailiopoulos, "Adaptive Gradient Communication via
    Critical Learning Regime Identification" (Accordion), MLSys 2021.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from gradzip._validate import check_bool, check_choice, check_int, check_real
from gradzip.comm.base import Collective
from gradzip.compressors.base import Compressor, Job, SegmentPlan, StepContext
from gradzip.control.accordion_state import (
    TALLY,
    add_tally,
    counted_step,
    fresh_tally,
    upgrade_controller,
    weighted_sums,
    zeroed,
)
from gradzip.control.level_order import check_level_order
from gradzip.control.records import (
    LOG_POINTS,
    MODEL,
    controller,
    force_critical,
    record,
    set_levels,
)
from gradzip.control.rule import CRITICAL, LR_HOLDS, decide, is_lr_drop
from gradzip.control.state_values import accordion_problem
from gradzip.control.switch import TwoLevel, build_levels
from gradzip.ops.flat import unpack
from gradzip.spec import format_call, register_controller

__all__ = ["LOG_POINTS", "MODEL", "SIGNALS", "LR_HOLDS", "Accordion"]


#: What the norms are taken of: each worker's gradient before error feedback (the paper's
#: code), or the worker average of what was sent (gradzip's first rule).
SIGNALS = ("raw", "sent")


@register_controller
@dataclass(frozen=True)
class Accordion(TwoLevel):
    """Adaptive compression: a gentle level in critical regimes, an aggressive one otherwise.

    Decisions are taken every ``interval`` optimizer steps. Before each decision the
    controller sums the gradient of every tensor over a *window* of the last ``window`` steps,
    and compares the norm of that sum with the one of the window before the previous decision
    (one interval earlier): critical when ``|prev - curr| / prev >= eta`` (a zero previous norm
    counts as critical). The paper's code sums one epoch and decides every ten, hence the
    default ``window = ceil(interval / 10)``; ``window=interval`` compares whole adjacent
    intervals. The first decision, after ``window`` steps, is critical (nothing to compare
    with yet); the next one, ``interval`` steps later, compares.

    The gradient judged (``signal``) is by default each worker's own gradient as it came,
    before error feedback and compression, as in the paper's code (which judged rank 0's);
    each worker computes the per-tensor norms of its window sum and one all-reduce of those
    few floats per decision gives every worker the mean over workers, so all take the same
    decision without a broadcast. Since that all-reduce needs the collective, a decision due
    at the end of a step is taken as the next step begins (:meth:`begin_step`, before any
    tensor of that step is sent, and standing if that step is skipped); :meth:`levels` shows
    it from then on. ``signal="sent"`` judges the
    worker average of what was sent (after error feedback) instead, needs no collective, and
    decides at the end of the step.

    A learning-rate drop (``ctx.lr`` falling below ``0.9x`` the previous step's, or
    :meth:`signal_lr_drop`) makes every tensor critical at once. With ``lr_hold="interval"``
    (the paper's code) that lasts one whole interval, overridden by no check; the interval's
    grid restarts at the drop, and the first decision after it compares the window just
    before it (all after the drop) with the last window measured before the drop. With
    ``lr_hold="boundary"`` the level holds until the current interval's end, whose decision
    compares as usual.

    Decisions are per tensor (``per_layer=True``, the paper's choice) or for the whole model.
    Tensors that both levels send dense take no decision (level ``"dense"``).

    Args:
        steady: the aggressive level (a compressor or spec, e.g. ``"powersgd:rank=1"``).
        critical: the gentle level: the same kind of compressor (``"powersgd:rank=4"``), or
            ``"none"`` for dense exchange in critical regimes.
        eta: threshold on the relative change of the window norms (> 0).
        interval: optimizer steps between decisions (>= 1); the paper used 10 epochs (CIFAR).
        per_layer: decide per tensor, or once for the whole model.
        lr_drop: react to learning-rate drops seen in ``StepContext.lr``.
        window: steps summed before each decision, in ``[1, interval]``; ``None``:
            ``ceil(interval / 10)``.
        signal: ``"raw"`` or ``"sent"`` (see above).
        lr_hold: ``"interval"`` or ``"boundary"`` (see above).

    Raises:
        TypeError: a level that is not a compressor or spec string, or is itself a
            controller; a parameter of the wrong type.
        ValueError: levels of different kinds, ``eta <= 0``, ``interval < 1``, a window
            outside ``[1, interval]``, an unknown signal or hold.

    Examples:
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
    window: int | None = None
    signal: str = "raw"
    lr_hold: str = "interval"
    spec_name: ClassVar[str] = "accordion"
    spec_kinds: ClassVar[dict[str, str]] = {
        "steady": "level", "critical": "level", "eta": "float", "interval": "int",
        "per_layer": "bool", "lr_drop": "bool", "window": "int", "signal": "str",
        "lr_hold": "str"}

    def __post_init__(self) -> None:
        steady, critical = build_levels("Accordion", self.steady, self.critical)
        object.__setattr__(self, "steady", steady)
        object.__setattr__(self, "critical", critical)
        check_level_order(steady, critical)
        object.__setattr__(self, "eta", check_real("eta", self.eta, low=0, low_open=True))
        interval = check_int("interval", self.interval, minimum=1)
        object.__setattr__(self, "interval", interval)
        check_bool("per_layer", self.per_layer)
        check_bool("lr_drop", self.lr_drop)
        window = math.ceil(interval / 10) if self.window is None else self.window
        object.__setattr__(self, "window", check_int("window", window, minimum=1, maximum=interval))
        check_choice("signal", self.signal, SIGNALS)
        check_choice("lr_hold", self.lr_hold, LR_HOLDS)
        # Error feedback by default when either level drops information.
        object.__setattr__(self, "biased", bool(steady.biased or critical.biased))

    # -- construction and identity ---------------------------------------------------------
    def spec(self) -> str:
        """A stable, readable description, stored in checkpoints and compared on load."""
        steady, critical = self.level_compressors
        return format_call(self.spec_name, {
            "steady": steady.spec(), "critical": critical.spec(), "eta": repr(self.eta),
            "interval": self.interval, "per_layer": self.per_layer, "lr_drop": self.lr_drop,
            "window": self.window, "signal": self.signal, "lr_hold": self.lr_hold})

    # -- state -----------------------------------------------------------------------------
    def init_state(self, shapes: Mapping[str, torch.Size]) -> dict[str, Any]:
        """Fresh state; the window sums are made at the first call (the engine's
        :meth:`init_group_state` makes them at once, as zeros)."""
        fixed = set(self.fixed_names(shapes))
        names = [n for n in shapes if n not in fixed]
        keys = names if self.per_layer else [MODEL]
        first = [record(0, 0, k, None, None, None, CRITICAL, "first") for k in keys]
        state = self._pair_state(shapes, first, CRITICAL)
        ctrl = state["controller"]
        ctrl["counts"] = {k: v for k, v in ctrl["counts"].items() if k not in TALLY}
        ctrl.update(
            per_layer=self.per_layer,
            # The optimizer steps counted, skipped steps not: a tensor, so that a step rolled
            # back on the device is uncounted with the rest (see control.accordion_state).
            step=torch.zeros((), dtype=torch.int64),
            offset=0,  # the engine's step minus `step`, as of the last read
            tally=fresh_tally(),
            interval=0,  # decisions taken after the first one
            next=self.window,  # the counted step at which the next decision falls due
            # Window sums (with signal="raw" they carry the local worker axis).
            acc={n: None for n in names},
            prev_norm={k: None for k in keys},
            hold={"lr_hold": self.lr_hold, "interval": self.interval},
            held=False,  # a drop holds every tensor critical until the next decision
            drop_step=None,  # the counted step whose drop was last recorded (once per step)
            host_step=None,  # the engine step whose calls changed plain values (see host_call)
        )
        return state

    def init_group_state(
        self, shapes: Mapping[str, torch.Size], world_size: int, local_workers: int
    ) -> dict[str, Any]:
        """:meth:`init_state` with the window sums made (zeros), so that no call but the
        decisions changes a plain value of the state."""
        state = super().init_group_state(shapes, world_size, local_workers)
        ctrl = state["controller"]
        lead = (local_workers,) if self.signal == "raw" else ()
        made = {n: torch.empty(*lead, *shapes[n]) for n in ctrl["acc"]}
        ctrl["acc"] = zeroed(made)
        return state

    def upgrade_state(self, state: Any, *, fresh: Mapping[str, Any], step: int) -> Any:
        """A state saved by the earlier layout (plain step count, ``pending``) in this one."""
        if not isinstance(state, Mapping) or not isinstance(fresh.get("controller"), Mapping):
            return state
        ctrl = upgrade_controller(state.get("controller"), fresh=fresh["controller"],
                                  step=step, interval=self.interval)
        return state if ctrl is state.get("controller") else {**state, "controller": ctrl}

    def check_state(self, state: Mapping[str, Any], *, fresh: Mapping[str, Any],
                    shapes: Mapping[str, torch.Size], workers: int) -> str | None:
        """Level names, counters, norms, window sums and the hold against this configuration,
        then each level's own state (see ``Compressor.check_state``)."""
        return accordion_problem(state["controller"], fresh["controller"], signal=self.signal,
                                 shapes=shapes, workers=workers) or self._levels_problem(
            state, fresh, shapes, workers)

    # -- where the engine reads the call's decision --------------------------------------------
    @property
    def device_decisions(self) -> bool:  # type: ignore[override]
        """Both levels allow it: every call but a decision's changes tensors only."""
        steady, critical = self.level_compressors
        return bool(steady.device_decisions and critical.device_decisions)

    def host_call(self, state: Mapping[str, Any], ctx: StepContext, *, finish_step: bool) -> bool:
        """The calls that change plain values: window sums not made yet, and with
        ``signal="sent"`` the step's last call when a decision may be due (the rest is done
        in :meth:`begin_step`)."""
        ctrl = state["controller"]
        if ctrl["host_step"] == ctx.step:
            # A call of this step changed plain values already: the rest of the step stays on
            # the host, so that a rollback of the step undoes them with everything else.
            return True
        # A raw-signal decision, a learning-rate drop and a new learning rate are taken in
        # begin_step, before the step's restore point: they leave the calls changing tensors.
        if any(t is None for t in ctrl["acc"].values()):
            return True
        # signal="sent" decides at the step's end, from the step's averages.
        guess = ctx.step - ctrl["offset"]  # >= the counted step (see control.accordion_state)
        if finish_step and self.signal == "sent" and guess + 1 >= ctrl["next"]:
            return True
        return self._levels_host_call(state, ctx, finish_step)

    # -- the step --------------------------------------------------------------------------
    def begin_step(self, state: dict[str, Any], comm: Collective, ctx: StepContext) -> None:
        """The decision that falls due at this step (``signal="raw"``: from the window sums
        of the steps before it), a learning-rate drop seen in ``ctx.lr``, and ``ctx.lr`` kept
        as the last learning rate.

        Why here, before the engine notes where the step began: these change plain values
        (levels, records, the last learning rate), which a rollback on the device cannot
        undo, so taken inside the step they would send its calls to the host path (a host
        read per call; with a learning-rate schedule, in every step). Taken here they stand
        even if this step is skipped, as the learning-rate schedule does; the window a
        decision judges ended before this step, so it is the decision the step would have
        taken. A decision step reads the host once (the norms).
        """
        ctrl = state["controller"]
        # Why a guess is enough: it is never below the counted step, so a decision due now
        # is always looked at; the read then says whether it is (steps skipped since the
        # last read make the guess run ahead). The guess is the same on every worker, so
        # all issue the norms' all-reduce together.
        if self.signal == "raw" and ctx.step - ctrl["offset"] >= ctrl["next"]:
            norms, counted = self._raw_norms(ctrl, comm)
            ctrl["offset"] = ctx.step - counted
            if counted >= ctrl["next"]:
                self._decide(ctrl, norms, counted, ctx.step, ctx)
        self._check_drop(ctrl, ctx)
        self._track_lr(ctrl, ctx)  # after the drop test, which compares it with ctx.lr

    def reduce(
        self, jobs: Sequence[Job], state: dict[str, Any], comm: Collective, ctx: StepContext
    ) -> None:
        device = jobs[0].tensor.device if jobs else torch.device("cpu")
        inside = self._begin_call(state, ctx, device)
        self._run_levels(jobs, state, comm, ctx)
        if inside:
            self._accumulate(state["controller"], jobs, device)

    def _begin_call(self, state: dict[str, Any], ctx: StepContext, device: torch.device) -> bool:
        """What every call does first (both forms): note a call that changes plain values,
        bring the step counter to the call's device; returns whether the call's counted step
        may lie in the window before a decision (its tensors then go into the window sums)."""
        ctrl = state["controller"]
        if self.host_call(state, ctx, finish_step=False):
            ctrl["host_step"] = ctx.step  # the same in every path: the state's bits agree
        if ctrl["step"].device != device:
            ctrl["step"] = ctrl["step"].to(device)
        return ctx.step - ctrl["offset"] >= ctrl["next"] - self.window

    # -- a call as one row (the engine's segment path; PowerSGD at both levels) -----------
    def segment_key(self, state: Mapping[str, Any]) -> Any:
        """Every tensor's level, where both levels are PowerSGD that exchange together (see
        :meth:`~gradzip.control.switch.TwoLevel._levels_key`)."""
        return self._levels_key(state)

    def segment_plan(
        self, names: Sequence[str], sizes: Sequence[int], world_size: int, device: torch.device,
        shapes: Sequence[torch.Size] | None = None, *, state: Mapping[str, Any] | None = None,
    ) -> SegmentPlan | None:
        """Both levels' PowerSGD groups in one row, at the tensors' present levels (see
        :meth:`~gradzip.control.switch.TwoLevel._levels_row_plan`)."""
        return self._levels_row_plan(names, sizes, shapes, state)

    def reduce_segments(
        self, flat: torch.Tensor, plan: SegmentPlan, state: dict[str, Any], comm: Collective,
        ctx: StepContext, raw: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`reduce` of a row (see
        :meth:`~gradzip.compressors.base.Compressor.reduce_segments`): the same exchange,
        window sums, counts and bits, each tensor's signal a view of ``raw`` (read before the
        exchange writes the row: without error feedback ``raw`` is the row) or of the
        average."""
        ctrl = state["controller"]
        inside = self._begin_call(state, ctx, flat.device)
        data = plan.data
        if inside and self.signal == "raw":
            # [1, *shape] views, as a job's raw gradient carries its worker axis.
            source = raw if raw is not None else flat
            self._accumulate_values(ctrl, data.names, unpack(
                source.reshape(-1), [torch.Size((1, *s)) for s in data.shapes]))
        average = self._reduce_levels_row(flat, plan, state, comm, ctx)
        if inside and self.signal != "raw":
            self._accumulate_values(ctrl, data.names, unpack(average, data.shapes))
        return average

    def _accumulate(self, ctrl: dict[str, Any], jobs: Sequence[Job], device: torch.device) -> None:
        """Add this call's tensors to the window sums where the counted step lies in the
        window (decided on the device: the host's guess may run ahead of it)."""
        values = []
        for job in jobs:
            if self.signal == "raw":
                value = job.raw if job.raw is not None else job.tensor
            else:
                assert job.averaged is not None, job.name
                value = job.averaged
            values.append(value)
        self._accumulate_values(ctrl, [j.name for j in jobs], values)

    def _accumulate_values(self, ctrl: dict[str, Any], names: Sequence[str],
                           values: Sequence[torch.Tensor]) -> None:
        """:meth:`_accumulate` of the tensors ``names`` judged by ``values`` (each tensor's
        signal)."""
        kept = [(n, v.detach().to(torch.float32)) for n, v in zip(names, values, strict=True)
                if n in ctrl["acc"]]  # the others are sent dense at both levels: no decision
        if not kept:
            return
        names, values = [n for n, _ in kept], [v for _, v in kept]
        inside = (ctrl["step"] >= ctrl["next"] - self.window).to(torch.float32)
        acc = dict(ctrl["acc"])
        summed = weighted_sums([acc[n] for n in names], values, inside)
        acc.update(zip(names, summed, strict=True))
        ctrl["acc"] = acc

    def _count_levels(self, ctrl: dict[str, Any], added: Mapping[str, int],
                      device: torch.device | None) -> None:
        ctrl["tally"] = add_tally(ctrl["tally"], added, device or torch.device("cpu"))

    def _count_step(self, ctrl: dict[str, Any]) -> None:
        ctrl["step"] = ctrl["step"] + 1

    def _drop_due(self, ctrl: Mapping[str, Any], ctx: StepContext) -> bool:
        """Whether this call's learning rate is a drop not yet acted on in this step."""
        if not (self.lr_drop and is_lr_drop(ctrl["last_lr"], ctx.lr)):
            return False
        # Once per step: a drop acted on read the counted step, so the guess is exact.
        if ctrl["drop_step"] is not None and ctrl["drop_step"] == ctx.step - ctrl["offset"]:
            return False
        return not (self.lr_hold == "boundary" and ctrl["held"])

    def _check_drop(self, ctrl: dict[str, Any], ctx: StepContext) -> None:
        """Hold every tensor critical after a learning-rate drop seen in ``ctx.lr``."""
        # Called once per step, in begin_step, before last_lr takes this step's rate;
        # _hold acts once per counted step.
        if self._drop_due(ctrl, ctx):
            counted = counted_step(ctrl)
            ctrl["offset"] = ctx.step - counted
            _hold(ctrl, ctx.step, counted)

    def end_step(self, state: dict[str, Any], ctx: StepContext) -> None:
        # The last learning rate is kept in begin_step.
        self._end_levels(state, ctx, track_lr=False)
        ctrl = state["controller"]
        if self.signal == "sent" and ctx.step + 1 - ctrl["offset"] >= ctrl["next"]:
            norms, counted = self._sent_norms(ctrl)
            ctrl["offset"] = ctx.step + 1 - counted
            if counted >= ctrl["next"]:
                self._decide(ctrl, norms, counted, ctx.step + 1, ctx)

    # -- decisions -------------------------------------------------------------------------
    def _sent_norms(self, ctrl: dict[str, Any]) -> tuple[dict[str, float], int]:
        """Norms of the window sums of the averaged gradient (identical on every worker) and
        the counted step: one host read."""
        step = ctrl["step"]
        parts = [torch.linalg.vector_norm(t.to(torch.float64)).reshape(1).to(step.device)
                 for t in ctrl["acc"].values() if t is not None]
        read = torch.cat([*parts, step.to(torch.float64).reshape(1)]).tolist()
        it = iter(read[:-1])
        sq = {n: 0.0 if t is None else next(it) ** 2 for n, t in ctrl["acc"].items()}
        counted = int(read[-1])
        if self.per_layer:
            return {n: math.sqrt(v) for n, v in sq.items()}, counted
        return {MODEL: math.sqrt(sum(sq.values()))}, counted

    def _raw_norms(self, ctrl: dict[str, Any], comm: Collective) -> tuple[dict[str, float], int]:
        """Mean over workers of each worker's norm of its raw window sum (one all-reduce of
        a ``[workers, keys]`` float64 tensor, whose sum is identical on every worker) and the
        counted step: one host read."""
        workers = comm.local_workers
        tensors = [t for t in ctrl["acc"].values() if t is not None]
        device = tensors[0].device if tensors else ctrl["step"].device
        sq = torch.zeros(workers, len(ctrl["acc"]), dtype=torch.float64, device=device)
        for col, t in enumerate(ctrl["acc"].values()):
            if t is not None:
                sq[:, col] = torch.linalg.vector_norm(
                    t.reshape(workers, -1).to(torch.float64), dim=1) ** 2
        local = sq.sqrt() if self.per_layer else sq.sum(dim=1, keepdim=True).sqrt()
        mean = comm.all_reduce(local) / comm.world_size
        step = ctrl["step"].to(torch.float64).reshape(1).to(mean.device)
        read = torch.cat([mean.reshape(-1), step]).tolist()
        keys = list(ctrl["acc"]) if self.per_layer else [MODEL]
        return dict(zip(keys, read[:-1], strict=True)), int(read[-1])

    def _decide(self, ctrl: dict[str, Any], norms: dict[str, float], counted: int, step: int,
                ctx: StepContext) -> None:
        """Apply the rule to the window norms (at the counted step ``counted``); the levels
        apply from engine step ``step``."""
        # A drop signalled between the step that made this decision due and now (only
        # possible with lr_hold="boundary": "interval" cancels the decision) wins.
        dropped = ctrl["held"] and ctrl["drop_step"] == counted
        interval = ctrl["interval"] + 1
        records, chosen = [], {}
        for key, norm in norms.items():
            prev = ctrl["prev_norm"][key]
            decision = decide(prev, norm, self.eta, lr_dropped=dropped)
            chosen[key] = decision.level
            records.append(record(step, interval, key, norm, prev,
                                  decision.rel_change, decision.level, decision.reason))
        ctrl.update(prev_norm=norms, acc=zeroed(ctrl["acc"]), held=dropped, interval=interval,
                    next=ctrl["next"] + self.interval)
        set_levels(ctrl, chosen, records, ctx)

    # -- user signals ----------------------------------------------------------------------
    @staticmethod
    def signal_lr_drop(state: Any) -> None:
        """Mark a learning-rate drop, as one seen in the optimizer's learning rate would.

        For training loops whose engine was given no optimizer. Call between steps, with the
        same timing on every worker (e.g. right after the scheduler lowered the LR).

        Args:
            state: ``engine.compressor_state`` of an engine using Accordion (or the engine).
        """
        ctrl = controller(state)
        counted = counted_step(ctrl)
        _hold(ctrl, counted, counted)


def _hold(ctrl: dict[str, Any], step: int, counted: int) -> None:
    """A learning-rate drop: every deciding tensor critical from engine step ``step``, held
    as ``ctrl["hold"]`` says; once per counted step (``counted``)."""
    hold = ctrl["hold"]
    if ctrl["drop_step"] == counted or (hold["lr_hold"] == "boundary" and ctrl["held"]):
        return
    force_critical(ctrl, step)
    ctrl["held"] = True
    ctrl["drop_step"] = counted
    if hold["lr_hold"] == "interval":
        # A whole interval from here, which no decision interrupts (a decision due now is
        # cancelled); the window summed before the next decision then lies after the drop,
        # and prev_norm (kept) was measured before it: a clean comparison, as in the
        # paper's code.
        ctrl["next"] = counted + hold["interval"]
        ctrl["acc"] = zeroed(ctrl["acc"])
