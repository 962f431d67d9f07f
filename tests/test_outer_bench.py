"""The outer-step benchmark (benchmarks/outer.py): its corpus builder, its commands, a tiny
grid run end to end on a corpus the test writes, and its verdicts on fixed aggregates."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

from integrations_launch import load_script

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"

outer = load_script(BENCH / "outer.py", "outer_bench")

WORDS = ("the of and a to in is was on for as with by he at from his an were are which "
         "this be also had it first one their its new after but who not they have").split()


def _source(root: Path, lines: int = 74, per_line: int = 12) -> Path:
    """A WikiText-like folder: test.txt and valid.txt of short lines of common words."""
    root.mkdir(parents=True, exist_ok=True)
    for name, shift in (("test.txt", 0), ("valid.txt", 7)):
        text = "".join(
            " ".join(WORDS[(i * 5 + j * 3 + shift) % len(WORDS)] for j in range(per_line)) + "\n"
            for i in range(lines))
        (root / name).write_text(text, encoding="utf-8")
    return root


def test_build_corpus_keeps_train_whole_and_cuts_valid_at_a_line(tmp_path: Path) -> None:
    src = _source(tmp_path / "src")
    corpus = outer.build_corpus(src, tmp_path / "corpus", valid_words=30)
    assert (corpus / "train.txt").read_text() == (src / "test.txt").read_text()
    valid = (corpus / "valid.txt").read_text().splitlines()
    assert len(valid) == 3  # 12 words a line: 24 < 30 <= 36
    assert valid == (src / "valid.txt").read_text().splitlines()[:3]


def test_build_corpus_refuses_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="`valid_words` must be >= 1, got 0"):
        outer.build_corpus(_source(tmp_path / "src"), tmp_path / "c", valid_words=0)
    with pytest.raises(ValueError, match="`source` must hold test.txt"):
        outer.build_corpus(tmp_path / "empty", tmp_path / "c", valid_words=5)


def test_dry_run_prints_one_command_per_run_and_runs_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = tmp_path / "runs"
    outer.main(["--corpus", str(tmp_path / "c"), "--runs", str(runs), "--seeds", "0", "1",
                "--only", "none", "sparseloco30", "--dry-run", "--set", "epochs=1"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4
    assert "--outer-optimizer ef-momentum" in lines[1] and "--seed 0" in lines[1]
    assert "--epochs 1" in lines[0] and "--seed 1" in lines[3]
    assert not runs.exists()


def test_only_refuses_unknown_configuration(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        outer.main(["--corpus", str(tmp_path), "--runs", str(tmp_path), "--only", "nope",
                    "--dry-run"])


def _agg(none: float, diloco: float, sparse: float, sparse_bytes: float) -> dict:
    def entry(ppl: float, sent: float) -> dict:
        return {"final_perplexity": {"mean": ppl}, "bytes_sent_per_worker": {"mean": sent}}
    agg = {"none": entry(none, 3000.0), "diloco30": entry(diloco, 100.0),
           "sparseloco30": entry(sparse, sparse_bytes)}
    for ref in ("none", "diloco30"):
        for e in agg.values():
            e[f"ppl_over_{ref}"] = e["final_perplexity"]["mean"] / agg[ref]["final_perplexity"]["mean"]
            e[f"bytes_fewer_than_{ref}"] = (agg[ref]["bytes_sent_per_worker"]["mean"]
                                            / e["bytes_sent_per_worker"]["mean"])
    return agg


def test_verdicts_decide_each_target_from_the_ratios() -> None:
    met = outer.verdicts(_agg(100.0, 102.9, 104.9, 2.0))
    assert [v["met"] for v in met] == [True, True]
    missed = outer.verdicts(_agg(100.0, 103.1, 102.0, 2.1))  # 47.6x fewer bytes only
    assert [v["met"] for v in missed] == [False, False]
    assert "47.6x fewer bytes" in missed[1]["figure"]


@pytest.mark.slow
def test_tiny_grid_runs_resumes_and_collects(tmp_path: Path) -> None:
    corpus = outer.build_corpus(_source(tmp_path / "src"), tmp_path / "corpus", 200)
    runs, results = tmp_path / "runs", tmp_path / "outer.json"
    # 4 workers x 2 columns x 4 tokens x 30 steps: one epoch is one synchronisation at H = 30.
    argv = ["--corpus", str(corpus), "--runs", str(runs), "--seeds", "0", "--only", "none",
            "diloco30", "--results", str(results), "--set", "model=transformer:dim=8,layers=1,heads=1",
            "--set", "epochs=1", "--set", "batch_size=2", "--set", "bptt=4"]
    outer.main([*argv, "--archive", str(tmp_path / "runs.tar.gz")])
    with tarfile.open(tmp_path / "runs.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["diloco30-s0/metrics.jsonl", "diloco30-s0/summary.json",
                                          "none-s0/metrics.jsonl", "none-s0/summary.json"]
    data = json.loads(results.read_text())
    rows = {r["config"]: r for r in data["runs"]}
    assert set(rows) == {"none", "diloco30"}
    assert rows["none"]["steps"] == rows["diloco30"]["steps"] == 30
    assert rows["diloco30"]["rounds"] == 1 and rows["none"]["rounds"] == 30
    # One fp32 exchange of the same tensors against thirty: 30x fewer bytes (up to the
    # per-exchange rounding of the ring's chunks, a few bytes a tensor).
    assert data["configs"]["diloco30"]["bytes_fewer_than_none"] == pytest.approx(30.0, rel=1e-3)
    assert [v["target"][:6] for v in data["verdicts"]] == ["DiLoCo"]
    # A second call finds both summaries and runs nothing more.
    stamp = (runs / "none-s0" / "summary.json").stat().st_mtime_ns
    outer.main(argv)
    assert (runs / "none-s0" / "summary.json").stat().st_mtime_ns == stamp
