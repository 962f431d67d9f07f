"""Whether to leave per-step communication for outer-step training, from a decision of
:class:`~gradzip.plan.auto.Auto`.

:func:`outer_switch` reads one of Auto's decision records (its measured inputs are already
the maxima over every rank, so every rank computes the same answer from it) and weighs the
outer-step candidates (``H`` local steps between exchanges, the outer settings from
:func:`~gradzip.outer_defaults`) against the per-step level Auto just chose, with the same
cost model. It proposes a switch only when the phase is past the critical regime (Auto's
guard said ``critical: False``) and the best outer-step candidate is predicted faster by
the hysteresis margin; with ``early``, the first decision, critical only because no earlier
interval exists to compare with, may switch too (a learning-rate drop or a change of the
gradient's norm still forbids it). It decides; carrying the switch out (the exchange of parameters and
the construction of the outer loop) belongs to the caller, as ``gradzip train --auto-outer``
does (:mod:`gradzip.train.auto_outer`).

The per-step level is priced from link and compute plus the compression overhead Auto
measured for it (read from its own prediction in the record); the outer candidates from link
and compute, plus, for a compressed exchange (an 8-bit one, ``scatterq:bits=8``), its
compression time per exchange where the caller measured it (``candidate_overhead_s``). The
candidates are ranked by time per step times their step cost (:mod:`gradzip.plan.step_cost`:
what a step at their ``H`` is worth against ``H = 10``, measured on two tasks), and the
cheapest is taken, or the candidate in force (``keep``) while it lies within the margin of the
cheapest. (A dense exchange is not preferred to a compressed one of near price: the quality
an 8-bit exchange with error feedback costs is not priced, and preferring the dense one could
leave per-step training where the compressed one gains the margin.) The switch itself is weighed in time: the
chosen candidate must be predicted faster per step than the per-step level by the margin.

:func:`outer_switch_bound` weighs the candidates against the cheapest of several levels: given
a record that prices the levels without their compression, a lower bound on the gain, enough
to decide a switch before any compression was measured.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gradzip._validate import check_int, check_real
from gradzip.plan.candidates import Candidate
from gradzip.plan.model import Setting, predict_candidate
from gradzip.plan.step_cost import outer_step_cost
from gradzip.plan.traffic import Traffic, measure_traffic

__all__ = ["OUTER_CANDIDATES", "outer_switch", "outer_switch_bound"]

#: The outer-step candidates weighed by default: DiLoCo's dense exchange at H = 10, 30, 100.
OUTER_CANDIDATES = tuple(Candidate(f"diloco-h{h}", "none", "outer", h) for h in (10, 30, 100))

_NEEDED = ("critical", "level", "compute_ms", "bandwidth_mbit", "rtt_ms", "calls", "step")


def outer_switch(record: Mapping[str, Any], level_spec: str, shapes: Mapping[str, Sequence[int]],
                 workers: int, *, margin: float,
                 candidates: Sequence[Candidate] = OUTER_CANDIDATES,
                 bandwidth_mbit: float | None = None,
                 traffic: Mapping[str, Traffic] | None = None,
                 early: bool = False,
                 candidate_overhead_s: Mapping[str, float] | None = None,
                 step_cost: Callable[[int], float] = outer_step_cost,
                 keep: str | None = None) -> dict[str, Any]:
    """Weigh outer-step training against the per-step level of one Auto decision.

    Args:
        record: one record of :meth:`Auto.decisions <gradzip.plan.auto.Auto.decisions>`
            (``critical``, ``level``, ``compute_ms``, ``bandwidth_mbit``, ``rtt_ms``,
            ``calls``, ``step`` are read).
        level_spec: the compressor spec of the record's chosen ``level``.
        shapes: the trained tensors' shapes.
        workers: ``W`` (>= 2).
        margin: the fraction a switch must gain, in [0, 1).
        candidates: the outer-step candidates (quality ``"outer"``), at least one.
        bandwidth_mbit: a link bandwidth to use instead of the measured one (> 0), e.g. a
            known link the probe cannot see; ``None``: the record's.
        traffic: each spec's simulated traffic among ``workers`` for ``shapes``
            (:func:`~gradzip.plan.traffic.measure_traffic`), where the caller has it (e.g.
            :meth:`Auto.traffic <gradzip.plan.auto.Auto.traffic>`'s, keyed by spec): a spec
            found there is not simulated again (a simulation of a large model takes
            seconds); ``None``: every spec is simulated.
        early: whether a decision that is critical only for being the first (reason
            ``"first"``: no previous interval's norm to compare with) may switch. Outer steps
            from the start of training are what DiLoCo runs; the guard's start-of-training
            assumption is waived for them, not its measured signals.
        candidate_overhead_s: compression seconds of one exchange by candidate spec (for
            example from :func:`~gradzip.plan.timing.measure_compress_seconds`; the same on
            every rank, such as maxima over the ranks), added to a candidate's exchange; a
            spec not found there (``None``: any) is priced without compression, as the dense
            exchange (``none``) is.
        step_cost: ``H ->`` what a step at that ``H`` costs in progress against ``H = 10``
            (:func:`~gradzip.plan.step_cost.outer_step_cost`, measured); candidates are
            ranked by time per step times it. ``lambda h: 1.0`` ranks by time alone.
        keep: the name of the candidate in force, if any (``--auto-outer-follow``): it is
            chosen while its price lies within ``margin`` of the cheapest.

    Returns:
        The switch record: ``switch`` (bool), ``step``, ``reason``, the inputs
        (``compute_ms``, ``bandwidth_mbit``, ``rtt_ms``, ``calls``, ``critical``), the
        per-step ``level``, ``predicted_ms`` of it and of every candidate (time per step),
        each candidate's ``step_cost``, the best ``candidate`` with its ``outer_steps``,
        ``outer_lr``, ``outer_momentum`` and ``exchange`` (its compressor spec), and the
        predicted ``gain`` in time per step of the best candidate over staying.

    Raises:
        TypeError, ValueError: an invalid parameter, naming it.
    """
    if not isinstance(record, Mapping) or any(k not in record for k in _NEEDED):
        raise ValueError(f"`record` must be an Auto decision record with keys {list(_NEEDED)}, "
                         f"got {record!r}")
    check_int("workers", workers, minimum=2)
    check_real("margin", margin, low=0, high=1, high_open=True)
    if not candidates or any(not isinstance(c, Candidate) or not c.outer_steps
                             for c in candidates):
        raise ValueError(f"`candidates` must be a non-empty sequence of outer-step Candidates, "
                         f"got {candidates!r}")
    if not isinstance(early, bool):
        raise TypeError(f"`early` must be a bool, got {early!r}")
    if bandwidth_mbit is not None:
        check_real("bandwidth_mbit", bandwidth_mbit, low=0, low_open=True)
    if traffic is not None and (not isinstance(traffic, Mapping) or any(
            not isinstance(t, Traffic) or t.workers != workers for t in traffic.values())):
        raise ValueError(f"`traffic` must map specs to Traffic among {workers} workers, got "
                         f"{traffic!r}")
    costs = _candidate_costs(candidate_overhead_s)
    bandwidth = float(record["bandwidth_mbit"] if bandwidth_mbit is None else bandwidth_mbit)
    # The record's numbers are maxima over the ranks (Auto aggregates them before deciding),
    # so every rank builds the same setting and takes the same branch below: the switch
    # changes which collectives run next, and a split decision would deadlock them.
    setting = Setting(workers, bandwidth, float(record["rtt_ms"]),
                      max(float(record["compute_ms"]), 1e-6),
                      buckets=max(1, round(float(record["calls"]))), overlap=False)
    plain = {n: tuple(int(d) for d in s) for n, s in shapes.items()}
    known = dict(traffic or {})

    def traffic_of(spec: str) -> Traffic:
        if spec not in known:
            known[spec] = measure_traffic(spec, workers, shapes=plain)
        return known[spec]

    level = str(record["level"])
    here = Candidate(level, level_spec, "lossless")
    stay_ms = predict_candidate(here, traffic_of(level_spec), setting, None).step_ms
    own = record.get("predicted_ms")
    if isinstance(own, Mapping) and isinstance(own.get(level), (int, float)):
        # Auto's own prediction of its level holds the level's measured compression overhead
        # (time in reduce beyond the link's share), which link and compute alone leave out:
        # that overhead, found at the record's link, is added to the per-step price. It is
        # read from the record, identical on every rank.
        at_record = dataclasses.replace(setting, bandwidth_mbit=float(record["bandwidth_mbit"]))
        overhead = float(own[level]) - predict_candidate(here, traffic_of(level_spec),
                                                         at_record, None).step_ms
        stay_ms += max(0.0, overhead)
    outer = {c.name: predict_candidate(c, traffic_of(c.spec), setting, costs.get(c.spec))
             for c in candidates}
    # A larger H synchronises less often, so each of its steps is worth less: the candidates
    # are ranked by time per step times their step cost against H = 10
    # (gradzip.plan.step_cost, measured). ``gain`` stays a gain in time: no step cost of
    # per-step training against H = 10 was measured (it is at most 1), so switching is
    # weighed as before, for the candidate so chosen.
    cost = {c.name: step_cost(c.outer_steps) for c in candidates}
    priced = {n: outer[n].step_ms * cost[n] for n in outer}
    # The cheapest (the first listed on a tie). Hysteresis: the candidate in force stays while
    # within the margin of the cheapest, so prices that wobble between near-equal candidates
    # do not move H back and forth.
    best = min(candidates, key=lambda c: priced[c.name])
    kept = [c for c in candidates if c.name == keep]
    if kept and priced[kept[0].name] <= priced[best.name] * (1 + margin):
        best = kept[0]
    gain = 1 - outer[best.name].step_ms / stay_ms
    waived = early and record.get("reason") == "first"
    if record["critical"] and not waived:
        switch, reason = False, "critical"
    elif gain < margin:
        switch, reason = False, "no gain"
    else:
        switch, reason = True, "first and faster" if record["critical"] else "steady and faster"
    return {"switch": switch, "step": int(record["step"]), "reason": reason,
            "critical": bool(record["critical"]), "compute_ms": setting.step_ms,
            "bandwidth_mbit": bandwidth, "rtt_ms": setting.rtt_ms, "calls": setting.buckets,
            "level": level,
            "predicted_ms": {level: stay_ms,
                             **{n: p.step_ms for n, p in outer.items()}},
            "step_cost": cost,
            "candidate": best.name, "outer_steps": best.outer_steps,
            "outer_lr": best.outer_lr, "outer_momentum": best.outer_momentum,
            "exchange": best.spec, "gain": gain}


def _candidate_costs(given: Mapping[str, float] | None) -> dict[str, float]:
    """``candidate_overhead_s`` checked: spec -> seconds >= 0."""
    if given is None:
        return {}
    if not isinstance(given, Mapping) or any(not isinstance(k, str) for k in given):
        raise ValueError(f"`candidate_overhead_s` must map exchange specs to seconds, got "
                         f"{given!r}")
    return {spec: check_real(f"candidate_overhead_s[{spec!r}]", seconds, low=0)
            for spec, seconds in given.items()}


def outer_switch_bound(record: Mapping[str, Any], level_specs: Mapping[str, str],
                       shapes: Mapping[str, Sequence[int]], workers: int, *, margin: float,
                       **options: Any) -> dict[str, Any]:
    """:func:`outer_switch` against the cheapest of several per-step levels: the verdict of
    the level :func:`outer_switch` prices lowest (the smallest ``gain``; the first on a tie).

    With a record that prices its levels without compression cost (an Auto first decision
    taken without ``overhead_s``) and the levels that decision may choose, this verdict is a
    bound: compression only adds to a per-step price, and the candidates' prices and choice
    read link, compute and the candidates' own compression (``candidate_overhead_s``, given
    alike to both) alone. So where it says switch, the record of the same inputs with
    each level's measured compression says switch too, at the same candidate, with at least
    this gain; the compression need not be measured. ``gradzip train --auto-outer`` decides
    this way before step 0 (:mod:`gradzip.train.auto_outer`).

    Args:
        record: an Auto decision record whose ``predicted_ms`` prices every level named in
            ``level_specs`` (its ``level`` is replaced by each in turn).
        level_specs: ``label -> compressor spec`` of the levels to weigh, at least one.
        shapes: the trained tensors' shapes, as for :func:`outer_switch`.
        workers: ``W`` (>= 2), as for :func:`outer_switch`.
        margin: the fraction a switch must gain, in [0, 1).
        **options: :func:`outer_switch`'s other keyword arguments (``candidates``,
            ``bandwidth_mbit``, ``traffic``, ``early``, ``candidate_overhead_s``: the
            candidates are priced as there, so the bound holds with compressed exchanges
            too).

    Returns:
        The switch record of the cheapest level, as :func:`outer_switch` returns it.

    Raises:
        TypeError, ValueError: an invalid parameter, naming it.
    """
    if not isinstance(level_specs, Mapping) or not level_specs or any(
            not isinstance(k, str) or not isinstance(v, str) for k, v in level_specs.items()):
        raise ValueError(f"`level_specs` must map level labels to compressor specs, at least "
                         f"one, got {level_specs!r}")
    verdicts = [outer_switch({**record, "level": label}, spec, shapes, workers, margin=margin,
                             **options) for label, spec in level_specs.items()]
    return min(verdicts, key=lambda v: v["gain"])
