"""TensorBoard event files: the same numbers as metrics.jsonl, per run and per grid."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from gradzip.train.compare import load_grid, run_grid
from gradzip.train.runner import RunConfig, run

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator", reason="needs tensorboard (the `tensorboard` extra)")

TINY = dict(task="digits", workers=2, limit_train=200, milestones=(2.0,), log_every=3,
            compressor="powersgd:rank=1", accordion="powersgd:rank=4", interval_epochs=0.5)


def scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = event_accumulator.EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def metrics(out: Path, kind: str) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == kind]


def test_train_writes_the_records_as_events(tmp_path: Path) -> None:
    out = tmp_path / "tb"
    run(RunConfig(**TINY, epochs=2, out=str(out), tensorboard=True))  # type: ignore[arg-type]
    got = scalars(out / "tensorboard")
    epochs, steps = metrics(out, "epoch"), metrics(out, "step")
    for tag, key in (("accuracy", "accuracy"), ("loss/train", "train_loss"),
                     ("loss/test", "test_loss"), ("lr", "lr"), ("bytes/wire", "wire_bytes"),
                     ("compression/rate", "compression")):
        assert [s for s, _ in got[tag]] == [r["epoch"] for r in epochs], tag
        assert [v for _, v in got[tag]] == pytest.approx([r[key] for r in epochs], rel=1e-6)
    assert [s for s, _ in got["step/loss"]] == [r["step"] for r in steps] and steps
    level_tags = [t for t in got if t.startswith("levels/")]
    assert level_tags
    # A level's curve starts at the first record that shows the level (Accordion's steady
    # level appears only after its first decision); from then on every record has a point.
    by_epoch = {tag: dict(got[tag]) for tag in level_tags}
    for tag in level_tags:
        first = min(by_epoch[tag])
        assert sorted(by_epoch[tag]) == [r["epoch"] for r in epochs if r["epoch"] >= first]
    for r in epochs:
        levels = list(r["levels"].values())
        for tag in level_tags:
            share = sum(v == tag.split("/")[1] for v in levels) / len(levels)
            assert by_epoch[tag].get(r["epoch"], 0.0) == pytest.approx(share), (tag, r["epoch"])
        assert sum(by_epoch[t].get(r["epoch"], 0.0) for t in level_tags) == pytest.approx(1.0)


def test_resumed_events_equal_the_uninterrupted_runs(tmp_path: Path) -> None:
    run(RunConfig(**TINY, epochs=3, out=str(tmp_path / "whole"), tensorboard=True))  # type: ignore[arg-type]
    part = tmp_path / "part"
    run(RunConfig(**TINY, epochs=1, out=str(part), tensorboard=True))  # type: ignore[arg-type]
    run(RunConfig(**TINY, epochs=3, out=str(part), tensorboard=True), resume=True)  # type: ignore[arg-type]
    assert len(list((part / "tensorboard").glob("events.out.tfevents.*"))) == 1
    assert scalars(part / "tensorboard") == scalars(tmp_path / "whole" / "tensorboard")


def test_compare_writes_one_event_directory_per_run(tmp_path: Path) -> None:
    grid = tmp_path / "grid.toml"
    grid.write_text('[base]\ntask = "digits"\nworkers = 2\nepochs = 1\nlimit_train = 200\n'
                    '[[runs]]\ncompressor = "none"\n[[runs]]\nlabel = "top k"\n'
                    'compressor = "topk:ratio=0.1"\n')
    out = tmp_path / "cmp"
    rows = run_grid(load_grid(str(grid), out=str(out)), stream=None, tensorboard=True)
    root = Path(rows[0]["_files"]["tensorboard"])
    assert root == out / "tensorboard"
    assert sorted(p.name for p in root.iterdir()) == ["none", "top-k"]
    for r in rows:
        got = scalars(root / Path(r["out"]).name)
        assert got["accuracy"][0][1] == pytest.approx(r["final"], rel=1e-6)
    # Re-running regenerates the folders rather than adding event files to them.
    run_grid(load_grid(str(grid), out=str(out)), stream=None, tensorboard=True)
    assert len(list((root / "none").glob("events.out.tfevents.*"))) == 1


def test_missing_tensorboard_is_a_one_line_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gradzip.cli import main

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if not installed
    out = tmp_path / "none"
    code = main(["train", "--task", "digits", "--epochs", "1", "--out", str(out),
                 "--tensorboard", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "pip install tensorboard" in err and "gradzip[" not in err and not out.exists()


def test_level_shares_cover_every_level_seen(tmp_path: Path) -> None:
    from gradzip.train.events import write_events

    recs = [{"kind": "epoch", "epoch": 1, "levels": {"a": "critical", "b": "steady",
                                                     "c": "steady"}},
            {"kind": "epoch", "epoch": 2, "levels": {"a": "steady", "b": "steady",
                                                     "c": "steady"}},
            {"kind": "note", "text": "ignored"}]
    got = scalars(write_events(recs, tmp_path / "ev"))
    assert got["levels/critical"] == [(1, pytest.approx(1 / 3)), (2, 0.0)]
    assert got["levels/steady"] == [(1, pytest.approx(2 / 3)), (2, 1.0)]
