"""Smoke tests of the quality-per-byte benchmark (benchmarks/quality.py) on tiny generated data:
the script and its two grid files run end to end and write well-formed rows (no timing checks)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch

from benchmarks import quality


def _image_tree(root: Path, classes: int, train: int, test: int) -> Path:
    """A CIFAR-like ImageFolder tree of random 32x32 JPEGs."""
    image = pytest.importorskip("PIL.Image", reason="needs PIL (the `data` extra)")
    gen = torch.Generator().manual_seed(0)
    for split, count in (("train", train), ("test", test)):
        for c in range(classes):
            folder = root / "cifar10" / split / f"class{c}"
            folder.mkdir(parents=True)
            for i in range(count):
                pixels = torch.randint(0, 256, (32, 32, 3), generator=gen, dtype=torch.uint8)
                image.fromarray(pixels.numpy()).save(folder / f"{i:04d}.jpg")
    return root


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def test_make_subset_keeps_the_first_files_of_every_class(tmp_path: Path) -> None:
    src = _image_tree(tmp_path / "src", classes=2, train=5, test=3)
    dest = quality.make_subset(src, tmp_path / "sub", train_per_class=2, test_per_class=1)
    assert sorted(p.name for p in (dest / "train" / "class1").iterdir()) == ["0000.jpg", "0001.jpg"]
    assert [p.name for p in (dest / "test" / "class0").iterdir()] == ["0000.jpg"]
    quality.make_subset(src, dest, train_per_class=1, test_per_class=1)  # shrinking drops extras
    assert [p.name for p in (dest / "train" / "class0").iterdir()] == ["0000.jpg"]


def test_verdicts_apply_the_papers_targets() -> None:
    agg = [
        {"label": "powersgd r4", "final_accuracy_mean": 0.800, "bytes_sent_per_worker": 100.0},
        {"label": "accordion powersgd r1<->r4", "final_accuracy_mean": 0.798,
         "bytes_sent_per_worker": 55.0},
        {"label": "topk 10%", "final_accuracy_mean": 0.800, "bytes_sent_per_worker": 100.0},
        {"label": "accordion topk 1%<->10%", "final_accuracy_mean": 0.790,
         "bytes_sent_per_worker": 50.0},
        {"label": "topk 1%", "final_accuracy_mean": 0.70, "bytes_sent_per_worker": 10.0},
        {"label": "threshold budget 1%", "final_accuracy_mean": 0.71, "bytes_sent_per_worker": 11.0},
    ]
    found = {v["claim"]: v for v in quality.verdicts(agg, "accuracy")}
    assert set(found) == {"accordion powersgd r1<->r4 vs powersgd r4",
                          "accordion topk 1%<->10% vs topk 10%", "threshold budget 1% vs topk 1%"}
    assert found["accordion powersgd r1<->r4 vs powersgd r4"]["met"] is True
    assert found["accordion topk 1%<->10% vs topk 10%"]["met"] is False  # 1 point lower
    assert found["threshold budget 1% vs topk 1%"]["met"] is False  # more bytes
    assert found["threshold budget 1% vs topk 1%"]["bytes_ratio"] == pytest.approx(1.1)


@pytest.mark.slow
def test_cifar10_grid_runs_and_writes_rows(tmp_path: Path) -> None:
    src = _image_tree(tmp_path / "src", classes=2, train=8, test=2)
    results = tmp_path / "results"
    code = quality.main([
        "--part", "cifar10", "--source", str(src), "--subset-dir", str(tmp_path / "sub"),
        "--train-per-class", "8", "--test-per-class", "2", "--results", str(results),
        "--out", str(tmp_path / "runs"), "--jobs", "1",
        "--set", "epochs=2", "--set", "batch_size=2", "--set", "model=resnet8:width=2",
        "--set", f"cache_dir={tmp_path / 'cache'}", "--set", "interval_epochs=0.5",
    ])
    assert code == 0
    runs = _rows(results / "quality_cifar10_runs.csv")
    agg = _rows(results / "quality_cifar10.csv")
    assert len(runs) == 2 * len(agg) == 20  # ten configurations, two seeds
    assert {r["seed"] for r in runs} == {"0", "1"}
    for r in runs:
        assert 0.0 <= float(r["final_accuracy"]) <= 1.0
        assert int(r["bytes_sent_per_worker"]) > 0 and int(r["steps"]) == 4
    by = {r["label"]: r for r in agg}
    # Dense traffic plus the engine's fixed-size header per call (24 bytes): just under 1.
    assert 0.99 < float(by["none"]["compression"]) < 1.0
    assert float(by["powersgd r1"]["compression"]) > 1.0
    accordion = by["accordion topk 1%<->10%"]
    assert float(accordion["decision_points"]) >= 2 and accordion["critical_forced"] != ""
    assert by["topk 1%"]["critical_found"] == ""  # only Accordion rows have decisions
    doc = json.loads((results / "quality_cifar10.json").read_text(encoding="utf-8"))
    assert doc["machine"]["torch"] == torch.__version__
    assert len(doc["verdicts"]) == 5 and all(isinstance(v["met"], bool) for v in doc["verdicts"])
    assert (results / "quality_cifar10.png").stat().st_size > 0


def test_logreg_grid_on_a_libsvm_file(tmp_path: Path) -> None:
    data = quality.make_logreg_file(tmp_path / "tiny.svm", n=250, d=6, density=0.5)
    results = tmp_path / "results"
    code = quality.main([
        "--part", "logreg", "--logreg-data", str(data), "--results", str(results),
        "--out", str(tmp_path / "runs"), "--jobs", "1", "--set", "epochs=1",
    ])
    assert code == 0
    runs = _rows(results / "quality_logreg_runs.csv")
    assert len(runs) == 12  # six configurations, two seeds
    assert all(math.isfinite(float(r["final_test_loss"])) for r in runs)
    agg = {r["label"]: r for r in _rows(results / "quality_logreg.csv")}
    assert set(agg) == {"none", "topk 1%", "threshold budget 1%", "topk 10%",
                        "threshold budget 10%", "threshold budget 1% padded"}
    doc = json.loads((results / "quality_logreg.json").read_text(encoding="utf-8"))
    assert {v["metric"] for v in doc["verdicts"]} == {"final_test_loss_mean"}
    assert (results / "quality_logreg.png").is_file()
