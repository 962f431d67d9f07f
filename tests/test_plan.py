"""The cost model: bytes against the simulator, alpha-beta arithmetic, the choice, the command."""

from __future__ import annotations

import json

import pytest
import torch

from gradzip import Engine, SimulatedGroup
from gradzip.cli import main
from gradzip.plan import (
    QUALITIES,
    Call,
    Candidate,
    Setting,
    TimingCache,
    Traffic,
    choose,
    comm_seconds,
    count_layout,
    default_candidates,
    measure_traffic,
    parse_count,
    plan,
    predict,
    predict_candidate,
)
from gradzip.plan.command import model_shapes
from gradzip.plan.timing import ENV_VAR, default_cache_path, timing_key
from gradzip.plan.traffic import BLOCK

SHAPES = {"conv": (8, 4, 3, 3), "fc": (64, 48), "bias": (48,), "head": (10, 64)}
SPECS = ("none", "fp16", "powersgd:rank=2", "topk:ratio=0.1", "qsgd", "sign", "scatterq:bits=8")
#: Injected compression seconds (tests never depend on this machine's speed).
ZERO = {c.spec: 0.0 for c in default_candidates()}


def _simulated_wire(spec: str, shapes: dict[str, tuple[int, ...]], workers: int) -> tuple[int, int]:
    """Wire bytes and calls of one engine step, read from the engine's own counters."""
    engine = Engine({n: torch.zeros(s) for n, s in shapes.items()}, spec,
                    collective=SimulatedGroup(workers))
    gen = torch.Generator().manual_seed(3)
    engine.reduce({n: torch.randn((workers, *s), generator=gen) for n, s in shapes.items()},
                  same_layout=True)
    return engine.stats["wire_bytes"][0], engine.stats["collective_calls"]


@pytest.mark.parametrize("workers", [2, 3, 5])
@pytest.mark.parametrize("spec", SPECS)
def test_bytes_and_calls_equal_the_simulators(spec: str, workers: int) -> None:
    traffic = measure_traffic(spec, workers, shapes=SHAPES)
    assert traffic.exact
    assert (traffic.wire_bytes, len(traffic.calls)) == _simulated_wire(spec, SHAPES, workers)


@pytest.mark.parametrize("spec", ["none", "powersgd:rank=4", "topk:ratio=0.01", "sign"])
def test_a_count_extrapolated_from_two_blocks_equals_its_full_simulation(spec: str) -> None:
    params = 4 * BLOCK * BLOCK + 3 * BLOCK + 7  # four blocks, three rows, a tail of 7
    assert list(count_layout(params).values()) == [(BLOCK, BLOCK)] * 4 + [(3, BLOCK), (7,)]
    full = _simulated_wire(spec, count_layout(params), 3)
    extrapolated = measure_traffic(spec, 3, params=params)
    assert (extrapolated.wire_bytes, len(extrapolated.calls)) == full


def test_a_large_model_is_simulated_with_fewer_workers_and_says_so() -> None:
    exact = measure_traffic("powersgd:rank=2", 6, shapes=SHAPES)
    fewer = measure_traffic("powersgd:rank=2", 6, shapes=SHAPES, limit=3 * 5000)
    assert exact.exact and not fewer.exact
    # All-reduced messages do not depend on W: the wire bytes are still the simulator's.
    assert fewer.wire_bytes == exact.wire_bytes == _simulated_wire("powersgd:rank=2", SHAPES, 6)[0]


def test_alpha_beta_on_hand_computed_examples() -> None:
    # 6 hops of a 10 ms round trip each + 1 MB at 100 Mbit/s (80 ms).
    assert comm_seconds(1_000_000, 6, 100, 10) == pytest.approx(0.140)
    assert comm_seconds(0, 0, 1, 0) == 0
    ring = Traffic(4, (Call("all_reduce", 4000, 4000),))
    assert (ring.wire_bytes, ring.hops) == (6000, 6)  # 2 (W-1)/W * 4000, 2 (W-1)
    gather = Traffic(4, (Call("all_gather", 100, 90),))
    assert (gather.wire_bytes, gather.hops, gather.payload_bytes) == (300, 3, 90)
    per_step = Candidate("x", "none", "lossless")
    # 8 Mbit/s = 1 byte/us; rtt 1 ms per hop; two buckets: 2 * 6 hops * 1 ms + 6000 B * 1 us = 18 ms.
    setting = Setting(4, 8.0, 1.0, 90.0, buckets=2)
    assert setting.overlap_window_ms == pytest.approx(30.0)  # 2/3 * 90 * 1/2
    p = predict_candidate(per_step, ring, setting, 0.004)
    assert (p.calls, p.comm_ms, p.exposed_comm_ms) == (2, pytest.approx(18.0), 0.0)
    assert p.step_ms == pytest.approx(94.0)
    synchronous = Setting(4, 8.0, 1.0, 90.0, buckets=2, overlap=False)
    assert predict_candidate(per_step, ring, synchronous, 0.004).step_ms == pytest.approx(112.0)
    outer = Candidate("o", "none", "outer", outer_steps=10)
    q = predict_candidate(outer, ring, synchronous, 0.004)  # one exchange per 10 steps
    assert (q.calls, q.comm_ms) == (1, pytest.approx(12.0))  # no buckets: 6 ms + 6 ms
    assert q.step_ms == pytest.approx(90.0 + (12.0 + 4.0) / 10)
    assert (q.wire_bytes_per_step, q.calls_per_step) == (600.0, 0.1)


def _choice(bandwidth: float, step_ms: float, **kw: object) -> str:
    setting = Setting(4, bandwidth, 0.0, step_ms)
    return plan(setting, shapes=SHAPES, compress_seconds=ZERO, **kw).choice.candidate.name


def test_the_choice_flips_with_the_link() -> None:
    assert _choice(1e6, 100.0) == "none"  # fast link: nothing to gain
    slow = _choice(1.0, 100.0, qualities=("lossless", "gentle", "aggressive"))
    assert slow not in ("none", "fp16", "bf16") and not slow.startswith("diloco")
    assert _choice(0.1, 1.0).startswith("diloco")  # very slow link, fast compute: outer steps
    gentle = _choice(0.1, 1.0, qualities=("lossless", "gentle"))
    assert next(c for c in default_candidates() if c.name == gentle).quality == "gentle"


def test_the_guard_keeps_the_gentler_class_within_the_margin() -> None:
    setting = Setting(4, 1e6, 0.0, 100.0)
    preds = predict(setting, shapes=SHAPES, compress_seconds={**ZERO, "none": 0.001})
    assert choose(preds)[0].candidate.name == "none"  # fp16 is < 5% faster
    assert choose(preds, margin=0.0)[0].candidate.name != "none"
    with pytest.raises(ValueError, match="`qualities` must be a non-empty list"):
        choose(preds, qualities=("fast",))


def test_inputs_are_validated_naming_the_parameter() -> None:
    assert parse_count("25M") == 25_000_000 and parse_count("1.5k") == 1500
    assert parse_count(900) == 900
    with pytest.raises(ValueError, match=r"`params` must be a count such as 25M .*'25Q'"):
        parse_count("25Q")
    with pytest.raises(TypeError, match="`params`"):
        parse_count(2.5)
    with pytest.raises(ValueError, match="`workers` must be >= 2, got 1"):
        Setting(1, 10.0, 0.0, 10.0)
    with pytest.raises(ValueError, match=r"`bandwidth_mbit` must be > 0, got 0"):
        Setting(2, 0, 0.0, 10.0)
    with pytest.raises(ValueError, match=r"`rtt_ms` must be >= 0, got -1"):
        Setting(2, 1.0, -1, 10.0)
    with pytest.raises(ValueError, match="`quality` must be one of"):
        Candidate("x", "none", "fine")
    with pytest.raises(ValueError, match="`outer_steps`"):
        Candidate("x", "none", "outer")
    with pytest.raises(ValueError, match="exactly one of `shapes` and `params`"):
        predict(Setting(2, 1.0, 0.0, 1.0), compress_seconds=ZERO)
    with pytest.raises(ValueError, match=r"`compress_seconds\['none'\]` must be >= 0"):
        predict(Setting(2, 1.0, 0.0, 1.0), params=10, compress_seconds={"none": -1.0})


def _timings_file(tmp_path, shapes, seconds: float):  # type: ignore[no-untyped-def]
    cache = TimingCache(tmp_path / "t.json")
    for cand in default_candidates():
        cache.put(timing_key(cand.spec, shapes), seconds)
    return cache.path


def test_timings_are_cached_read_back_and_overridden(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "sub" / "timings.json"
    cache = TimingCache(path)
    key = timing_key("fp16", SHAPES)
    assert cache.seconds("fp16", SHAPES, measure=False) is None
    cache.put(key, 0.25)
    assert TimingCache(path).get(key) == 0.25  # written and read back
    measured = TimingCache(path).seconds("sign", {"w": (4, 4)})  # measured once, then cached
    assert measured is not None and measured >= 0
    assert TimingCache(path).get(timing_key("sign", {"w": (4, 4)})) == measured
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "env.json"))
    assert default_cache_path() == tmp_path / "env.json"
    # The cache feeds predictions; an injected value wins over it.
    setting = Setting(2, 100.0, 0.0, 10.0)
    fp16 = [Candidate("fp16", "fp16", "gentle")]
    assert predict(setting, shapes=SHAPES, candidates=fp16, timings=cache)[0].compress_ms == 250.0
    injected = predict(setting, shapes=SHAPES, candidates=fp16, timings=cache,
                       compress_seconds={"fp16": 0.5})
    assert injected[0].compress_ms == 500.0
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="`timings` must be a gradzip plan timing file"):
        TimingCache(tmp_path / "bad.json")


def test_a_cache_write_uses_a_temporary_file_of_its_own(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Two processes writing the cache at once must not move each other's half-written file
    into place: each writes a temporary file named for its process. Another process's
    temporary file (here one that cannot be written over: a folder) is left alone."""
    path = tmp_path / "timings.json"
    (tmp_path / "timings.json.tmp").mkdir()
    (tmp_path / "timings.json.1.tmp").mkdir()
    cache = TimingCache(path)
    cache.put(timing_key("fp16", SHAPES), 0.5)
    assert TimingCache(path).get(timing_key("fp16", SHAPES)) == 0.5
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "timings.json", "timings.json.1.tmp", "timings.json.tmp"]


def _cli(capsys, *argv: str) -> tuple[int, str, str]:  # type: ignore[no-untyped-def]
    code = main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_command_prints_a_table_and_its_choice(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    params = 300_000
    timings = _timings_file(tmp_path, count_layout(params), 0.0)
    base = ["--params", "300K", "--workers", "8", "--timings", str(timings), "--no-measure"]
    code, out, _ = _cli(capsys, *base, "--bandwidth-mbit", "20", "--rtt-ms", "50",
                        "--step-ms", "80")
    assert code == 0
    assert "300,000 parameters, 8 workers, 20 Mbit/s, rtt 50 ms" in out
    assert "considered: lossless, gentle, aggressive, outer" in out
    choice = out.strip().splitlines()[-1]
    assert choice.startswith("choice: ")
    assert sum(line.startswith("* ") for line in out.splitlines()) == 1
    code, out, _ = _cli(capsys, *base, "--bandwidth-mbit", "1e6", "--step-ms", "80", "--json")
    data = json.loads(out)
    assert code == 0 and data["choice"] == "none" and data["considered"] == list(QUALITIES)
    assert len(data["predictions"]) == len(default_candidates())
    none = data["predictions"][0]
    assert none["wire_bytes_per_exchange"] == measure_traffic("none", 8, params=params).wire_bytes


@pytest.mark.parametrize(("change", "message"), [
    ({"--params": "25Q"}, "`params` must be a count such as 25M or 1200000, got '25Q'"),
    ({"--workers": "1"}, "`workers` must be >= 2, got 1"),
    ({"--bandwidth-mbit": "-5"}, "`bandwidth_mbit` must be > 0, got -5.0"),
    ({"--step-ms": "0"}, "`step_ms` must be > 0, got 0.0"),
    ({"--quality": "gentle,fast"}, "`--quality` must be a comma-separated list"),
])
def test_the_command_refuses_bad_input_in_one_line(capsys, change, message) -> None:  # type: ignore[no-untyped-def]
    flags = {"--params": "1M", "--workers": "4", "--bandwidth-mbit": "10", "--step-ms": "50",
             **change}
    code, _, err = _cli(capsys, *(x for kv in flags.items() for x in kv), "--no-measure")
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1


def test_the_command_takes_a_count_or_a_model_not_both(capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--params", "1M", "--model", "resnet8", "--workers", "2",
              "--bandwidth-mbit", "1", "--step-ms", "1"])
    assert exit_.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_the_command_plans_a_runner_model(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    shapes = model_shapes("digitsnet", 10)
    timings = _timings_file(tmp_path, shapes, 0.001)
    code, out, err = _cli(capsys, "--model", "digitsnet", "--workers", "2", "--bandwidth-mbit",
                          "100", "--step-ms", "5", "--timings", str(timings), "--json")
    data = json.loads(out)
    assert code == 0 and err == ""  # every time cached: nothing measured
    assert data["params"] == sum(torch.Size(s).numel() for s in shapes.values())
    assert {p["compress_ms_per_exchange"] for p in data["predictions"]} == {1.0}


def test_a_runner_model_gives_its_shapes() -> None:
    shapes = model_shapes("transformer:dim=16,layers=1,heads=2", 50)
    assert sum(torch.Size(s).numel() for s in shapes.values()) > 50 * 16
    assert all(isinstance(s, tuple) for s in shapes.values())
