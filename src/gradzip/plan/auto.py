"""``auto``: a controller that chooses the compression level from measured time and phase.

State layout (plain data inside the engine's ``compressor_state``)::

    {"levels": {label: <that level's own state>, ...},
     "controller": {"shapes", "step", "current", "last_lr", "last_end", "step_reduce",
                    "step_calls", "step_wire", "skip", "periods", "reduces", "calls",
                    "wires", "acc", "acc_steps", "prev_norm", "last_compute", "dropped", "pending",
                    "overhead", "next", "log", "counts"}}

Every level keeps its own state side by side (PowerSGD's warm-start ``Q`` of each rank resumes
where it stopped); the error-feedback residual lives in the engine, in gradient space, and is
valid input for any compressor, so it carries over a switch unchanged.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from gradzip._validate import check_int, check_real
from gradzip.comm.base import Collective
from gradzip.compressors.base import Compressor, Job, StepContext
from gradzip.control.rule import decide, is_lr_drop
from gradzip.plan.auto_state import auto_problem, fresh_controller, level_qualities
from gradzip.plan.candidates import Candidate
from gradzip.plan.measure import fit_probe, max_over_ranks, median, pick, probe_link
from gradzip.plan.model import Setting, predict_candidate
from gradzip.plan.traffic import Traffic
from gradzip.plan.traffic_cache import TrafficCache, stored_or_simulated
from gradzip.spec import (
    CONTROLLERS,
    compressor_from_spec,
    controller_from_spec,
    format_call,
    register_controller,
)

__all__ = ["DEFAULT_LEVELS", "Auto"]

log = logging.getLogger(__name__)

#: The levels ``auto`` chooses among by default, from the least to the most lossy.
DEFAULT_LEVELS = ("none", "fp16", "powersgd:rank=4", "powersgd:rank=2", "powersgd:rank=1",
                  "topk:ratio=0.01")

#: Decision points whose records the state keeps.
LOG_POINTS = 8


@register_controller
@dataclass(frozen=True)
class Auto(Compressor):
    """Choose, every ``every`` steps, the level predicted fastest on the measured link.

    Every tensor runs at one level at a time. The controller times its own steps (the period
    between ``end_step`` calls) and its own ``reduce`` calls with ``clock``; a step's compute
    time is its period minus its time inside ``reduce``, which assumes a synchronous engine
    (with the DDP hook's overlap, communication hidden behind the backward pass is not
    subtracted, so compute is overestimated by the hidden part and the gains of compression
    are underestimated). Medians over the interval keep one-off pauses (an evaluation, a
    checkpoint) out.

    At step ``warmup`` and every ``every`` steps after it, it probes the link with
    all-reduces (one float, ``probe_bytes``, then 4x larger ones up to the tensors' dense size
    until the size costs measurable time: :func:`~gradzip.plan.measure.probe_link`), fits
    bandwidth and latency from them, takes the
    maximum of every measurement over the ranks with one more small all-reduce, and predicts
    each level's step time with :func:`~gradzip.plan.model.predict_candidate` from the level's
    traffic (simulated once from the tensors' shapes) plus its measured compression overhead
    (time in ``reduce`` beyond its predicted link time, learnt while it runs; 0 before). The
    fastest allowed level is chosen, and the current one kept unless the best is at least
    ``margin`` faster.

    Quality guard: the norm of each worker's mean gradient over the interval (before error
    feedback; the largest over the workers) is compared with the previous interval's
    (Accordion's rule, threshold ``eta``); a relative change of
    ``eta`` or more, a learning-rate drop (``ctx.lr``), or the first decision make the phase
    critical, and levels of the ``aggressive`` class (see :mod:`gradzip.plan.candidates`)
    are then not allowed. A drop also brings the next decision forward to the next step.

    Args:
        levels: the compressors to choose among (specs or compressors; a ``|``-separated
            string in a spec), per-step compressors of any kinds, at least one, no
            duplicates, no controllers. Training starts at the first.
        every: steps between decisions (>= 1).
        warmup: the step of the first decision (>= 0; 0 decides before the first step, from
            the probed link alone, as no step has been timed yet).
        margin: the fraction a switch must gain, in [0, 1).
        eta: threshold of the critical-regime rule (> 0).
        probe_bytes: size of the first large probe message (>= 8).
        clock: seconds as a float (``time.perf_counter``); not part of the spec.

    Raises:
        TypeError, ValueError: an invalid parameter, naming it.

    Examples:
        >>> engine = Engine(model, "auto", optimizer=opt)
        >>> Auto.choice(engine)             # "none", "powersgd-r4", ...
    """

    levels: Sequence[Compressor | str] | str = DEFAULT_LEVELS
    every: int = 50
    warmup: int = 5
    margin: float = 0.05
    eta: float = 0.5
    probe_bytes: int = 1 << 16
    clock: Callable[[], float] = field(default=time.perf_counter, compare=False, repr=False)
    spec_name: ClassVar[str] = "auto"
    spec_kinds: ClassVar[dict[str, str]] = {
        "levels": "str", "every": "int", "warmup": "int", "margin": "float", "eta": "float",
        "probe_bytes": "int"}

    def __post_init__(self) -> None:
        given = self.levels.split("|") if isinstance(self.levels, str) else self.levels
        if not isinstance(given, Sequence) or not given:
            raise ValueError(f"`levels` must be a non-empty sequence of compressors, got "
                             f"{self.levels!r}")
        built: list[Compressor] = []
        for item in given:
            if not isinstance(item, (str, Compressor)):
                raise TypeError(f"`levels` must hold compressors or spec strings, got {item!r}")
            level = compressor_from_spec(item.strip() if isinstance(item, str) else item)
            if type(level).spec_name in CONTROLLERS:
                raise TypeError(f"`levels` must hold plain compressors, not controllers, got "
                                f"{level.spec()!r}")
            built.append(level)
        specs = [lv.spec() for lv in built]
        if len(set(specs)) != len(specs):
            raise ValueError(f"`levels` must not repeat a level, got {specs}")
        object.__setattr__(self, "levels", tuple(built))
        check_int("every", self.every, minimum=1)
        check_int("warmup", self.warmup, minimum=0)
        check_real("margin", self.margin, low=0, high=1, high_open=True)
        check_real("eta", self.eta, low=0, low_open=True)
        check_int("probe_bytes", self.probe_bytes, minimum=8)
        if not callable(self.clock):
            raise TypeError(f"`clock` must be callable, got {self.clock!r}")
        object.__setattr__(self, "biased", any(lv.biased for lv in built))
        object.__setattr__(self, "_labels", level_qualities(specs))
        object.__setattr__(self, "_traffic", {})

    # -- identity --------------------------------------------------------------------------
    @classmethod
    def parse(cls, spec: str) -> Auto:
        """Rebuild from :meth:`spec` output (``"auto"`` alone: the defaults)."""
        if spec.strip() == cls.spec_name:
            return cls()
        return controller_from_spec(cls, spec)  # type: ignore[return-value]

    def spec(self) -> str:
        """A stable description, stored in checkpoints and compared on load."""
        return format_call(self.spec_name, {
            "levels": "|".join(lv.spec() for lv in self._levels), "every": self.every,
            "warmup": self.warmup, "margin": repr(self.margin), "eta": repr(self.eta),
            "probe_bytes": self.probe_bytes})

    @property
    def _levels(self) -> tuple[Compressor, ...]:
        return self.levels  # type: ignore[return-value]

    @property
    def labels(self) -> list[str]:
        """The levels' names (``"none"``, ``"powersgd-r4"``, ...), in order."""
        return list(self._labels)  # type: ignore[attr-defined]

    def quality(self, label: str) -> str:
        """The quality class of a level (see :data:`~gradzip.plan.candidates.QUALITIES`)."""
        return self._labels[label]  # type: ignore[attr-defined,no-any-return]

    def allowed(self, critical: bool) -> list[str]:
        """The levels the quality guard lets a decision choose, in order: all of them in a
        steady phase; in a critical one, all but the ``aggressive`` class (the first level
        alone where every level is aggressive). A first decision is always critical."""
        kept = [lb for lb in self.labels if not (critical and self.quality(lb) == "aggressive")]
        return kept or [self.labels[0]]

    # -- state -----------------------------------------------------------------------------
    def init_state(self, shapes: Mapping[str, torch.Size]) -> dict[str, Any]:
        return {"levels": {lb: lv.init_state(shapes) for lb, lv in zip(self.labels, self._levels,
                                                                        strict=True)},
                "controller": fresh_controller(shapes, self.labels, self.warmup)}

    def init_group_state(self, shapes: Mapping[str, torch.Size], world_size: int,
                         local_workers: int) -> dict[str, Any]:
        """:meth:`init_state`, each level's state made for the group (a level whose state
        depends on the group, such as a sharded quantiser's owner residuals, gets it here)."""
        state = self.init_state(shapes)
        for label, level in zip(self.labels, self._levels, strict=True):
            state["levels"][label] = level.init_group_state(shapes, world_size, local_workers)
        return state

    def check_state(self, state: Mapping[str, Any], *, fresh: Mapping[str, Any],
                    shapes: Mapping[str, torch.Size], workers: int) -> str | None:
        """The controller's values, then each level's own state."""
        found = auto_problem(state["controller"], self.labels)
        if found:
            return f"controller.{found}"
        for label, level in zip(self.labels, self._levels, strict=True):
            found = level.check_state(state["levels"][label], fresh=fresh["levels"][label],
                                      shapes=shapes, workers=workers)
            if found:
                return f"levels.{label}.{found}"
        return None

    # -- the step --------------------------------------------------------------------------
    def reduce(self, jobs: Sequence[Job], state: dict[str, Any], comm: Collective,
               ctx: StepContext) -> None:
        ctrl = state["controller"]
        unknown = [j.name for j in jobs if j.name not in ctrl["shapes"]]
        if unknown:
            raise ValueError(f"job names must be tensors given to init_state, got {unknown[:3]}")
        if ctrl["pending"]:
            device = jobs[0].tensor.device if jobs else torch.device("cpu")
            self._decide(ctrl, comm, ctx, device)
        label = ctrl["current"]
        level = self._levels[self.labels.index(label)]
        start, wire0 = self.clock(), comm.meter.wire[0]
        level.reduce(jobs, state["levels"][label], comm, ctx)
        ctrl["step_reduce"] += self.clock() - start
        ctrl["step_calls"] += 1
        ctrl["step_wire"] += comm.meter.wire[0] - wire0
        acc = dict(ctrl["acc"])
        for job in jobs:
            value = (job.raw if job.raw is not None else job.tensor).detach().to(torch.float32)
            old = acc.get(job.name)
            acc[job.name] = value.clone() if old is None else old + value
        ctrl["acc"] = acc

    def end_step(self, state: dict[str, Any], ctx: StepContext) -> None:
        ctrl = state["controller"]
        label = ctrl["current"]
        for lb, level in zip(self.labels, self._levels, strict=True):
            if lb == label:  # the others' states wait unchanged for their next turn
                level.end_step(state["levels"][lb], ctx)
        now = self.clock()
        if ctrl["last_end"] is not None and not ctrl["skip"]:
            period = now - ctrl["last_end"]
            if period > 0:
                ctrl["periods"] = ctrl["periods"] + [period]
                ctrl["reduces"] = ctrl["reduces"] + [ctrl["step_reduce"]]
                ctrl["calls"] = ctrl["calls"] + [ctrl["step_calls"]]
                ctrl["wires"] = ctrl["wires"] + [ctrl["step_wire"]]
        ctrl.update(last_end=now, skip=False, step_reduce=0.0, step_calls=0, step_wire=0)
        counts = dict(ctrl["counts"])
        steps = dict(counts["steps"])
        steps[label] += 1
        counts["steps"] = steps
        key = "critical_steps" if ctrl["critical"] else "steady_steps"
        counts[key] += len(ctrl["shapes"])
        ctrl["counts"] = counts
        ctrl["acc_steps"] += 1
        # last_lr and the step count change only here, so every call of a step sees the same
        # drop, and the drop is judged from ctx.lr, identical on every rank.
        if is_lr_drop(ctrl["last_lr"], ctx.lr):
            ctrl["dropped"] = True
            ctrl["pending"] = True
        if ctx.lr is not None:
            ctrl["last_lr"] = float(ctx.lr)
        ctrl["step"] += 1
        if ctrl["step"] >= ctrl["next"]:
            ctrl["pending"] = True

    # -- decisions -------------------------------------------------------------------------
    def traffic(self, shapes: Mapping[str, Sequence[int]], workers: int,
                store: TrafficCache | None = None) -> dict[str, Traffic]:
        """Each level's collective calls per step for these tensors among ``workers``,
        simulated once (cached on this object: a function of shapes and ``W`` only), or
        read from ``store``, a cache on disk that a run gives to skip the simulations
        another run on the machine made (and written there)."""
        key = (tuple((n, tuple(s)) for n, s in sorted(shapes.items())), workers)
        cache: dict[Any, dict[str, Traffic]] = self._traffic  # type: ignore[attr-defined]
        if key not in cache:
            plain = {n: tuple(s) for n, s in shapes.items()}
            cache[key] = {lb: stored_or_simulated(lv.spec(), workers, plain, store)
                          for lb, lv in zip(self.labels, self._levels, strict=True)}
        return cache[key]

    def first_decision(self, shapes: Mapping[str, Sequence[int]], comm: Collective, *,
                       ranks: Sequence[int], device: torch.device | None = None,
                       compute_s: float | None = None,
                       overhead_s: Mapping[str, float] | None = None,
                       link: tuple[float, float] | None = None,
                       lined_up: bool = False) -> dict[str, Any]:
        """The decision record a first decision before step 0 makes (``warmup=0``: the link
        probed, no step timed), taken on a scratch controller: no state changes.

        A caller that acts on it before the first step (``gradzip train --auto-outer
        --auto-outer-early`` starting outer steps at step 0) calls this on every rank: the
        probe and the maximum over ranks are collectives, and the record, built from those
        maxima, is the same on every rank.

        Args:
            shapes: the trained tensors' shapes.
            comm: the group (its meter counts the probes).
            ranks: global ranks of the local workers (the record is logged by rank 0's).
            device: where the probes run (``None``: the CPU).
            compute_s: this process's compute seconds per step, timed by the caller (for
                example one forward and backward pass, as ``gradzip train`` times it; the
                maximum over the ranks is taken with the other inputs); ``None``: compute is
                priced at a floor (a nanosecond) and the levels compared by link time alone.
            overhead_s: this process's compression seconds per step of each level, by label
                (every level; for example from
                :func:`~gradzip.plan.timing.measure_compress_seconds`, as ``gradzip train``
                measures them), added to each level's predicted step time as the overhead
                a running level learns; the maxima over the ranks are taken with one more
                all-reduce of ``len(levels)`` floats per rank. ``None``: every level's
                overhead is unknown (0).
            link: ``(bandwidth_mbit, rtt_ms)`` already measured on this group, for example
                an earlier record's (maxima over the ranks: the same on every rank), to
                decide on without probing again; ``None``: the link is probed.
            lined_up: the caller's last collective on ``comm`` returned just before this
                call on every rank (no work in between), so the probe needs no untimed
                call of its own to line the ranks up (see
                :func:`~gradzip.plan.measure.probe_link`). Must be the same on every rank.

        Returns:
            The record, as :meth:`decisions` returns them (numbered 0, ``step`` 0).

        Raises:
            TypeError: ``comm`` is not a Collective, ``compute_s`` or an overhead not a
                real number, or ``lined_up`` not a bool.
            ValueError: ``shapes`` empty or not a mapping of shapes, ``ranks`` not one
                rank per local worker of ``comm``, ``compute_s`` or an overhead negative or
                not finite, ``overhead_s`` not keyed by exactly the levels' labels, or
                ``link`` not a pair of a bandwidth > 0 and a round trip >= 0.
        """
        if not isinstance(comm, Collective):
            raise TypeError(f"`comm` must be a Collective, got {type(comm).__name__}")
        if not isinstance(lined_up, bool):
            raise TypeError(f"`lined_up` must be a bool, got {type(lined_up).__name__}")
        if (not isinstance(shapes, Mapping) or not shapes
                or any(not isinstance(s, Sequence) for s in shapes.values())):
            raise ValueError(f"`shapes` must map tensor names to shapes, at least one, got "
                             f"{shapes!r}")
        ranks = list(ranks)
        if len(ranks) != comm.local_workers or any(not isinstance(r, int) for r in ranks):
            raise ValueError(f"`ranks` must hold one int per local worker of `comm` "
                             f"({comm.local_workers}), got {ranks!r}")
        if compute_s is not None:
            check_real("compute_s", compute_s, low=0)
        if overhead_s is not None:
            if not isinstance(overhead_s, Mapping) or set(overhead_s) != set(self.labels):
                raise ValueError(f"`overhead_s` must map every level label {self.labels} to "
                                 f"seconds, got {overhead_s!r}")
            for label in self.labels:
                check_real(f"overhead_s[{label!r}]", overhead_s[label], low=0)
        if link is not None:
            if not isinstance(link, (tuple, list)) or len(link) != 2:
                raise ValueError(f"`link` must be a pair (bandwidth_mbit, rtt_ms), got {link!r}")
            check_real("link[0] (bandwidth_mbit)", link[0], low=0, low_open=True)
            check_real("link[1] (rtt_ms)", link[1], low=0)
            link = (float(link[0]), float(link[1]))
        device = device if device is not None else torch.device("cpu")
        ctrl = fresh_controller({n: torch.Size(s) for n, s in shapes.items()}, self.labels, 0)
        if compute_s is not None:  # one step's compute, none of it in reduce
            ctrl.update(periods=[float(compute_s)], reduces=[0.0])
        if overhead_s is not None:
            # The decision must read the same numbers on every rank: the maxima, as for the
            # inputs _decide aggregates itself.
            most = max_over_ranks(comm, [overhead_s[lb] for lb in self.labels], device)
            ctrl.update(overhead=dict(zip(self.labels, most, strict=True)))
        ctx = StepContext(step=0, ranks=tuple(ranks), world_size=comm.world_size)
        # Not logged: nothing is applied here, and the caller says what it did with it.
        self._decide(ctrl, comm, ctx, device, announce=False, link=link, lined_up=lined_up)
        return dict(ctrl["log"][-1])

    def _decide(self, ctrl: dict[str, Any], comm: Collective, ctx: StepContext,
                device: torch.device, announce: bool = True,
                link: tuple[float, float] | None = None, lined_up: bool = False) -> None:
        """Probe (unless ``link`` is known), aggregate over ranks, predict every level,
        choose; applies from this step (``announce``: log the decision's line;
        ``lined_up``: see :meth:`first_decision`)."""
        if link is None:
            dense = 4 * sum(math.prod(s) for s in ctrl["shapes"].values())
            probes = probe_link(comm, self.probe_bytes, self.clock, device, limit_bytes=dense,
                                lined_up=lined_up)
        else:
            probes = []
        fitted = probes[:1] + probes[-2:] if len(probes) > 2 else probes  # what fit_probe reads
        current = ctrl["current"]
        reduces = ctrl["reduces"]
        compute = median([p - r for p, r in zip(ctrl["periods"], reduces, strict=True)])
        mean_norm = _mean_norm(ctrl["acc"], ctrl["acc_steps"], comm.local_workers)
        times = [t for _, t in fitted] + [0.0] * (3 - len(fitted))  # always three floats
        mine = [max(compute, 0.0), median(reduces), *times, median(ctrl["calls"]) or 1.0,
                median(ctrl["wires"]), mean_norm]
        # Every rank must take the same decision (the next step's collectives depend on the
        # level), so the decision reads only these maxima over the ranks, identical on every
        # rank, never a rank's own clock (the norm too: each worker's own gradient differs).
        compute, reduce_s, *most, calls, wire, norm = max_over_ranks(comm, mine, device)
        # Whether whole steps were timed since the last decision: from the step count, the
        # same on every rank (a rank's own sample list could differ), so all take one branch.
        sampled = ctrl["acc_steps"] > 1
        if not sampled and ctrl["last_compute"] is not None:
            compute = ctrl["last_compute"]  # e.g. a decision brought forward by an LR drop
        workers = comm.world_size
        bandwidth, rtt = link if link is not None else fit_probe(
            [(w, t) for (w, _), t in zip(fitted, most[:len(fitted)], strict=True)],
            2 * (workers - 1))
        # Before any whole step was timed (a first decision at step 1) compute is unknown:
        # a floor of a nanosecond keeps the model defined and compares the levels by link time.
        setting = Setting(workers, bandwidth, rtt, max(compute * 1e3, 1e-6),
                          buckets=max(1, round(calls)),
                          overlap=False)
        traffic = self.traffic(ctrl["shapes"], workers)
        overhead = dict(ctrl["overhead"])
        base = {lb: predict_candidate(_candidate(lb), traffic[lb], setting, None)
                for lb in self.labels}
        if sampled:  # what the current level spent in reduce beyond its predicted link time
            overhead[current] = max(0.0, reduce_s - base[current].comm_ms / 1e3)
        # A level not run yet is assumed to cost what the current one does beyond the link
        # (neither favoured nor penalised for being unmeasured); once run, its own is known.
        unknown = overhead[current] or 0.0
        predicted = {lb: p.step_ms / 1e3 + (unknown if overhead[lb] is None else overhead[lb])
                     for lb, p in base.items()}
        decision = decide(ctrl["prev_norm"], norm, self.eta, lr_dropped=ctrl["dropped"])
        choice = pick(predicted, self.allowed(decision.critical), current, self.margin)
        rec = {"decision": ctrl["counts"]["decisions"], "step": ctx.step, "name": "model",
               "level": choice, "previous": current, "critical": decision.critical,
               "reason": decision.reason, "rel_change": decision.rel_change, "norm": norm,
               "compute_ms": compute * 1e3, "reduce_ms": reduce_s * 1e3, "calls": calls,
               "wire_bytes": wire, "bandwidth_mbit": bandwidth, "rtt_ms": rtt,
               "predicted_ms": {lb: v * 1e3 for lb, v in predicted.items()},
               "gain": 1 - predicted[choice] / predicted[current]}
        counts = dict(ctrl["counts"])
        counts["decisions"] += 1
        counts["switches"] += int(choice != current)
        counts["critical"] += int(decision.critical)
        reasons = dict(counts["reasons"])
        reasons[decision.reason] = reasons.get(decision.reason, 0) + 1
        counts["reasons"] = reasons
        kept = [r for r in ctrl["log"] if r["decision"] > rec["decision"] - LOG_POINTS]
        ctrl.update(current=choice, overhead=overhead, last_compute=compute if sampled else
                    ctrl["last_compute"], counts=counts, log=kept + [rec],
                    # A decision before any step saw no gradient: the next compares with nothing.
                    prev_norm=norm if ctrl["acc_steps"] else ctrl["prev_norm"],
                    acc={n: None for n in ctrl["acc"]}, acc_steps=0, dropped=False, pending=False,
                    critical=decision.critical, periods=[], reduces=[], calls=[], wires=[],
                    skip=True, next=ctrl["step"] + self.every)
        if announce and 0 in ctx.ranks:  # one line per decision from one worker: what and why
            log.log(logging.INFO if choice != current else logging.DEBUG,
                    "auto: step %d: %s -> %s, predicted %.1f ms/step against %.1f "
                    "(compute %.1f ms, link %.1f Mbit/s, rtt %.2f ms, %s phase: %s)",
                    ctx.step, current, choice, predicted[choice] * 1e3,
                    predicted[current] * 1e3, compute * 1e3, bandwidth, rtt,
                    "critical" if decision.critical else "steady", decision.reason)

    # -- observability ---------------------------------------------------------------------
    @staticmethod
    def choice(state: Any) -> str:
        """The level of the next step (``state``: ``engine.compressor_state`` or an engine)."""
        return str(_controller(state)["current"])

    def report(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """``levels`` (every tensor's level name), ``counts`` and the current ``choice``."""
        ctrl = state["controller"]
        counts = Auto.counts(state)
        return {"levels": {n: ctrl["current"] for n in ctrl["shapes"]}, "counts": counts,
                "choice": ctrl["current"]}

    @staticmethod
    def counts(state: Any) -> dict[str, Any]:
        """Cumulative counts: ``decisions``, ``switches``, ``critical`` decisions, steps run
        at each level (``steps``), tensor-steps in critical and steady phases, reasons."""
        counts = _controller(state)["counts"]
        return {**counts, "steps": dict(counts["steps"]), "reasons": dict(counts["reasons"])}

    @staticmethod
    def decisions(state: Any, since: int | None = None) -> list[dict[str, Any]]:
        """Decision records (numbered from 0), oldest first; ``since``: those numbered
        ``since`` and later (``None``: the latest). Each holds the ``step`` it applies
        from, the measured inputs (``compute_ms``, ``reduce_ms``, ``calls``, ``wire_bytes``,
        ``bandwidth_mbit``, ``rtt_ms``, ``norm``), ``predicted_ms`` per level, the
        ``previous`` level and the chosen ``level``, ``critical``, ``reason`` and the
        predicted ``gain`` over staying."""
        records = _controller(state)["log"]
        if since is None:
            since = max((r["decision"] for r in records), default=0)
        return [dict(r) for r in records if r["decision"] >= since]


def _controller(state: Any) -> dict[str, Any]:
    if hasattr(state, "compressor_state"):
        state = state.compressor_state
    if not isinstance(state, Mapping) or not isinstance(state.get("controller"), dict):
        raise TypeError("`state` must be an Auto compressor state (engine.compressor_state) "
                        f"or an engine using Auto, got {type(state).__name__}")
    return state["controller"]


def _mean_norm(acc: Mapping[str, torch.Tensor | None], steps: int, workers: int) -> float:
    """The largest, over the local workers, norm of a worker's mean gradient (all tensors
    together, float64) over ``steps`` steps; 0.0 before any step."""
    if not steps:
        return 0.0
    sq = torch.zeros(workers, dtype=torch.float64)
    for name in sorted(acc):
        t = acc[name]
        if t is not None:
            sq += (torch.linalg.vector_norm(t.reshape(workers, -1).to(torch.float64), dim=1)
                   / steps).cpu() ** 2
    return float(sq.sqrt().max())


def _candidate(label: str) -> Candidate:
    """A per-step candidate named ``label`` (the model reads only that it is per step)."""
    return Candidate(label, "none", "lossless")
