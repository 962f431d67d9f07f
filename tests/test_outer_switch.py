"""Auto's per-step -> outer-step switch rule: decided from Auto's own records (scripted clock)."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gradzip import Auto
from gradzip.comm import SimulatedGroup
from gradzip.plan.candidates import Candidate
from gradzip.plan.switch import OUTER_CANDIDATES, outer_switch, outer_switch_bound
from gradzip.plan.traffic import measure_traffic
from test_auto import SHAPES, WORLD, LinkClock, drive


def _spec(engine: object, label: str) -> str:
    auto = engine.compressor  # type: ignore[attr-defined]
    return str(auto._levels[auto.labels.index(label)].spec())


def _timed(h: int) -> float:
    """A step cost of 1 at every H: candidates ranked by time alone."""
    return 1.0


def test_slow_link_switches_only_after_the_critical_phase() -> None:
    engine = drive(LinkClock(10, 1e-3), 60)
    first, second = Auto.decisions(engine, since=0)
    got = [outer_switch(r, _spec(engine, r["level"]), SHAPES, WORLD, margin=0.05,
                        step_cost=_timed) for r in (first, second)]
    # Step 5 is the first decision, critical by rule: no switch whatever the gain.
    assert (got[0]["switch"], got[0]["reason"], got[0]["step"]) == (False, "critical", 5)
    assert got[0]["gain"] > 0.05
    # Step 55 is steady and 10 Mbit/s makes a dense exchange every H steps the cheapest.
    assert (got[1]["switch"], got[1]["reason"], got[1]["step"]) == (True, "steady and faster", 55)
    assert got[1]["level"] == "topk-1%" and got[1]["candidate"] == "diloco-h100"
    assert (got[1]["outer_steps"], got[1]["outer_lr"], got[1]["outer_momentum"]) == (
        100, OUTER_CANDIDATES[2].outer_lr, OUTER_CANDIDATES[2].outer_momentum)
    pred = got[1]["predicted_ms"]
    assert set(pred) == {"topk-1%", "diloco-h10", "diloco-h30", "diloco-h100"}
    assert got[1]["gain"] == pytest.approx(1 - pred["diloco-h100"] / pred["topk-1%"])
    assert got[1]["bandwidth_mbit"] == pytest.approx(10, rel=1e-6)
    # With the measured step costs (H = 30: 1.15, H = 100: 1.34), H = 100's 12% less time per
    # step is worth less than its rarer synchronisation costs: H = 30 ranks first, and it is
    # too little faster than the per-step level (4%) to switch.
    costed = outer_switch(second, _spec(engine, second["level"]), SHAPES, WORLD, margin=0.05)
    assert costed["step_cost"] == {"diloco-h10": 1.0, "diloco-h30": pytest.approx(1.15),
                                   "diloco-h100": pytest.approx(1.34)}
    assert costed["predicted_ms"] == pred
    assert (costed["candidate"], costed["switch"], costed["reason"]) == (
        "diloco-h30", False, "no gain")
    assert costed["gain"] == pytest.approx(1 - pred["diloco-h30"] / pred["topk-1%"])


def test_early_waives_only_the_start_of_training() -> None:
    engine = drive(LinkClock(10, 1e-3), 60)
    first = Auto.decisions(engine, since=0)[0]
    spec = _spec(engine, first["level"])
    assert (first["critical"], first["reason"]) == (True, "first")
    got = outer_switch(first, spec, SHAPES, WORLD, margin=0.05, early=True, step_cost=_timed)
    assert (got["switch"], got["reason"], got["critical"]) == (True, "first and faster", True)
    # The same prices as without it: only the verdict changes.
    plain = outer_switch(first, spec, SHAPES, WORLD, margin=0.05, step_cost=_timed)
    assert {k: v for k, v in got.items() if k not in {"switch", "reason"}} == {
        k: v for k, v in plain.items() if k not in {"switch", "reason"}}
    # A measured critical signal still forbids it: a norm change, a learning-rate drop.
    for reason in ("norm_change", "lr_drop"):
        kept = outer_switch({**first, "reason": reason}, spec, SHAPES, WORLD, margin=0.05,
                            early=True)
        assert (kept["switch"], kept["reason"]) == (False, "critical")
    # And a first decision that gains too little (compute dwarfs the link) does not switch.
    far = outer_switch({**first, "compute_ms": 1e9, "predicted_ms": {}}, spec, SHAPES, WORLD,
                       margin=0.05, early=True)
    assert (far["switch"], far["reason"]) == (False, "no gain")
    with pytest.raises(TypeError, match="`early` must be a bool, got 1"):
        outer_switch(first, spec, SHAPES, WORLD, margin=0.05, early=1)  # type: ignore[arg-type]


def test_known_traffic_is_used_and_gives_the_same_verdict() -> None:
    engine = drive(LinkClock(10, 1e-3), 60)
    record = Auto.decisions(engine)[-1]
    spec = _spec(engine, record["level"])
    fresh = outer_switch(record, spec, SHAPES, WORLD, margin=0.05)
    auto = engine.compressor  # type: ignore[attr-defined]
    by_label = auto.traffic(SHAPES, WORLD)
    known = {lv.spec(): by_label[lb] for lb, lv in zip(auto.labels, auto._levels, strict=True)}
    assert outer_switch(record, spec, SHAPES, WORLD, margin=0.05, traffic=known) == fresh
    # What is given is what is priced: the level's traffic read from the mapping.
    doubled = {**known, spec: measure_traffic("none", WORLD, shapes=SHAPES)}
    other = outer_switch(record, spec, SHAPES, WORLD, margin=0.05, traffic=doubled)
    assert other["predicted_ms"][record["level"]] != fresh["predicted_ms"][record["level"]]
    with pytest.raises(ValueError, match="`traffic` must map specs to Traffic among 4 workers"):
        outer_switch(record, spec, SHAPES, WORLD, margin=0.05,
                     traffic={"none": measure_traffic("none", 3, shapes=SHAPES)})


def test_fast_link_stays_per_step() -> None:
    engine = drive(LinkClock(100_000, 1e-5), 60)
    record = Auto.decisions(engine)[0]
    got = outer_switch(record, _spec(engine, record["level"]), SHAPES, WORLD, margin=0.05)
    assert not record["critical"] and record["level"] == "none"
    assert (got["switch"], got["reason"]) == (False, "no gain") and got["gain"] < 0.05


def test_given_bandwidth_overrides_the_probe() -> None:
    engine = drive(LinkClock(100_000, 1e-5), 60)
    record = Auto.decisions(engine)[0]
    got = outer_switch(record, "none", SHAPES, WORLD, margin=0.05, bandwidth_mbit=0.1)
    assert got["switch"] and got["bandwidth_mbit"] == 0.1 and got["gain"] > 0.9


def test_invalid_arguments_are_named() -> None:
    engine = drive(LinkClock(10, 1e-3), 6)
    record = Auto.decisions(engine)[0]
    with pytest.raises(ValueError, match="`record`"):
        outer_switch({"step": 1}, "none", SHAPES, WORLD, margin=0.05)
    with pytest.raises(ValueError, match="`workers`"):
        outer_switch(record, "none", SHAPES, 1, margin=0.05)
    with pytest.raises(ValueError, match="`margin`"):
        outer_switch(record, "none", SHAPES, WORLD, margin=1.0)
    with pytest.raises(ValueError, match="`bandwidth_mbit`"):
        outer_switch(record, "none", SHAPES, WORLD, margin=0.05, bandwidth_mbit=0.0)
    with pytest.raises(ValueError, match="`candidates`"):
        outer_switch(record, "none", SHAPES, WORLD, margin=0.05,
                     candidates=[Candidate("none", "none", "lossless")])


def _steady(record: dict, **changes: object) -> dict:
    return {**record, "critical": False, **changes}


def test_the_cheapest_is_taken_and_the_candidate_in_force_kept_within_the_margin() -> None:
    engine = drive(LinkClock(10, 1e-3), 60)
    record = Auto.decisions(engine)[-1]
    spec = _spec(engine, record["level"])
    # Compute dominating a dense exchange every 10 steps: every H within 5% of the fastest
    # (H = 100) by time.
    slow_compute = _steady(record, compute_ms=1e5)
    got = outer_switch(slow_compute, spec, SHAPES, WORLD, margin=0.05, bandwidth_mbit=1e3,
                       step_cost=_timed)
    pred = got["predicted_ms"]
    assert pred["diloco-h10"] <= 1.05 * pred["diloco-h100"] and pred["diloco-h100"] < pred[
        "diloco-h10"]
    # By time alone the fastest; with the step costs H = 10 (the others' few microseconds
    # less per step do not pay for their rarer synchronisation).
    assert (got["candidate"], got["outer_steps"]) == ("diloco-h100", 100)
    assert outer_switch(slow_compute, spec, SHAPES, WORLD, margin=0.05,
                        bandwidth_mbit=1e3)["candidate"] == "diloco-h10"
    # The candidate in force stays while within the margin of the cheapest ...
    for keep in ("diloco-h10", "diloco-h30"):
        assert outer_switch(slow_compute, spec, SHAPES, WORLD, margin=0.05, bandwidth_mbit=1e3,
                            step_cost=_timed, keep=keep)["candidate"] == keep
    # ... and not beyond it: on the slow link H = 10 costs far more than H = 100.
    slow_link = _steady(record)
    far = outer_switch(slow_link, spec, SHAPES, WORLD, margin=0.05, step_cost=_timed,
                       keep="diloco-h10")
    assert far["predicted_ms"]["diloco-h10"] > 1.05 * far["predicted_ms"]["diloco-h100"]
    assert far["candidate"] == "diloco-h100"
    # A name that is not a candidate keeps nothing.
    assert outer_switch(slow_compute, spec, SHAPES, WORLD, margin=0.05, bandwidth_mbit=1e3,
                        step_cost=_timed, keep="diloco-h7")["candidate"] == "diloco-h100"


def test_the_levels_measured_overhead_is_in_the_per_step_price() -> None:
    engine = drive(LinkClock(10, 1e-3), 60)
    record = Auto.decisions(engine)[-1]
    level, spec = record["level"], _spec(engine, record["level"])
    bare = {k: v for k, v in record.items() if k != "predicted_ms"}
    base = outer_switch(bare, spec, SHAPES, WORLD, margin=0.05)["predicted_ms"][level]
    # Auto's record says the level costs 40 ms more than the link and compute alone.
    priced = {**record, "predicted_ms": {**record["predicted_ms"], level: base + 40.0}}
    got = outer_switch(priced, spec, SHAPES, WORLD, margin=0.05)
    assert got["predicted_ms"][level] == pytest.approx(base + 40.0)
    # The overhead found at the record's link is kept at another link.
    other = outer_switch(bare, spec, SHAPES, WORLD, margin=0.05, bandwidth_mbit=100.0)
    moved = outer_switch(priced, spec, SHAPES, WORLD, margin=0.05, bandwidth_mbit=100.0)
    assert moved["predicted_ms"][level] == pytest.approx(other["predicted_ms"][level] + 40.0)


#: One Auto for the bound's examples: its levels' traffic is simulated once.
_AUTO = Auto(warmup=0)
_SPECS = {lb: lv.spec() for lb, lv in zip(_AUTO.labels, _AUTO._levels, strict=True)}
#: The dense and the 8-bit exchange at each H (``--auto-outer``'s default candidates).
_EIGHT = OUTER_CANDIDATES + tuple(Candidate(f"diloco-h{c.outer_steps}-8bit", "scatterq:bits=8",
                                            "outer", c.outer_steps) for c in OUTER_CANDIDATES)
_TRAFFIC = {spec: measure_traffic(spec, WORLD, shapes=SHAPES)
            for spec in {*_SPECS.values(), "none", "scatterq:bits=8"}}


@settings(max_examples=60, deadline=None, derandomize=True)
@given(bandwidth=st.floats(1e-3, 1e5), rtt=st.floats(0.0, 100.0), compute=st.floats(0.0, 5.0),
       costs=st.lists(st.floats(0.0, 5.0), min_size=len(_SPECS), max_size=len(_SPECS)),
       exchange_cost=st.floats(0.0, 5.0))
@example(bandwidth=10.0, rtt=1.0, compute=0.01, costs=[0.0, 0.0, 0.5, 0.0, 0.0, 0.0],
         exchange_cost=0.0)
@example(bandwidth=1e4, rtt=0.01, compute=0.05, costs=[0.0] * len(_SPECS), exchange_cost=0.0)
@example(bandwidth=10.0, rtt=1.0, compute=0.3, costs=[0.0, 0.0, 0.02, 0.0, 0.0, 0.0],
         exchange_cost=0.05)
def test_a_switch_on_the_bound_is_a_switch_on_the_measured_prices(
        bandwidth: float, rtt: float, compute: float, costs: list[float],
        exchange_cost: float) -> None:
    """The decision before step 0 may switch on the bound (the allowed levels priced without
    compression, :func:`outer_switch_bound`) and skip measuring compression: the measured
    decision on the same link and compute must then switch too, at the same candidate, with
    at least the bound's gain, whatever the levels' compression costs; with a compressed
    exchange among the candidates too, its own compression priced alike in both."""
    group = SimulatedGroup(WORLD)
    link = (bandwidth, rtt)
    options = {"early": True, "candidates": _EIGHT, "traffic": _TRAFFIC,
               "candidate_overhead_s": {"scatterq:bits=8": exchange_cost}}
    free = _AUTO.first_decision(SHAPES, group, ranks=range(WORLD), compute_s=compute, link=link)
    allowed = {lb: _SPECS[lb] for lb in _AUTO.allowed(bool(free["critical"]))}
    bound = outer_switch_bound(free, allowed, SHAPES, WORLD, margin=0.05, **options)
    measured = _AUTO.first_decision(SHAPES, group, ranks=range(WORLD), compute_s=compute,
                                    overhead_s=dict(zip(_AUTO.labels, costs, strict=True)),
                                    link=link)
    got = outer_switch(measured, _SPECS[measured["level"]], SHAPES, WORLD, margin=0.05,
                       **options)
    assert bound["level"] in allowed and got["gain"] >= bound["gain"] - 1e-12
    if bound["switch"]:
        assert got["switch"] and got["candidate"] == bound["candidate"]
        assert got["exchange"] == bound["exchange"]
    # It is the smallest gain of the allowed levels' verdicts.
    each = [outer_switch({**free, "level": lb}, spec, SHAPES, WORLD, margin=0.05, **options)
            for lb, spec in allowed.items()]
    assert bound == min(each, key=lambda v: v["gain"])


def test_a_compressed_exchange_is_priced_with_its_compression_and_the_cheapest_wins() -> None:
    engine = drive(LinkClock(10, 1e-3), 60)
    record = _steady(Auto.decisions(engine)[-1])
    spec = _spec(engine, record["level"])
    options = {"candidates": _EIGHT, "traffic": _TRAFFIC}
    free = outer_switch(record, spec, SHAPES, WORLD, margin=0.05, **options)
    # At 10 Mbit/s the 8-bit exchange (fewer bytes) is the fastest at each H.
    pred = free["predicted_ms"]
    for h in (10, 30, 100):
        assert pred[f"diloco-h{h}-8bit"] < pred[f"diloco-h{h}"]
    assert free["exchange"] == "scatterq:bits=8" and free["candidate"].endswith("-8bit")
    # Its compression time is added to each exchange, once every H steps.
    costly = outer_switch(record, spec, SHAPES, WORLD, margin=0.05,
                          candidate_overhead_s={"scatterq:bits=8": 3.0}, **options)
    for h in (10, 30, 100):
        assert costly["predicted_ms"][f"diloco-h{h}-8bit"] == pytest.approx(
            pred[f"diloco-h{h}-8bit"] + 3000.0 / h)
        assert costly["predicted_ms"][f"diloco-h{h}"] == pred[f"diloco-h{h}"]
    # Compute dwarfing the link: H = 10 (the lowest step cost), and there the 8-bit exchange,
    # a hair cheaper than the dense one (no preference for either within the margin) ...
    slow = outer_switch({**record, "compute_ms": 1e7}, spec, SHAPES, WORLD, margin=0.05,
                        **options)
    assert (slow["candidate"], slow["exchange"]) == ("diloco-h10-8bit", "scatterq:bits=8")
    ms = slow["predicted_ms"]
    assert ms["diloco-h10-8bit"] < ms["diloco-h10"] < 1.05 * ms["diloco-h10-8bit"]
    # ... unless the dense one is in force: it stays within the margin.
    kept = outer_switch({**record, "compute_ms": 1e7}, spec, SHAPES, WORLD, margin=0.05,
                        keep="diloco-h10", **options)
    assert (kept["candidate"], kept["exchange"]) == ("diloco-h10", "none")
    with pytest.raises(ValueError, match=r"`candidate_overhead_s\['scatterq:bits=8'\]` must be"):
        outer_switch(record, spec, SHAPES, WORLD, margin=0.05,
                     candidate_overhead_s={"scatterq:bits=8": -1.0}, **options)
    with pytest.raises(ValueError, match="`candidate_overhead_s` must map exchange specs to "
                                         "seconds, got"):
        outer_switch(record, spec, SHAPES, WORLD, margin=0.05,
                     candidate_overhead_s=[1.0], **options)  # type: ignore[arg-type]


def test_the_bound_names_its_levels() -> None:
    record = _AUTO.first_decision(SHAPES, SimulatedGroup(WORLD), ranks=range(WORLD),
                                  link=(10.0, 1.0))
    with pytest.raises(ValueError, match="`level_specs` must map level labels to compressor "
                                         "specs, at least one, got {}"):
        outer_switch_bound(record, {}, SHAPES, WORLD, margin=0.05)
    with pytest.raises(ValueError, match="`margin`"):
        outer_switch_bound(record, {"none": "none"}, SHAPES, WORLD, margin=1.0)
