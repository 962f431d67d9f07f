"""``eval_every``: evaluations between epochs, their records and the training clock."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_resume import TINY, assert_same_run, records

from gradzip.train.runner import RunConfig, run


def _rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _run(out: Path, **kw: Any) -> dict[str, Any]:
    return run(RunConfig(**{**TINY, "epochs": 2, "out": str(out), **kw}))  # type: ignore[arg-type]


def test_eval_records_come_every_n_steps_and_leave_training_unchanged(tmp_path: Path) -> None:
    plain = _run(tmp_path / "plain")
    evals = _run(tmp_path / "evals", eval_every=3)
    # Evaluating changes nothing that is trained: the epoch records and the summary agree.
    assert [r for r in records(tmp_path / "evals") if r["kind"] == "epoch"] == \
        records(tmp_path / "plain")
    assert evals["final_accuracy"] == plain["final_accuracy"]
    rows = _rows(tmp_path / "evals")
    epoch_steps = {r["step"] for r in rows if r["kind"] == "epoch"}
    got = [r for r in rows if r["kind"] == "eval"]
    last = max(epoch_steps)
    assert [r["step"] for r in got] == [s for s in range(3, last, 3) if s not in epoch_steps]
    for r in got:
        assert 0 <= r["accuracy"] <= 1 and r["wire_bytes"] > 0 and r["rounds"] == r["step"]
    # The training clock leaves every evaluation out: the run's seconds less its training
    # seconds are the evaluations' seconds, mid-epoch and at the epochs' ends.
    timed = [r for r in rows if r["kind"] in ("eval", "epoch")]
    clock = [r["train_seconds"] for r in timed]
    assert clock == sorted(clock) and all(r["train_seconds"] < r["seconds"] for r in timed)
    end = timed[-1]
    assert end["seconds"] - end["train_seconds"] == pytest.approx(
        sum(r["eval_seconds"] for r in timed), abs=1e-6)


def test_outer_run_evaluated_every_h_steps_sees_synchronised_parameters(tmp_path: Path) -> None:
    _run(tmp_path / "outer", outer_steps=3, eval_every=3)
    got = [r for r in _rows(tmp_path / "outer") if r["kind"] == "eval"]
    assert got and all(r["rounds"] == r["step"] // 3 for r in got)


def test_run_resumed_with_eval_records_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    _run(tmp_path / "whole", eval_every=4)
    _run(tmp_path / "part", eval_every=4, epochs=1)
    run(RunConfig(**{**TINY, "epochs": 2, "out": str(tmp_path / "part"), "eval_every": 4}),  # type: ignore[arg-type]
        resume=True)
    assert_same_run(tmp_path / "part", tmp_path / "whole")
    rows = _rows(tmp_path / "part")
    clock = [r["train_seconds"] for r in rows if r["kind"] in ("eval", "epoch")]
    assert clock == sorted(clock)


def test_negative_eval_every_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"`eval_every` must be >= 0, got -1"):
        _run(tmp_path / "bad", eval_every=-1)
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_procs_eval_records_equal_the_simulator(tmp_path: Path) -> None:
    sim = _run(tmp_path / "sim", eval_every=3, epochs=1)
    procs = _run(tmp_path / "procs", eval_every=3, epochs=1, launcher="procs", timeout=300,
                 threads=1)
    assert sim["steps"] == procs["steps"]
    keys = ("step", "accuracy", "wire_bytes", "rounds")
    sim_evals = [{k: r[k] for k in keys} for r in _rows(tmp_path / "sim") if r["kind"] == "eval"]
    procs_evals = [{k: r[k] for k in keys} for r in _rows(tmp_path / "procs")
                   if r["kind"] == "eval"]
    assert sim_evals and sim_evals == procs_evals
