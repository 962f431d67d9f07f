"""The claims benchmark (benchmarks/claims.py): its grid, the critical-regime schedules, and a
seconds-long smoke grid run end to end (parallel processes, resume, deadline, archive,
claims.json rows from the runs' own summaries)."""

from __future__ import annotations

import json
import tarfile
import time
from pathlib import Path

import pytest

from benchmarks import _claims_plot, claims
from gradzip.control import parse_level_schedule


def test_critical_regimes_and_their_schedules() -> None:
    setting = claims.SETTINGS["cifar10-resnet8"]
    ranges = claims.critical_ranges(setting, 20, [0.5, 0.75])
    assert ranges == [(0.0, 2.0), (10.0, 12.0), (15.0, 17.0)]
    gentle = claims.schedule_text(ranges, 20, True)
    assert gentle == ("gentle:0-2,aggressive:2-10,gentle:10-12,aggressive:12-15,gentle:15-17,"
                      "aggressive:17-20")
    assert parse_level_schedule(gentle) == ranges
    reverse = claims.schedule_text(ranges, 20, False)
    assert parse_level_schedule(reverse) == [(2.0, 10.0), (12.0, 15.0), (17.0, 20.0)]
    # Overlapping regimes merge (a drop inside the first K epochs).
    assert claims.critical_ranges(setting, 4, [2.0]) == [(0.0, 4.0)]


def test_grid_holds_every_role_once_per_family_and_seed(tmp_path: Path) -> None:
    setting = claims.SETTINGS["cifar10-resnet8"]
    runs = claims.plan(setting, [0, 1], tmp_path, {"data": "x"})
    roles = {(r.family, r.role) for r in runs}
    for family in ("powersgd", "topk"):
        for role in ("gentle", "aggressive", "accordion", "critical-gentle", "critical-aggressive"):
            assert (family, role) in roles
    assert ("dense", "none") in roles
    assert {r.role for r in runs} == set(claims.ROLES)
    per_seed = [r for r in runs if r.seed == 0]
    assert len(per_seed) == 1 + 2 * 5 + 2 * 3
    assert len({r.config.out for r in runs}) == len(runs)  # one folder each
    acc = next(r for r in per_seed if r.family == "powersgd" and r.role == "accordion")
    assert (acc.config.compressor, acc.config.accordion) == ("powersgd:rank=1", "powersgd:rank=4")
    assert acc.config.threads == 1
    picked = claims.select(runs, ["accordion/topk", "/dense"])
    assert {(r.family, r.role) for r in picked} == {("topk", "accordion"), ("dense", "none")}


@pytest.mark.slow
def test_smoke_grid_runs_resumes_packs_and_collects(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    root, archive, results = tmp_path / "runs", tmp_path / "out.tar.gz", tmp_path / "results"
    common = ["--settings", "smoke", "--seeds", "0", "--root", str(root), "--results", str(results),
              "--only", "accordion", "--only", "critical-aggressive"]
    assert claims.main([*common, "--parallel", "2", "--pack", str(archive)]) == 0
    names = set(tarfile.open(archive).getnames())
    for role in ("accordion", "critical-aggressive"):
        assert f"smoke/powersgd/{role}/seed0/summary.json" in names
        assert f"smoke/powersgd/{role}/seed0/metrics.jsonl" in names
    # A second call finds both finished and launches nothing; so does one on a fresh root
    # restored from the archive (a grid continued on another machine).
    capsys.readouterr()
    assert claims.main([*common, "--parallel", "2"]) == 0
    assert '"skipped": 2' in capsys.readouterr().err
    fresh = [a if a != str(root) else str(tmp_path / "fresh") for a in common]
    assert claims.main([*fresh, "--resume-from", str(archive)]) == 0
    err = capsys.readouterr().err
    assert "restored 2 finished runs" in err and '"skipped": 2' in err
    assert claims.main([*common, "--collect"]) == 0
    rows = json.loads((results / "claims.json").read_text())
    assert sorted(r["role"] for r in rows) == ["accordion", "critical-aggressive"]
    for row in rows:
        summary = json.loads((root / "smoke" / "powersgd" / row["role"] / "seed0" /
                              "summary.json").read_text())
        assert set(row) == {"setting", "family", "role", "spec", "seed", "metric", "final",
                            "wire_bytes_per_worker"}
        assert row["metric"] == "accuracy" and row["final"] == round(100 * summary["final_accuracy"], 6)
        assert row["wire_bytes_per_worker"] == summary["bytes_sent_per_worker"]
    assert "critical-aggressive" in capsys.readouterr().out
    assert (results / "claims.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_deadline_launches_nothing_too_long_and_ends_runs_in_flight(tmp_path: Path) -> None:
    runs = claims.select(claims.plan(claims.SETTINGS["smoke"], [0], tmp_path, {"epochs": 100_000}),
                         ["gentle"])
    # Expected to take longer than the time left: not launched.
    counts = claims.execute(runs, 1, time.monotonic() + 30, None, tmp_path, estimate_s=1000)
    assert counts == {"skipped": 0, "done": 0, "failed": 0, "stopped": 0, "left": 1}
    # Launched without an estimate, ended at the deadline, its partial files kept aside (and
    # packed); the next call starts it afresh. The deadline is reached on the run's progress,
    # not on the wall clock: the clock reads before the deadline until the run's process has
    # written its first epoch record, then past it, however slow the machine. 100,000 epochs:
    # a run that cannot finish first.
    out = Path(runs[0].config.out)
    metrics = out / "metrics.jsonl"

    def clock() -> float:
        recorded = metrics.is_file() and b'"kind": "epoch"' in metrics.read_bytes()
        return 100.0 if recorded else 0.0

    archive = tmp_path / "out.tar.gz"
    counts = claims.execute(runs, 1, 50.0, archive, tmp_path, margin_s=0.0, clock=clock)
    assert counts["stopped"] == 1 and counts["done"] == 0
    assert not out.exists() and out.with_name("seed0.stopped").is_dir()
    names = tarfile.open(archive).getnames()
    assert "smoke/powersgd/gentle/seed0.log" in names
    assert "smoke/powersgd/gentle/seed0.stopped/metrics.jsonl" in names


def test_plot_summarises_seeds_and_draws_one_panel_per_setting(tmp_path: Path) -> None:
    def row(setting: str, role: str, seed: int, final: float | None, nbytes: int,
            family: str = "powersgd", spec: str = "s") -> dict[str, object]:
        return {"setting": setting, "family": family, "role": role, "spec": spec, "seed": seed,
                "metric": "accuracy", "final": final, "wire_bytes_per_worker": nbytes}

    rows = [row("a", "gentle", 0, 70.0, 2_000_000), row("a", "gentle", 1, 72.0, 4_000_000),
            row("a", "aggressive", 0, None, 1_000_000),
            row("b", "topk", 0, 60.0, 1_000_000, "sparse", "topk:ratio=0.01"),
            row("b", "threshold", 0, 61.0, 900_000, "sparse", "threshold:budget=0.01")]
    groups = _claims_plot.summarise(rows)
    gentle = next(g for g in groups if g["role"] == "gentle")
    assert (gentle["seeds"], gentle["mean"], gentle["low"], gentle["high"], gentle["mb"]) == \
        (2, 71.0, 70.0, 72.0, 3.0)
    assert not any(g["role"] == "aggressive" for g in groups)  # no final value: left out
    assert _claims_plot.plot(rows, tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    assert not _claims_plot.plot([row("a", "gentle", 0, None, 1)], tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


def test_text_layout_repoints_links_left_by_another_checkout(tmp_path: Path) -> None:
    source = tmp_path / "wikitext" / "wikitext-2-partial"
    source.mkdir(parents=True)
    (source / "test.txt").write_text("a b c\n")
    (source / "valid.txt").write_text("b c\n")
    work = tmp_path / "runs" / "data"
    dest = work / "wikitext-2-train-on-test"
    dest.mkdir(parents=True)
    (dest / "train.txt").symlink_to(tmp_path / "gone" / "test.txt")  # dangling
    (dest / "valid.txt").symlink_to(source / "test.txt")  # stale: the wrong file
    assert claims.text_dir(tmp_path / "wikitext", work) == dest
    assert (dest / "train.txt").read_text() == "a b c\n"
    assert (dest / "valid.txt").read_text() == "b c\n"
    # A second call keeps the (now correct) links.
    assert claims.text_dir(tmp_path / "wikitext", work) == dest
    assert (dest / "train.txt").resolve() == (source / "test.txt").resolve()
