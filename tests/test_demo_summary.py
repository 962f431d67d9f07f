"""The demo's table and one-line summary (gradzip.train.demo_summary): methods merged over their
seeds, the methods no other method beats on both mean metric and mean bytes, Accordion against
its static levels seed by seed, no verdict from runs no better than chance; and the lines under
the table of a real, shrunk `gradzip demo`."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from gradzip.cli import main
from gradzip.train.demo import demo_grid
from gradzip.train.demo_summary import (
    accordion_verdict,
    by_method,
    efficient,
    format_methods,
    summary_line,
)


def _row(label: str, final: float | None, sent: int, compressor: str, accordion: str = "",
         metric: str = "accuracy", seed: int | None = None) -> dict[str, object]:
    row: dict[str, object] = {
        "label": label if seed is None else f"{label} [seed={seed}]", "final": final,
        "bytes_sent_per_worker": sent, "metric": metric, "compressor": compressor,
        "accordion": accordion, "compression": 2.0, "wall_seconds": 1.0}
    if seed is not None:
        row["seed"] = seed
    return row


ROWS = [_row("none", 0.95, 1000, "none"), _row("r1", 0.80, 100, "powersgd:rank=1"),
        _row("r4", 0.96, 300, "powersgd:rank=4"), _row("topk", 0.70, 150, "topk:ratio=0.01"),
        _row("acc", 0.90, 200, "powersgd:rank=1", "powersgd:rank=4")]


def _seeded(table: dict[str, tuple[str, str, list[float], list[int]]]) -> list[dict[str, object]]:
    """Grid rows from ``{label: (compressor, accordion, finals per seed, bytes per seed)}``."""
    return [_row(label, final, sent, comp, acc, seed=seed)
            for label, (comp, acc, finals, sents) in table.items()
            for seed, (final, sent) in enumerate(zip(finals, sents, strict=True))]


def test_efficient_runs_are_those_no_run_beats_on_both() -> None:
    assert [r["label"] for r in efficient(ROWS)] == ["r1", "acc", "r4"]
    # A tie on both counts is kept on both sides; an unfinished run is left out.
    tied = [*ROWS, _row("r4 again", 0.96, 300, "x"), _row("failed", None, 1, "y")]
    assert [r["label"] for r in efficient(tied)] == ["r1", "acc", "r4", "r4 again"]
    # Perplexity: lower is better.
    lm = [_row("a", 100.0, 10, "a", metric="perplexity"), _row("b", 90.0, 20, "b",
                                                                metric="perplexity"),
          _row("c", 95.0, 30, "c", metric="perplexity")]
    assert [r["label"] for r in efficient(lm)] == ["a", "b"]


def test_seeds_of_one_method_merge_into_means_and_ranges() -> None:
    rows = _seeded({"r1": ("powersgd:rank=1", "", [0.5, 0.9, 0.7], [100, 100, 100]),
                    "acc": ("powersgd:rank=1", "powersgd:rank=4", [0.8, 0.9, 1.0], [190, 200, 210])})
    rows.append(_row("r4", None, 300, "powersgd:rank=4", seed=0))  # unfinished: no mean
    methods = by_method(rows)
    assert [m["label"] for m in methods] == ["r1", "acc", "r4"]
    assert methods[0]["finals"] == {0: 0.5, 1: 0.9, 2: 0.7}
    assert methods[0]["final"] == pytest.approx(0.7)
    assert methods[1]["bytes_sent_per_worker"] == pytest.approx(200.0)
    assert methods[1]["accordion"] == "powersgd:rank=4"
    assert methods[2]["final"] is None and methods[2]["finals"] == {}
    table = format_methods(methods).splitlines()
    assert table[0].startswith("run (3 seeds)") and "range" in table[0]
    assert "70.0%" in table[2] and "50.0-90.0" in table[2]
    assert table[4].split()[1:3] == ["-", "-"]


def test_accordion_against_its_levels_and_the_line_between_them() -> None:
    methods = by_method(ROWS)
    text = accordion_verdict(methods[-1], methods)
    # 6 points under r4 at 2/3 of its bytes; the line r1 -> r4 gives 88% at 200 bytes.
    assert text is not None and text.startswith("acc 90.0%: -6.0 points against r4 at 0.67x")
    assert "+2.0 points against the line from r1 to r4" in text
    assert "one seed: not a verdict" in text
    # Without the static gentle level there is nothing to compare with.
    assert accordion_verdict(methods[-1], [methods[0], methods[-1]]) is None
    lm = by_method([_row("g", 100.0, 30, "topk:ratio=0.99", metric="perplexity"),
                    _row("w", 120.0, 10, "topk:ratio=0.02", metric="perplexity"),
                    _row("acc", 105.0, 20, "topk:ratio=0.02", "topk:ratio=0.99",
                         metric="perplexity")])
    text = accordion_verdict(lm[-1], lm)
    assert text is not None and "+5.00 against g at 0.67x" in text
    assert "+5.00 against the line" in text  # 110 on the line, lower is better


def test_the_verdict_against_the_line_needs_every_seed() -> None:
    levels = {"r1": ("powersgd:rank=1", "", [0.80, 0.50, 0.80], [100, 100, 100]),
              "r4": ("powersgd:rank=4", "", [0.96, 0.96, 0.96], [300, 300, 300])}
    # The line is at 88%, 73%, 88% (200 bytes): above on every seed.
    above = by_method(_seeded({**levels, "acc": ("powersgd:rank=1", "powersgd:rank=4",
                                                 [0.90, 0.80, 0.89], [200, 200, 200])}))
    text = accordion_verdict(above[-1], above)
    assert text is not None
    assert "+3.3 points (seeds +1.0 to +7.0) against the line" in text
    assert "above on every seed: its timing beats a plain split" in text
    below = by_method(_seeded({**levels, "acc": ("powersgd:rank=1", "powersgd:rank=4",
                                                 [0.85, 0.70, 0.80], [200, 200, 200])}))
    assert "below on every seed: no better than a plain split" in accordion_verdict(below[-1],
                                                                                     below)
    # A one-seed swing (the 50% seed of r1 puts the line low) does not make a verdict.
    mixed = by_method(_seeded({**levels, "acc": ("powersgd:rank=1", "powersgd:rank=4",
                                                 [0.85, 0.80, 0.85], [200, 200, 200])}))
    assert "the seeds disagree: no verdict" in accordion_verdict(mixed[-1], mixed)


def test_summary_line_is_one_line_and_validates() -> None:
    line = summary_line(ROWS)
    assert line.startswith("summary: best for their bytes (no other run is both better and "
                           "cheaper; one seed): r4 96.0%, acc 90.0%, r1 80.0%; acc 90.0%")
    assert "\n" not in line
    seeded = _seeded({"a": ("none", "", [0.9, 0.8], [10, 10]), "b": ("x", "", [0.5, 0.7], [5, 5])})
    assert summary_line(seeded).startswith("summary: best for their bytes (no other run is both "
                                           "better and cheaper, means of 2 seeds): a 85.0%, "
                                           "b 60.0%")
    with pytest.raises(ValueError, match="`rows` must hold at least one row"):
        summary_line([])
    with pytest.raises(TypeError, match="`rows` must be a list of dicts"):
        summary_line("rows")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`rows` must share one metric"):
        summary_line([ROWS[0], _row("p", 90.0, 1, "x", metric="perplexity")])
    with pytest.raises(TypeError, match="`chance` must be a number or None, got str"):
        summary_line(ROWS, chance="0.1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`chance` must be > 0, got 0"):
        summary_line(ROWS, chance=0)


def test_no_verdict_from_runs_no_better_than_chance() -> None:
    assert summary_line(ROWS, chance=0.1).startswith("summary: best for their bytes")
    weak = [*ROWS[:-1], _row("acc", 0.08, 200, "powersgd:rank=1", "powersgd:rank=4")]
    line = summary_line(weak, chance=0.1)
    assert line == ("summary: no verdict: acc 8.0% no better than chance (10.0%); the runs are "
                    "too short to compare methods")
    # Exactly at chance is no better than chance; perplexity: at or above the vocabulary size.
    assert "no verdict" in summary_line([_row("a", 0.1, 1, "a")], chance=0.1)
    lm = [_row("a", 900.0, 10, "a", metric="perplexity"),
          _row("b", 1000.0, 20, "b", metric="perplexity")]
    assert summary_line(lm, chance=1000.0).startswith("summary: no verdict: b 1000.00")


def test_demo_grid_runs_every_method_on_each_seed(tmp_path: Path) -> None:
    grid = demo_grid(2, {"epochs": 1}, str(tmp_path))
    labels = [r.label for r in grid.runs]
    assert labels[:4] == ["none [seed=0]", "none [seed=1]", "topk 1% [seed=0]", "topk 1% [seed=1]"]
    assert len(labels) == 12 and len({r.config.out for r in grid.runs}) == 12
    assert [r.config.seed for r in grid.runs[:2]] == [0, 1]
    assert all(r.config.epochs == 1 for r in grid.runs)
    with pytest.raises(ValueError, match="`seeds` must be >= 1, got 0"):
        demo_grid(0)
    with pytest.raises(TypeError, match="`seeds` must be an integer, got float"):
        demo_grid(2.0)  # type: ignore[arg-type]


@pytest.mark.slow
def test_demo_prints_the_summary_of_its_own_table(capsys: pytest.CaptureFixture[str],
                                                  tmp_path: Path) -> None:
    out = tmp_path / "demo"
    code = main(["demo", "--out", str(out), "--epochs", "1", "--limit-train", "300", "--seeds",
                 "2", "--quiet"])
    stdout = capsys.readouterr().out
    assert code == 0
    lines = [line for line in stdout.splitlines() if line.startswith("summary: ")]
    assert len(lines) == 1
    with (out / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 12 and {r["seed"] for r in rows} == {"0", "1"}
    for r in rows:
        r["final"] = float(r["final"])
        r["bytes_sent_per_worker"] = int(r["bytes_sent_per_worker"])
        r["compression"] = float(r["compression"])
        r["wall_seconds"] = float(r["wall_seconds"])
    assert lines[0] == summary_line(rows, chance=0.1)
    assert format_methods(by_method(rows)).splitlines()[0] in stdout
    assert (out / "demo.png").stat().st_size > 0 and (out / "compare.png").stat().st_size > 0


def test_demo_quick_gives_no_verdict_below_chance(capsys: pytest.CaptureFixture[str],
                                                  tmp_path: Path) -> None:
    # One step on 64 images cannot teach 10 classes: the runs stay near chance, and the line
    # under the table says there is nothing to compare rather than ranking noise.
    out = tmp_path / "demo"
    code = main(["demo", "--out", str(out), "--quick", "--limit-train", "64", "--quiet"])
    stdout = capsys.readouterr().out
    assert code == 0 and "run (one seed)" in stdout
    summary = [line for line in stdout.splitlines() if line.startswith("summary: ")]
    with (out / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r["final"] = float(r["final"])
        r["bytes_sent_per_worker"] = int(r["bytes_sent_per_worker"])
    assert min(r["final"] for r in rows) <= 0.1
    assert summary == [summary_line(rows, chance=0.1)]
    assert summary[0].startswith("summary: no verdict: ") and "chance (10.0%)" in summary[0]
