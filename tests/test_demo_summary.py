"""The demo's one-line summary (gradzip.train.demo_summary): the runs no other run beats on
both metric and bytes, and Accordion against its static levels, computed from the table; and
the line under the table of a real, shrunk `gradzip demo`."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from gradzip.cli import main
from gradzip.train.demo_summary import accordion_verdict, efficient, summary_line


def _row(label: str, final: float | None, sent: int, compressor: str, accordion: str = "",
         metric: str = "accuracy") -> dict[str, object]:
    return {"label": label, "final": final, "bytes_sent_per_worker": sent, "metric": metric,
            "compressor": compressor, "accordion": accordion}


ROWS = [_row("none", 0.95, 1000, "none"), _row("r1", 0.80, 100, "powersgd:rank=1"),
        _row("r4", 0.96, 300, "powersgd:rank=4"), _row("topk", 0.70, 150, "topk:ratio=0.01"),
        _row("acc", 0.90, 200, "powersgd:rank=1", "powersgd:rank=4")]


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


def test_accordion_against_its_levels_and_the_line_between_them() -> None:
    text = accordion_verdict(ROWS[-1], ROWS)
    # 6 points under r4 at 2/3 of its bytes; the line r1 -> r4 gives 88% at 200 bytes.
    assert text is not None and text.startswith("acc 90.0%: -6.0 points against r4 at 0.67x")
    assert "2.0 points above the line from r1 to r4" in text and "beats" in text
    below = [*ROWS[:-1], _row("acc", 0.85, 200, "powersgd:rank=1", "powersgd:rank=4")]
    assert "3.0 points below the line" in accordion_verdict(below[-1], below)
    assert "no better than" in accordion_verdict(below[-1], below)
    # Without the static gentle level there is nothing to compare with.
    assert accordion_verdict(ROWS[-1], [ROWS[0], ROWS[-1]]) is None
    lm = [_row("g", 100.0, 30, "topk:ratio=0.99", metric="perplexity"),
          _row("w", 120.0, 10, "topk:ratio=0.02", metric="perplexity"),
          _row("acc", 105.0, 20, "topk:ratio=0.02", "topk:ratio=0.99", metric="perplexity")]
    assert "+5.00 against g at 0.67x" in accordion_verdict(lm[-1], lm)
    assert "5.00 above the line" in accordion_verdict(lm[-1], lm)  # 110 on the line


def test_summary_line_is_one_line_and_validates() -> None:
    line = summary_line(ROWS)
    assert line.startswith("summary: best for their bytes (no other run is both better and "
                           "cheaper): r4 96.0%, acc 90.0%, r1 80.0%; acc 90.0%")
    assert "\n" not in line
    with pytest.raises(ValueError, match="`rows` must hold at least one row"):
        summary_line([])
    with pytest.raises(TypeError, match="`rows` must be a list of dicts"):
        summary_line("rows")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`rows` must share one metric"):
        summary_line([ROWS[0], _row("p", 90.0, 1, "x", metric="perplexity")])


def test_demo_prints_the_summary_of_its_own_table(capsys: pytest.CaptureFixture[str],
                                                  tmp_path: Path) -> None:
    out = tmp_path / "demo"
    code = main(["demo", "--out", str(out), "--epochs", "1", "--limit-train", "300", "--quiet"])
    stdout = capsys.readouterr().out
    assert code == 0
    lines = [line for line in stdout.splitlines() if line.startswith("summary: ")]
    assert len(lines) == 1
    with (out / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r["final"] = float(r["final"])
        r["bytes_sent_per_worker"] = int(r["bytes_sent_per_worker"])
    assert lines[0] == summary_line(rows)
    assert "accordion r1<->r4" in lines[0]  # its levels are both in the demo
