"""The outer lr x momentum x H sweep (benchmarks/outer_sweep.py) at a tiny setting: every run
written once and skipped when present, the summary's best setting and the default's verdict,
and the argument checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import outer_sweep
from gradzip.outer.defaults import outer_defaults

TINY = ["--steps", "4", "--hs", "2", "4", "--workers", "2", "--lm-chars", "3000"]


def _corpus(tmp_path: Path) -> Path:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text = "the quick brown fox jumps over the lazy dog. " * 80
    (corpus / "test.txt").write_text(text)
    (corpus / "valid.txt").write_text(text[:2000])
    return corpus


def test_tiny_sweep_runs_once_resumes_and_summarises(tmp_path: Path) -> None:
    runs, summary = tmp_path / "runs", tmp_path / "summary"
    lrs = sorted({0.5, outer_defaults(2)[0], outer_defaults(4)[0]})
    argv = [*TINY, "--runs", str(runs), "--summary", str(summary), "--seeds", "0",
            "--corpus", str(_corpus(tmp_path)), "--momenta", "0.9",
            "--lrs", *map(str, lrs)]
    assert outer_sweep.main(argv) == 0
    files = sorted(runs.glob("*.json"))
    # Both tasks, both H, each lr at momentum 0.9; the default shares its grid point's file
    # when the rule's momentum is 0.9, else it has one of its own.
    expected = set()
    for task in ("lm", "cnn"):
        for h in (2, 4):
            expected |= {outer_sweep.run_key(task, h, lr, 0.9, 0) for lr in lrs}
            expected.add(outer_sweep.run_key(task, h, *outer_defaults(h), 0))
    assert {f.stem for f in files} == expected
    record = json.loads((runs / f"{outer_sweep.run_key('cnn', 2, 0.5, 0.9, 0)}.json").read_text())
    assert (record["outer_lr"], record["outer_momentum"], record["syncs"]) == (0.5, 0.9, 2)
    assert record["task"] == "cnn" and record["h"] == 2 and record["workers"] == 2
    stamps = {f.name: f.stat().st_mtime_ns for f in files}

    # A second call finds every run and only summarises: nothing is rewritten.
    assert outer_sweep.main(argv) == 0
    assert {f.name: f.stat().st_mtime_ns for f in runs.glob("*.json")} == stamps

    result = json.loads(summary.with_suffix(".json").read_text())
    assert len(result["verdicts"]) == 4
    for v in result["verdicts"]:
        metrics = {(s["outer_lr"], s["outer_momentum"]): s["metric"]["mean"]
                   for s in result["settings"] if s["task"] == v["task"] and s["h"] == v["h"]}
        grid = {k: m for k, m in metrics.items() if k[1] == 0.9 and k[0] in lrs}
        assert v["best"]["metric"] == min(grid.values())
        assert v["ratio"] == metrics[outer_defaults(v["h"])] / min(grid.values())
        assert v["met"] == (v["ratio"] <= 1 + outer_sweep.TOLERANCE)
    text = summary.with_suffix(".md").read_text()
    assert "### lm, H = 4" in text and "### cnn, H = 2" in text and "within 5%" in text


def test_a_setting_missing_a_seed_is_not_a_candidate_for_the_best(tmp_path: Path) -> None:
    lr, m = outer_defaults(10)
    low, high = lr / 4, lr / 2  # grid points that are not the rule's setting
    grid = outer_sweep.Grid(tasks=("cnn",), hs=(10,), lrs=(low, high), momenta=(0.9,), steps=20,
                            workers=2)
    rows = [(lr, m, 0, 1.0), (lr, m, 1, 1.0), (low, 0.9, 0, 0.5), (high, 0.9, 0, 2.0),
            (high, 0.9, 1, 2.0)]
    for r_lr, r_m, seed, metric in rows:
        rec = {"task": "cnn", "h": 10, "seed": seed, "steps": 20, "workers": 2,
               "outer_lr": r_lr, "outer_momentum": r_m, "metric": metric}
        (tmp_path / f"{outer_sweep.run_key('cnn', 10, r_lr, r_m, seed)}.json").write_text(json.dumps(rec))
    result = outer_sweep.summarise(grid, [0, 1], tmp_path)
    (v,) = result["verdicts"]
    # ``low`` has seed 0 only: the best is ``high``, averaged over the default's seeds 0 and 1.
    assert v["seeds"] == [0, 1] and v["compared"] == 1
    assert v["best"] == {"outer_lr": high, "outer_momentum": 0.9, "metric": 2.0}
    assert v["ratio"] == 0.5 and v["met"]


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "`--steps` must be >= 1, got 0"),
    (["--hs", "7"], "`--hs` must divide `--steps` (600)"),
    (["--lrs", "0"], "`--lrs` must be in (0, inf), got [0.0]"),
    (["--momenta", "1.0"], "`--momenta` must be in (0, 1), got [1.0]"),
])
def test_bad_arguments_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                   argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as info:
        outer_sweep.main(["--runs", str(tmp_path), *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_fit_takes_the_smallest_lr_within_tolerance_on_all_tasks_else_the_primary() -> None:
    def row(task: str, h: int, lr: float, metric: float) -> dict:
        return {"task": task, "h": h, "outer_lr": lr, "outer_momentum": 0.9,
                "metric": {"mean": metric}}
    summary = {"grid": {"tasks": ["lm", "cnn"], "hs": [10, 30, 100]}, "settings": [
        # H = 10: lr 0.3 and 0.5 are within 5% on both tasks; the smaller is taken.
        row("lm", 10, 0.1, 11.0), row("lm", 10, 0.3, 10.4), row("lm", 10, 0.5, 10.0),
        row("cnn", 10, 0.1, 1.0), row("cnn", 10, 0.3, 1.04), row("cnn", 10, 0.5, 1.05),
        # H = 30: none within 5% on both; 0.5 and 0.7 are on lm: the smaller.
        row("lm", 30, 0.1, 12.0), row("lm", 30, 0.5, 10.3), row("lm", 30, 0.7, 10.0),
        row("cnn", 30, 0.1, 1.0), row("cnn", 30, 0.5, 1.2), row("cnn", 30, 0.7, 1.3),
        row("cnn", 30, 1.0, 0.1)]}  # on one task only: its best, never picked; no H = 100
    at10, at30 = outer_sweep.fit(summary)
    assert (at10["h"], at10["outer_lr"], at10["basis"]) == (10, 0.3, "all tasks")
    assert at10["ratios"] == {"lm": 1.04, "cnn": 1.04}
    assert (at30["h"], at30["outer_lr"], at30["basis"]) == (30, 0.5, "lm")
    assert at30["ratios"] == {"lm": 10.3 / 10.0, "cnn": 1.2 / 0.1}
