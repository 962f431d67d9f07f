"""Outer-step training over the emulated link (benchmarks/outer_netem.py and its report) without
rights: argument checks, the workers' commands, the stop at the target, the rows, speedups and
verdicts, and the delay estimate.

Nothing here creates a namespace or runs ``ip``/``tc``: the lab itself is tested in
test_netem_lab.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import _netlab as netlab
from benchmarks import _outer_netem_report as report
from benchmarks import outer_netem
from gradzip.cli import build_parser


@pytest.mark.parametrize("argv, message", [
    (["--workers", "1"], "`--workers` must be in [2, 64]"),
    (["--rtt-ms", "-5"], "`--rtt-ms` must be in [0, 2000], got -5"),
    (["--methods", "none", "sign"], "`--methods` entries must be among"),
    (["--methods", "none", "none"], "must not repeat"),
    (["--target", "1"], "`--target` must be > 1 (a perplexity), got 1"),
    (["--eval-every", "0"], "`--eval-every` must be >= 1, got 0"),
    (["--bandwidth-mbit", "0"], "`--bandwidth-mbit` values must be in (0, 100000]"),
])
def test_bad_arguments_are_refused(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        outer_netem.parse_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def _option(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_workers_run_gradzip_train_as_processes_evaluated_at_synchronisations(tmp_path):
    args = outer_netem.parse_args(["--workers", "2", "--bandwidth-mbit", "40", "150",
                                   "--methods", "none", "sparseloco30", "--runs", str(tmp_path)])
    cmds = outer_netem.dry_run(args)
    added = [c[3] for c in cmds if c[:3] == ["ip", "netns", "add"]]
    deleted = [c[3] for c in cmds if c[:3] == ["ip", "netns", "del"]]
    assert len(added) == 3 and deleted == added[::-1]
    assert sum("tbf" in c for c in cmds) == 2 * 4 and not any("netem" in c for c in cmds)
    runs = [c for c in cmds if c[:3] == ["ip", "netns", "exec"]]
    assert len(runs) == 4
    per_step, sparse = runs[0][4:], runs[1][4:]
    assert per_step[1:4] == ["-m", "gradzip", "train"]
    for argv in (per_step, sparse):
        assert (_option(argv, "--launcher"), _option(argv, "--workers"),
                _option(argv, "--checkpoint-every"), _option(argv, "--optimizer")) == (
            "procs", "2", "0", "adamw")
    assert _option(per_step, "--eval-every") == "10" and "--outer-steps" not in per_step
    assert _option(sparse, "--eval-every") == _option(sparse, "--outer-steps") == "30"
    assert _option(sparse, "--out") == str(tmp_path / "sparseloco30-40mbit")
    # gradzip's own parser accepts every word.
    parsed = build_parser().parse_args(sparse[3:])
    assert (parsed.eval_every, parsed.outer_optimizer, parsed.launcher) == (30, "ef-momentum",
                                                                             "procs")


def test_worker_environment_is_torchrun_style():
    lab = netlab.Lab(3, runner=lambda argv: "")
    env = outer_netem._env(lab, 29601, 2)
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME")} == {
        "RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "10.77.0.1", "MASTER_PORT": "29601", "GLOO_SOCKET_IFNAME": "eth0"}


def test_target_is_read_from_the_records_rank_0_writes(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert not outer_netem.target_reached(path, 650)
    path.write_text(json.dumps({"kind": "eval", "step": 10, "perplexity": 900.0}) + "\n"
                    + json.dumps({"kind": "step", "step": 11, "perplexity": 1.0}) + "\n"
                    + '{"kind": "eval", "step": 20, "perpl')
    assert not outer_netem.target_reached(path, 650)
    with open(path, "a") as fh:
        fh.write('exity": 600.0}\n')
    assert outer_netem.target_reached(path, 650)


def _child(code: str) -> subprocess.Popen[Any]:
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def test_runs_are_stopped_once_the_target_file_says_so(tmp_path):
    flag = tmp_path / "reached"
    # The child marks the point and then never ends by itself: only the stop ends it.
    child = _child(f"import pathlib, time; pathlib.Path({str(flag)!r}).write_text('x'); "
                   "time.sleep(3600)")
    assert netlab.wait_all([child], 600, stop=flag.exists) == "stopped"
    assert child.poll() is not None
    failing = _child("raise SystemExit(3)")
    assert netlab.wait_all([failing], 600, stop=lambda: False) == \
        "worker 0 exited with code 3"
    assert netlab.wait_all([_child("pass")], 600, stop=lambda: False) is None


def _record(method: str, rate: float, h: int, evals: list[tuple[int, float, float]],
            **extra: Any) -> dict[str, Any]:
    """A run record with evaluations (step, perplexity, train seconds); 1 MB per sync."""
    rows = [{"kind": "eval", "step": s, "perplexity": p, "train_seconds": t,
             "rounds": s // h if h else s, "wire_bytes": (s // h if h else s) * 10**6}
            for s, p, t in evals]
    return {"method": method, "label": method, "bandwidth_mbit": rate, "outer_steps": h,
            "evaluations": rows, "loadavg_before": [1.0], "loadavg_after": [2.0],
            "wall_seconds": 99.0, "kernel_tx_bytes": [5, 7], **extra}


def test_rows_count_only_synchronised_evaluations_of_outer_modes():
    rec = _record("diloco30", 40, 30, [(30, 900, 10.0), (45, 600, 15.0), (60, 640, 20.0),
                                        (90, 500, 30.0)])
    row = report.summarize(rec, 650, workers=4)
    assert (row["steps_to_target"], row["seconds_to_target"], row["syncs_to_target"],
            row["bytes_to_target"]) == (60, 20.0, 2, 2 * 10**6)
    assert row["seconds_per_step"] == pytest.approx(30 / 90)
    assert (row["final_perplexity"], row["best_perplexity"], row["syncs_run"]) == (500, 500, 3)
    # A ring all-reduce over 4 workers: 6 hops of 50 ms per synchronisation.
    assert row["rtt_seconds_per_sync"] == pytest.approx(0.3)
    assert row["seconds_to_target_with_rtt"] == pytest.approx(20.6)
    assert row["kernel_tx_bytes_max"] == 7
    never = report.summarize(_record("topk1", 40, 0, [(10, 900, 5.0), (20, 700, 9.0)]), 650)
    assert never["seconds_to_target"] is None and never["final_perplexity"] == 700


def test_speedups_and_verdicts_per_link():
    rows = [report.summarize(r, 650) for r in [
        _record("none", 40, 0, [(10, 800, 20.0), (20, 640, 40.0)]),
        _record("topk1", 40, 0, [(10, 700, 5.0), (20, 600, 12.0)]),
        _record("diloco30", 40, 30, [(30, 600, 3.0)]),
        _record("sparseloco30", 40, 30, [(30, 700, 2.0)]),
        _record("none", 150, 0, [(10, 600, 8.0)]),
        _record("diloco30", 150, 30, [(30, 600, 6.0)]),
        {"method": "topk1", "label": "topk1", "bandwidth_mbit": 150, "outer_steps": 0,
         "error": "timed out after 5 s"},
    ]]
    table = report.speedups(rows)
    slow, fast = table
    assert (slow["best_outer"], slow["best_per_step"]) == ("diloco30", "topk1")
    assert slow["speedup_vs_best_per_step"] == pytest.approx(4.0)
    assert slow["speedup_vs_none"] == pytest.approx(40 / 3)
    assert slow["met_vs_best_per_step"] and slow["met_vs_none"]
    assert fast["speedup_vs_none"] == pytest.approx(8 / 6)
    assert not fast["met_vs_best_per_step"] and not fast["met_vs_none"]
    assert rows[1]["speedup_vs_none"] == pytest.approx(40 / 12)
    assert rows[3]["speedup_vs_none"] is None  # never reached
    doc = {"meta": {"target_perplexity": 650}, "rows": rows, "speedups": table}
    lines = report.markdown(doc).splitlines()
    assert sum(line.startswith("| 40 Mbit/s") for line in lines) == 4
    assert "failed: timed out after 5 s" in "\n".join(lines)
    assert any("3x: missed" in line and "10x: missed" in line for line in lines)


def test_report_recomputes_from_a_results_file(tmp_path: Path, capsys):
    runs = [_record("none", 40, 0, [(10, 600, 20.0)]), _record("diloco30", 40, 30, [(30, 600, 1.0)])]
    out = tmp_path / "r.json"
    doc = report.write_outputs(out, {"args": {"workers": 4}}, runs, 650)
    assert doc["speedups"][0]["met_vs_none"]
    assert out.with_suffix(".md").read_text().startswith("Target: validation perplexity <= 650")
    assert report.main([str(out), "500"]) == 0
    assert "not reached" in capsys.readouterr().out
    assert report.main([str(out), "1"]) == 2
    # Rewritten for two targets: the first is the document's, the other kept beside it.
    assert report.main([str(out), "500", "650", "--write"]) == 0
    again = json.loads(out.read_text())
    assert again["meta"]["target_perplexity"] == 500 and again["rows"][0]["seconds_to_target"] is None
    assert again["other_targets"]["650"]["rows"][0]["seconds_to_target"] == 20.0
    assert out.with_suffix(".md").read_text().count("Target: validation perplexity") == 2


def test_hops_per_synchronisation():
    assert [report.hops_per_sync(m, 4) for m in ("none", "topk1", "diloco30", "diloco30-8bit",
                                                  "sparseloco30", "powersgd4")] == [6, 3, 6, 6, 3, 12]
    with pytest.raises(ValueError, match="`workers` must be >= 2, got 1"):
        report.hops_per_sync("none", 1)
