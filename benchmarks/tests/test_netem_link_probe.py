"""The link-probe benchmark: its fits and table from made-up probes, its arguments, its dry
run (the lab itself needs root; ``benchmarks/netem_link_probe.py`` runs it)."""

from __future__ import annotations

import pytest

from benchmarks import netem_link_probe as lp

# Two workers over a 100 Mbit/s link with a 32 KiB burst and 0.2 ms a call: the one-float
# call, then 64 KiB (half of it past the burst), then 256 KiB.
BURST, RATE, CALL_S = 32_768, 100e6, 0.2e-3


def cost(nbytes: int) -> float:
    return CALL_S + max(0, nbytes - BURST) * 8 / RATE


PROBE = [[4, cost(4)], [65536, cost(65536)], [262144, cost(262144)]]


def test_the_grown_fit_reads_the_rate_and_the_64_kib_one_twice_it() -> None:
    got = lp.fits(PROBE, 2)
    assert got["grown_mbit"] == pytest.approx(100, rel=1e-9)
    assert got["fixed_mbit"] == pytest.approx(200, rel=1e-3)  # half its bytes rode the burst
    assert got["grown_rtt_ms"] == pytest.approx(0.1, rel=1e-2)  # 0.2 ms over two hops
    assert got["largest_bytes"] == 262144
    assert got["probe_ms"] == pytest.approx(1e3 * sum(t for _, t in PROBE))
    # A probe that never grew (the tensors no larger than 64 KiB) has one fit, read twice.
    short = lp.fits(PROBE[:2], 2)
    assert short["grown_mbit"] == short["fixed_mbit"]


def test_summary_and_table() -> None:
    record = {"world": 2, "probes": [PROBE, PROBE[:2]]}
    row = lp.summarise(100.0, 95.0, record)
    assert row["probes"] == 2 and row["grown_mbit_range"] == pytest.approx([100, 200], rel=1e-3)
    assert row["grown_over_goodput"] == pytest.approx(150 / 95, rel=1e-3)
    text = lp.table([row])
    assert text.splitlines()[2].startswith("| 100 | 95 | 150 (100-200) | 1.58 |")
    # Where the whole probe was timed (its repeated message and maxima included), that time
    # is the probe's.
    timed = lp.summarise(100.0, 95.0, {**record, "probe_seconds": [0.03, 0.01]})
    assert timed["probe_ms"] == pytest.approx(20.0) and timed["probe_ms_range"] == [10.0, 30.0]
    fast = lp.summarise(1000.0, 950.0, {"world": 2, "probes": [[[4, 1e-4], [65536, 1e-4]]]})
    assert "unbounded" in lp.table([fast])  # no time for the size: the old probe's failure


@pytest.mark.parametrize(("argv", "match"), [
    (["--bandwidth-mbit", "0"], "bandwidth-mbit"),
    (["--rounds", "0"], "rounds"),
    (["--compute-ms", "-1"], "compute-ms"),
])
def test_arguments_are_checked(argv: list[str], match: str,
                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        lp.parse_args(argv)
    assert match in capsys.readouterr().err


def test_dry_run_shapes_each_link_and_runs_the_workers_in_the_namespaces() -> None:
    args = lp.parse_args(["--bandwidth-mbit", "1000", "10"])
    cmds = lp.dry_run(args)
    rates = [c[c.index("rate") + 1] for c in cmds if "tbf" in c and "add" in c]
    assert {"1000mbit", "10mbit"} <= set(rates)
    workers = [c for c in cmds if "worker" in c]
    assert len(workers) == 2 and all(c[:3] == ["ip", "netns", "exec"] for c in workers)
