"""``auto``: decisions from a scripted clock (no real time), state, spec and validation."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import gradzip
from gradzip import Auto, Engine, SimulatedGroup, compressor_from_spec
from gradzip.comm.base import Collective
from gradzip.plan.measure import UNBOUNDED_MBIT, fit_link, fit_probe, pick, probe_link

WORLD = 4
SHAPES = {"w": torch.Size([128, 128]), "b": torch.Size([128])}
DENSE = 4 * (128 * 128 + 128)  # their fp32 bytes, the largest probe


class LinkClock:
    """A clock that advances by the compute the test declares and by what the group's meter
    says was sent: ``wire x 8 / bandwidth`` plus ``latency`` per collective call. Every rank
    of a process group may run it at its own ``scale`` (clocks that disagree)."""

    def __init__(self, mbit: float, latency_s: float, scale: float = 1.0) -> None:
        self.mbit, self.latency, self.scale = mbit, latency_s, scale
        self.compute = 0.0
        self.link = 0.0
        self.group: Collective | None = None
        self._seen = (0, 0)

    def __call__(self) -> float:
        assert self.group is not None
        wire, calls = self.group.meter.wire[0], self.group.meter.calls
        self.link += ((wire - self._seen[0]) * 8 / (self.mbit * 1e6)
                      + (calls - self._seen[1]) * self.latency)
        self._seen = (wire, calls)
        return self.scale * (self.compute + self.link)


def grads(step: int, scale: float = 1.0, workers: int = WORLD) -> dict[str, torch.Tensor]:
    """A steady direction plus small per-step noise (a norm that changes little)."""
    base = torch.Generator().manual_seed(0)
    noise = torch.Generator().manual_seed(1000 + step)
    return {n: scale * (torch.randn(s, generator=base) + 0.05 * torch.randn((workers, *s),
                                                                            generator=noise))
            for n, s in SHAPES.items()}


def drive(clock: LinkClock, steps: int, *, compute_s: float = 0.02,
          link: dict[int, float] | None = None, scale: dict[int, float] | None = None,
          engine: Engine | None = None, start: int = 0, **kwargs: Any) -> Engine:
    """Run ``steps`` steps in a simulated group; ``link``/``scale``: changes from a step on."""
    if engine is None:
        group = SimulatedGroup(WORLD)
        clock.group = group
        engine = Engine(SHAPES, Auto(clock=clock, **kwargs), collective=group)
    factor = 1.0
    for step in range(start, start + steps):
        if link and step in link:
            clock.mbit = link[step]
        if scale and step in scale:
            factor = scale[step]
        clock.compute += compute_s
        engine.reduce(grads(step, factor))
    return engine


def choices(engine: Engine) -> list[tuple[int, str, bool]]:
    return [(r["step"], r["level"], r["critical"]) for r in Auto.decisions(engine, since=0)]


def test_fast_link_keeps_none() -> None:
    engine = drive(LinkClock(100_000, 1e-5), 110)
    assert choices(engine) == [(5, "none", True), (55, "none", False), (105, "none", False)]
    assert Auto.choice(engine) == "none"
    assert Auto.counts(engine)["steps"]["none"] == 110


def test_slow_link_compresses_gently_while_critical_then_aggressively() -> None:
    engine = drive(LinkClock(10, 1e-3), 110)
    assert choices(engine) == [(5, "powersgd-r4", True), (55, "topk-1%", False),
                               (105, "topk-1%", False)]
    record = Auto.decisions(engine, since=0)[0]
    # The fitted link is the scripted one: 10 Mbit/s.
    assert record["bandwidth_mbit"] == pytest.approx(10, rel=1e-6)
    # Compute: the declared 20 ms plus the engine's own per-step flag all-reduce (one call,
    # outside the compressor's reduce).
    assert 20 < record["compute_ms"] < 21.1
    assert min(record["predicted_ms"], key=record["predicted_ms"].get) == "topk-1%"
    assert record["predicted_ms"]["powersgd-r4"] < record["predicted_ms"]["fp16"]


def compressor_choice_quality(engine: Engine, label: str) -> str:
    return engine.compressor.quality(label)  # type: ignore[attr-defined]


def test_critical_phase_forbids_aggressive_levels() -> None:
    # The gradient's scale triples from step 60: the next decision (step 105) is critical.
    engine = drive(LinkClock(10, 1e-3), 110, scale={60: 3.0})
    got = choices(engine)
    assert got == [(5, "powersgd-r4", True), (55, "topk-1%", False), (105, "powersgd-r4", True)]
    assert compressor_choice_quality(engine, "topk-1%") == "aggressive"
    assert Auto.decisions(engine)[0]["reason"] == "norm_change"


def test_lr_drop_brings_a_critical_decision_forward() -> None:
    group = SimulatedGroup(WORLD)
    clock = LinkClock(10, 1e-3)
    clock.group = group
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    engine = Engine(SHAPES, Auto(clock=clock), collective=group, optimizer=opt)
    for step in range(70):
        if step == 65:
            opt.param_groups[0]["lr"] = 0.01
        clock.compute += 0.02
        engine.reduce(grads(step))
    got = Auto.decisions(engine, since=0)
    assert [(r["step"], r["reason"]) for r in got] == [(5, "first"), (55, "steady"),
                                                      (66, "lr_drop")]
    assert got[-1]["level"] == "powersgd-r4"


def test_changing_link_switches_back_and_forth() -> None:
    engine = drive(LinkClock(100_000, 2e-3), 260, link={60: 10, 160: 100_000},
                   levels=("none", "fp16", "powersgd:rank=4"))
    assert choices(engine) == [(5, "none", True), (55, "none", False),
                               (105, "powersgd-r4", False), (155, "powersgd-r4", False),
                               (205, "fp16", False), (255, "fp16", False)]
    assert Auto.counts(engine)["switches"] == 2


def test_state_dict_round_trip_resumes_exactly() -> None:
    full = drive(LinkClock(10, 1e-3), 120)
    clock = LinkClock(10, 1e-3)
    first = drive(clock, 70)
    saved = first.state_dict()
    group = SimulatedGroup(WORLD)
    clock.group = group
    resumed = Engine(SHAPES, Auto(clock=clock), collective=group)
    resumed.load_state_dict(saved)
    clock._seen = (group.meter.wire[0], group.meter.calls)  # the link counted so far stays
    drive(clock, 50, engine=resumed, start=70)
    assert Auto.decisions(resumed, since=0) == Auto.decisions(full, since=0)
    assert Auto.counts(resumed) == Auto.counts(full)
    step = grads(120)
    a, b = full.reduce(step), resumed.reduce(step)
    for name in SHAPES:
        assert torch.equal(a[name], b[name])


def test_loaded_state_is_checked() -> None:
    engine = drive(LinkClock(10, 1e-3), 8)
    saved = engine.state_dict()
    saved["compressor_state"]["controller"]["current"] = "sign"
    other = Engine(SHAPES, Auto(clock=LinkClock(10, 1e-3)), collective=SimulatedGroup(WORLD))
    with pytest.raises(ValueError, match="current"):
        other.load_state_dict(saved)


def test_report_and_records() -> None:
    engine = drive(LinkClock(10, 1e-3), 60)
    report = engine.compressor.report(engine.compressor_state)
    assert report["choice"] == Auto.choice(engine)
    assert set(report["levels"]) == set(SHAPES)
    assert set(report["levels"].values()) == {report["choice"]}
    assert report["counts"]["decisions"] == 2
    assert sum(report["counts"]["steps"].values()) == 60
    rec = Auto.decisions(engine)[0]
    for key in ("step", "compute_ms", "reduce_ms", "bandwidth_mbit", "rtt_ms", "predicted_ms",
                "level", "critical", "gain"):
        assert key in rec


def test_spec_round_trip_and_bare_name() -> None:
    auto = compressor_from_spec("auto")
    assert isinstance(auto, Auto)
    assert auto.labels == ["none", "fp16", "powersgd-r4", "powersgd-r2", "powersgd-r1",
                           "topk-1%"]
    custom = compressor_from_spec("auto(levels=none|powersgd:rank=2,every=10,warmup=2)")
    assert isinstance(custom, Auto) and custom.every == 10 and custom.labels == ["none",
                                                                                 "powersgd-r2"]
    assert compressor_from_spec(custom.spec()) == custom
    assert gradzip.Auto is Auto


def test_warmup_0_decides_before_the_first_step_from_the_link_alone() -> None:
    engine = drive(LinkClock(10, 1e-3), 12, every=5, warmup=0)
    first, second, third = Auto.decisions(engine, since=0)
    # Step 0: nothing timed, no gradient seen; a slow link already rules out dense fp32.
    assert (first["step"], first["reason"], first["compute_ms"], first["norm"]) == (0, "first",
                                                                                     0.0, 0.0)
    assert first["level"] != "none" and Auto.counts(engine)["steps"]["none"] == 0
    # Step 5 compares its interval's norm with nothing before it (still "first"), step 10 with
    # step 5's, as a run whose first decision came after some steps.
    assert (second["step"], second["reason"]) == (5, "first")
    assert third["step"] == 10 and third["reason"] in ("steady", "norm_change")
    assert second["compute_ms"] > 0


def test_first_decision_is_the_step_0_decision_taken_without_state() -> None:
    """``Auto.first_decision`` gives, from a scratch controller, the record a ``warmup=0``
    run's decision at step 0 makes over the same link (same probes, bytes and choice)."""
    clock = LinkClock(10, 1e-3)
    group = SimulatedGroup(WORLD)
    clock.group = group
    auto = Auto(clock=clock, every=5, warmup=0)
    record = auto.first_decision(SHAPES, group, ranks=range(WORLD))
    engine = drive(LinkClock(10, 1e-3), 1, every=5, warmup=0)
    expected = Auto.decisions(engine, since=0)[0]
    # The same inputs and choice; times only to rounding (the clocks start elsewhere).
    timed = {"rtt_ms", "bandwidth_mbit", "predicted_ms", "gain"}
    assert {k: v for k, v in record.items() if k not in timed} == {
        k: v for k, v in expected.items() if k not in timed}
    assert record["predicted_ms"] == pytest.approx(expected["predicted_ms"], rel=1e-12)
    for key in ("rtt_ms", "bandwidth_mbit"):
        assert record[key] == pytest.approx(expected[key], rel=1e-12)
    assert record["level"] != "none" and record["reason"] == "first"
    # Its bytes are a decision's: the probes (one float, one float, probe_bytes, then grown
    # 4x but no larger than the tensors' dense size: at once; probe_bytes again, the slope's
    # lower end timed twice) and the WORLD x 8 float64 maxima over ranks, each all-reduced
    # at 2 (W - 1) / W; nothing else.
    sizes = (4, 4, auto.probe_bytes, DENSE, auto.probe_bytes, WORLD * 8 * 8)
    assert group.meter.wire[0] == sum(2 * (WORLD - 1) * n // WORLD for n in sizes)
    # A fresh run's state is untouched: this Auto still decides before its own step 0.
    again = Engine(SHAPES, auto, collective=group)
    assert Auto.counts(again)["decisions"] == 0
    with pytest.raises(TypeError, match="`comm` must be a Collective, got str"):
        auto.first_decision(SHAPES, "gloo", ranks=[0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`ranks` must hold one int per local worker of "
                                         r"`comm` \(4\), got \[0\]"):
        auto.first_decision(SHAPES, group, ranks=[0])
    with pytest.raises(ValueError, match="`shapes` must map tensor names to shapes"):
        auto.first_decision({}, group, ranks=range(WORLD))


def test_first_decision_prices_the_compute_it_is_given(caplog: pytest.LogCaptureFixture) -> None:
    """With compute timed by the caller, the first decision weighs link time against it:
    the link that made a compressed level worth it at a compute floor is not worth
    compressing for behind 1000 s of compute (every gain is below the margin), and the
    record carries the compute (the maximum over the ranks: here every rank's)."""
    clock = LinkClock(10, 1e-3)
    group = SimulatedGroup(WORLD)
    clock.group = group
    auto = Auto(clock=clock, every=5, warmup=0)
    with caplog.at_level("DEBUG", logger="gradzip.plan.auto"):
        floor = auto.first_decision(SHAPES, group, ranks=range(WORLD))
    assert caplog.records == []  # nothing was applied: the caller says what it does with it
    timed = auto.first_decision(SHAPES, group, ranks=range(WORLD), compute_s=1000.0)
    assert floor["level"] != "none" and floor["compute_ms"] == 0.0
    assert timed["level"] == "none" and timed["compute_ms"] == 1e6
    assert timed["predicted_ms"]["none"] > 1e6
    # Measured compression times price each level: the level chosen at the floor, made
    # 1000 s dearer, loses to another; the maxima over ranks cost one more all-reduce of
    # one float per level per rank.
    sent = group.meter.wire[0]
    costs = {lb: 0.0 for lb in auto.labels}
    costs[floor["level"]] = 1000.0
    priced = auto.first_decision(SHAPES, group, ranks=range(WORLD), overhead_s=costs)
    assert priced["level"] not in ("none", floor["level"])
    assert priced["predicted_ms"][floor["level"]] == pytest.approx(
        floor["predicted_ms"][floor["level"]] + 1e6, rel=1e-6)
    sizes = (WORLD * len(auto.labels) * 8, 4, 4, auto.probe_bytes, DENSE, auto.probe_bytes,
             WORLD * 8 * 8)
    assert group.meter.wire[0] - sent == sum(2 * (WORLD - 1) * n // WORLD for n in sizes)
    with pytest.raises(ValueError, match="`overhead_s` must map every level label"):
        auto.first_decision(SHAPES, group, ranks=range(WORLD), overhead_s={"none": 0.0})
    with pytest.raises(ValueError, match=r"`overhead_s\['none'\]` must be"):
        auto.first_decision(SHAPES, group, ranks=range(WORLD), overhead_s={**costs, "none": -1.0})
    with pytest.raises(ValueError, match=r"`compute_s` must be .*, got -1"):
        auto.first_decision(SHAPES, group, ranks=range(WORLD), compute_s=-1.0)
    with pytest.raises(TypeError, match="`compute_s` must be a real number"):
        auto.first_decision(SHAPES, group, ranks=range(WORLD), compute_s="fast")  # type: ignore[arg-type]


def test_first_decision_on_a_known_link_does_not_probe() -> None:
    """Given the link an earlier record measured, the first decision probes nothing (its
    bytes are the maxima over ranks alone) and is the record the probe gave."""
    clock = LinkClock(10, 1e-3)
    group = SimulatedGroup(WORLD)
    clock.group = group
    auto = Auto(clock=clock, every=5, warmup=0)
    probed = auto.first_decision(SHAPES, group, ranks=range(WORLD), compute_s=0.01)
    sent = group.meter.wire[0]
    link = (probed["bandwidth_mbit"], probed["rtt_ms"])
    known = auto.first_decision(SHAPES, group, ranks=range(WORLD), compute_s=0.01, link=link)
    assert group.meter.wire[0] - sent == 2 * (WORLD - 1) * (WORLD * 8 * 8) // WORLD
    assert known == probed
    # Another link prices the levels anew.
    fast = auto.first_decision(SHAPES, group, ranks=range(WORLD), compute_s=0.01,
                               link=(1e5, 0.0))
    assert (fast["bandwidth_mbit"], fast["rtt_ms"], fast["level"]) == (1e5, 0.0, "none")
    for bad, error, match in (((10.0,), ValueError, r"`link` must be a pair"),
                              ((0.0, 1.0), ValueError, r"`link\[0\] \(bandwidth_mbit\)` must be"),
                              ((10.0, -1.0), ValueError, r"`link\[1\] \(rtt_ms\)` must be"),
                              ((10.0, "1"), TypeError, r"`link\[1\] \(rtt_ms\)` must be")):
        with pytest.raises(error, match=match):
            auto.first_decision(SHAPES, group, ranks=range(WORLD), link=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"levels": []}, ValueError, "levels"),
    ({"levels": ["none", "none"]}, ValueError, "repeat"),
    ({"levels": [3]}, TypeError, "levels"),
    ({"levels": ["accordion(steady=powersgd:rank=1,critical=powersgd:rank=4)"]}, TypeError,
     "controllers"),
    ({"every": 0}, ValueError, "every"),
    ({"warmup": -1}, ValueError, "warmup"),
    ({"margin": 1.0}, ValueError, "margin"),
    ({"eta": 0.0}, ValueError, "eta"),
    ({"probe_bytes": 4}, ValueError, "probe_bytes"),
    ({"clock": 3}, TypeError, "clock"),
])
def test_validation(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        Auto(**kwargs)


def test_fit_link_and_pick() -> None:
    bw, rtt = fit_link((6, 6e-3 * 1 + 6 * 8 / 1e7), (60_006, 6e-3 + 60_006 * 8 / 1e7), 6)
    assert bw == pytest.approx(10, rel=1e-9) and rtt == pytest.approx(1.0, rel=1e-9)  # 6 ms over 6 hops of one round trip
    assert fit_link((6, 0.1), (60, 0.2), 0) == (1e9, 0.0)
    with pytest.raises(ValueError, match="large"):
        fit_link((60, 0.1), (6, 0.2), 6)
    times = {"a": 1.0, "b": 0.97, "c": 0.5}
    assert pick(times, ["a", "b"], "a", 0.05) == "a"  # 3% faster: hysteresis keeps a
    assert pick(times, ["a", "b", "c"], "a", 0.05) == "c"
    assert pick(times, ["b"], "a", 0.05) == "b"  # a not allowed any more


class BucketClock:
    """A link shaped by a token bucket: the first ``burst`` bytes of a message leave at line
    rate (free), the rest at ``mbit``, plus ``latency_s`` per call; charged per interval
    between two readings (the probe reads the clock around each timed call)."""

    def __init__(self, group: Collective, mbit: float, burst: int, latency_s: float) -> None:
        self.group, self.mbit, self.burst, self.latency = group, mbit, burst, latency_s
        self.now, self._seen = 0.0, (0, 0)

    def __call__(self) -> float:
        wire, calls = self.group.meter.wire[0], self.group.meter.calls
        sent, made = wire - self._seen[0], calls - self._seen[1]
        self.now += made * self.latency + max(0, sent - made * self.burst) * 8 / (self.mbit * 1e6)
        self._seen = (wire, calls)
        return self.now


@pytest.mark.parametrize(("mbit", "burst", "sizes"), [
    (1000, 250_000, [4, 1 << 16, 1 << 18, 1 << 20]),  # 256 KiB still inside the burst
    (10, 32_768, [4, 1 << 16, 1 << 18]),              # the first growth already costs 157 ms
])
def test_the_probe_grows_past_a_burst_and_reads_the_rate(mbit: float, burst: int,
                                                        sizes: list[int]) -> None:
    """A 64 KiB probe inside a 1000 Mbit/s link's burst costs what one float does: fitted from
    it, the link looks unbounded. The probe grows 4x until the last growth costs 5 ms, and the
    slope between its two largest messages, beyond the burst, reads the rate exactly."""
    group = SimulatedGroup(2)
    clock = BucketClock(group, mbit, burst, 50e-6)
    calls = probe_link(group, 1 << 16, clock, torch.device("cpu"), limit_bytes=1 << 22)
    assert [wire for wire, _ in calls] == sizes  # two workers: each sends the message once
    small, large = calls[0], calls[-1]
    assert fit_link(small, calls[1], 2)[0] == (UNBOUNDED_MBIT if mbit == 1000 else
                                                pytest.approx(2 * mbit, rel=0.01))
    bandwidth, rtt = fit_probe(calls, 2)  # the slope between the two largest messages
    assert bandwidth == pytest.approx(mbit, rel=1e-6)
    assert rtt == pytest.approx(0.025, rel=0.1)  # 50 us a call over 2 hops, less 4 bytes
    # Never past the tensors' dense size: a model of 100 KiB is probed at 64 and 100 KiB.
    group = SimulatedGroup(2)
    capped = probe_link(group, 1 << 16, BucketClock(group, mbit, burst, 50e-6),
                        torch.device("cpu"), limit_bytes=100 << 10)
    assert [wire for wire, _ in capped] == [4, 1 << 16, 100 << 10]
    with pytest.raises(ValueError, match="`large` must send more bytes"):
        fit_link(small, large, 2, start=large)


def test_a_probe_after_the_callers_own_collective_leaves_out_its_lining_up_call() -> None:
    """``lined_up``: the caller's last collective lined the ranks up, so the probe's untimed
    first call is left out (one call fewer: every hop's latency on a long link), and the
    calls it times are the same."""
    def probe(lined_up: bool) -> tuple[list[tuple[int, float]], int]:
        group = SimulatedGroup(2)
        clock = BucketClock(group, 10, 32_768, 50e-6)
        calls = probe_link(group, 1 << 16, clock, torch.device("cpu"), limit_bytes=1 << 22,
                           lined_up=lined_up)
        return calls, group.meter.calls

    (kept, n_kept), (spared, n_spared) = probe(False), probe(True)
    assert [w for w, _ in kept] == [w for w, _ in spared] == [4, 1 << 16, 1 << 18]
    assert fit_probe(kept, 2) == pytest.approx(fit_probe(spared, 2))
    assert n_spared == n_kept - 1
    with pytest.raises(TypeError, match="`lined_up` must be a bool, got int"):
        probe_link(SimulatedGroup(2), 1 << 16, lambda: 0.0, torch.device("cpu"), lined_up=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`lined_up` must be a bool, got str"):
        Auto().first_decision(SHAPES, SimulatedGroup(WORLD), ranks=range(WORLD),
                              lined_up="yes")  # type: ignore[arg-type]


def test_a_level_keeps_its_state_while_another_runs() -> None:
    # Slow link: PowerSGD rank 4 from step 5, Top-k 1% from step 55 (see above).
    clock = LinkClock(10, 1e-3)
    engine = drive(clock, 56)
    assert Auto.choice(engine) == "topk-1%"
    q = {n: t.clone() for n, t in engine.compressor_state["levels"]["powersgd-r4"]["q"].items()}
    drive(clock, 20, engine=engine, start=56)
    after = engine.compressor_state["levels"]["powersgd-r4"]["q"]
    assert all(torch.equal(q[n], after[n]) for n in q)  # rank 4's warm start waits unchanged
    fresh = Auto().init_state(SHAPES)["levels"]["powersgd-r4"]["q"]
    assert not all(torch.equal(q[n], fresh[n]) for n in q)  # ... and it had moved while it ran


class PausingClock(BucketClock):
    """:class:`BucketClock`, plus a pause of ``pause_s`` inside the first call that sends
    ``size`` wire bytes (its process scheduled out on a busy machine)."""

    def __init__(self, group: Collective, mbit: float, burst: int, latency_s: float, *,
                 size: int, pause_s: float) -> None:
        super().__init__(group, mbit, burst, latency_s)
        self.size, self.pause, self.paused = size, pause_s, False

    def __call__(self) -> float:
        if not self.paused and self.group.meter.wire[0] - self._seen[0] == self.size:
            self.now += self.pause
            self.paused = True
        return super().__call__()


@pytest.mark.parametrize("pause_s", [0.0, 4e-3])
def test_a_pause_in_the_slopes_lower_end_is_timed_away(pause_s: float) -> None:
    """At 150 Mbit/s the growth from 64 to 256 KiB costs 10.5 ms. A 4 ms pause inside the
    64 KiB call leaves 6.5 ms, still enough to stop growing, and alone would read the link
    as 242 Mbit/s; the 64 KiB message is timed once more and the faster call kept, so the
    probe reads 150 either way, for one more 64 KiB message."""
    group = SimulatedGroup(2)
    clock = PausingClock(group, 150, 37_500, 50e-6, size=1 << 16, pause_s=pause_s)
    calls = probe_link(group, 1 << 16, clock, torch.device("cpu"), limit_bytes=1 << 22)
    assert [wire for wire, _ in calls] == [4, 1 << 16, 1 << 18]
    assert fit_probe(calls, 2)[0] == pytest.approx(150, rel=1e-6)
    # Two calls of 4 bytes (the untimed one first), 64 KiB twice, 256 KiB once, and the
    # 2 x 3 float64 maxima that stopped the growth.
    assert group.meter.wire[0] == 2 * 4 + 2 * (1 << 16) + (1 << 18) + 2 * 3 * 8
    # The paused call alone as the slope's lower end: the link read 1.6x too fast.
    mid = (1 << 16, calls[1][1] + pause_s)
    alone = fit_link(calls[0], calls[-1], 2, start=mid)[0]
    assert alone == pytest.approx(150 if pause_s == 0 else 242, rel=0.01)


def test_probe_and_aggregation_bytes_are_metered() -> None:
    plain = Engine(SHAPES, "none", collective=SimulatedGroup(WORLD))
    clock = LinkClock(10, 1e-3)
    auto = drive(clock, 12, levels=("none",), every=5, warmup=2, probe_bytes=1024)
    for step in range(12):
        plain.reduce(grads(step))
    extra = auto.stats["wire_bytes"][0] - plain.stats["wire_bytes"][0]
    # Decisions at steps 2, 7: per decision, the probes (one float, one float, 1024 bytes,
    # then 4x larger: 4096 bytes cost 3.7 ms more at 10 Mbit/s, under the 5 ms that stops
    # the growth, 16384 bytes 14.7 ms more; each growth judged from the WORLD x 3 float64
    # maxima of the last times; then 4096 bytes again, the slope's lower end timed twice)
    # and one all-reduce of WORLD x 8 float64 maxima, at 2 (W - 1) / W of each.
    maxima = WORLD * 3 * 8
    sizes = (4, 4, 1024, 4096, maxima, 16384, maxima, 4096, WORLD * 8 * 8)
    per_decision = sum(2 * (WORLD - 1) * n // WORLD for n in sizes)
    assert extra == 2 * per_decision


@pytest.mark.parametrize(("key", "value", "match"), [
    ("step", -1, "step"),
    ("periods", [1.0, float("nan")], "periods"),
    ("overhead", {"none": 0.0}, "overhead"),
    ("last_end", "soon", "last_end"),
])
def test_loaded_controller_values_are_checked(key: str, value: Any, match: str) -> None:
    engine = drive(LinkClock(10, 1e-3), 8)
    saved = engine.state_dict()
    saved["compressor_state"]["controller"][key] = value
    other = Engine(SHAPES, Auto(clock=LinkClock(10, 1e-3)), collective=SimulatedGroup(WORLD))
    with pytest.raises((ValueError, TypeError), match=match):
        other.load_state_dict(saved)


def test_a_switch_is_explained_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="gradzip.plan.auto"):
        drive(LinkClock(10, 1e-3), 8)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("auto: step 5: none -> powersgd-r4, predicted")
    assert "link 10.0 Mbit/s" in lines[0] and "critical phase: first" in lines[0]


def test_a_decision_without_timed_steps_reuses_the_last_compute() -> None:
    # The drop at step 55 is seen at that step's end, right after the decision of step 55:
    # the decision of step 56 has no whole step timed and keeps step 55's compute.
    group = SimulatedGroup(WORLD)
    clock = LinkClock(10, 1e-3)
    clock.group = group
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    engine = Engine(SHAPES, Auto(clock=clock), collective=group, optimizer=opt)
    for step in range(58):
        if step == 55:
            opt.param_groups[0]["lr"] = 0.01
        clock.compute += 0.02
        engine.reduce(grads(step))
    got = Auto.decisions(engine, since=0)
    assert [(r["step"], r["reason"]) for r in got] == [(5, "first"), (55, "steady"),
                                                      (56, "lr_drop")]
    assert got[2]["compute_ms"] == got[1]["compute_ms"] > 20
    assert got[2]["level"] == "powersgd-r4"



def test_levels_get_state_made_for_the_group() -> None:
    """A level whose state depends on the group (a sharded quantiser's owner residuals) gets
    it through Auto, as through Accordion, so an engine's checkpoint of it loads again."""
    shapes = {"w": torch.Size([64, 64])}
    state = Auto(levels=["none", "sign"]).init_group_state(shapes, 8, 8)
    expected = gradzip.Sign().init_group_state(shapes, 8, 8)
    assert state["levels"]["sign"]["forms"] == expected["forms"] == {"w": "sharded"}
    assert state["levels"]["sign"]["owner"]["w"].shape == expected["owner"]["w"].shape
    engine = Engine(shapes, Auto(levels=["none", "sign"]), collective=SimulatedGroup(8))
    engine.load_state_dict(engine.state_dict())  # the fresh group state validates against itself
