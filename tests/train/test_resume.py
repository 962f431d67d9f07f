"""Run directories: refused runs touch nothing; interrupted runs resume exactly."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gradzip.train.rundir import read_manifest
from gradzip.train.runner import RunConfig, run

TINY = dict(task="digits", workers=2, limit_train=200, milestones=(2.0,))
#: Fields that measure time: the only ones a resumed run may report differently.
WALL = {"seconds", "epoch_seconds", "eval_seconds", "wall_seconds", "train_seconds"}


def records(out: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in WALL} for r in rows]


def summary_of(out: Path) -> dict[str, Any]:
    summary = json.loads((out / "summary.json").read_text())
    summary["config"].pop("out")
    return {k: v for k, v in summary.items() if k not in WALL}


def assert_same_run(resumed: Path, reference: Path) -> None:
    """Every record and the summary equal, exactly, but for wall-clock fields."""
    assert records(resumed) == records(reference)
    assert summary_of(resumed) == summary_of(reference)
    for name in ("accordion_decisions.json", "batch_decisions.json"):
        assert (resumed / name).exists() == (reference / name).exists()
        if (reference / name).exists():
            assert (resumed / name).read_text() == (reference / name).read_text()


# -- refused runs touch nothing -----------------------------------------------------------
INVALID = [
    ({"batch_size": 10_000}, "`batch_size` must be <= the 100 training examples per worker"),
    ({"batch_size": 10_000, "launcher": "procs"}, "`batch_size` must be <= the 100"),
    ({"compressor": "topk:ratio=2"}, "ratio"),
    ({"model": "nosuchnet"}, "`model` must be one of"),
    ({"tensorboard": "yes"}, "`tensorboard` must be a bool"),
    ({"checkpoint_every": -1}, "`checkpoint_every` must be >= 0"),
]


def test_an_invalid_run_creates_nothing(tmp_path: Path) -> None:
    out = tmp_path / "never-created"
    for options, message in INVALID:
        with pytest.raises((ValueError, TypeError), match=re.escape(message)):
            run(RunConfig(**{**TINY, "epochs": 1, "out": str(out), **options}))  # type: ignore[arg-type]
        assert not out.exists(), options


def test_a_refused_run_leaves_a_finished_run_byte_identical(tmp_path: Path, snapshot) -> None:
    out = tmp_path / "run"
    base = dict(TINY, out=str(out), epochs=2, compressor="topk:ratio=0.1", log_every=3)
    run(RunConfig(**base))  # type: ignore[arg-type]
    before = snapshot(out)
    assert {"metrics.jsonl", "summary.json", "run.json", "checkpoint/latest.json"} <= set(before)
    refused = [
        *[(options, False, message) for options, message in INVALID],
        ({"compressor": "none"}, False, "another configuration (compressor 'topk:ratio=0.1' "
                                        "there, 'none' here)"),
        ({"compressor": "none"}, True, "another configuration (compressor"),
        ({"seed": 1, "launcher": "procs"}, False, "another configuration (seed 0 there, 1 here)"),
        ({"epochs": 3}, False, "another configuration (epochs 2 there, 3 here)"),
        ({"epochs": 1}, True, "`epochs` must be >= the 2 epochs"),
        ({"epochs": 8, "milestones": (0.5,)}, True, "changes the learning-rate schedule"),
    ]
    for options, resume, message in refused:
        with pytest.raises((ValueError, TypeError)) as err:
            run(RunConfig(**{**base, **options}), resume=resume)  # type: ignore[arg-type]
        assert message in str(err.value) or "another configuration" in str(err.value), (
            options, str(err.value))
        assert snapshot(out) == before, options


def test_a_damaged_checkpoint_refuses_the_resume_untouched(tmp_path: Path, snapshot) -> None:
    out = tmp_path / "damaged"
    cfg = RunConfig(**TINY, epochs=1, out=str(out), compressor="topk:ratio=0.1")  # type: ignore[arg-type]
    run(cfg)
    (out / "summary.json").unlink()  # as if killed after the last checkpoint
    longer = RunConfig(**{**TINY, "epochs": 2, "out": str(out), "compressor": "topk:ratio=0.1"})  # type: ignore[arg-type]
    state = out / "checkpoint" / "epoch-00001" / "rank-0.pt"
    good = state.read_bytes()
    state.write_bytes(good[: len(good) // 2])
    before = snapshot(out)
    with pytest.raises(ValueError, match="rank-0.pt is unreadable"):
        run(longer, resume=True)
    assert snapshot(out) == before
    state.write_bytes(good)
    metrics = (out / "metrics.jsonl").read_bytes()
    (out / "metrics.jsonl").write_bytes(metrics[:-5])
    before = snapshot(out)
    with pytest.raises(ValueError, match="cannot be resumed"):
        run(longer, resume=True)
    assert snapshot(out) == before


def test_results_of_an_unknown_run_are_not_replaced(tmp_path: Path, snapshot) -> None:
    out = tmp_path / "foreign"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"mine": 1}\n')
    before = snapshot(out)
    with pytest.raises(ValueError, match="configuration is unknown"):
        run(RunConfig(**TINY, epochs=1, out=str(out)))  # type: ignore[arg-type]
    (out / "run.json").write_text("{not json")
    before = snapshot(out)
    with pytest.raises(ValueError, match="unreadable run.json"):
        run(RunConfig(**TINY, epochs=1, out=str(out)), resume=True)  # type: ignore[arg-type]
    assert snapshot(out) == before
    file = tmp_path / "a-file"
    file.write_text("keep")
    with pytest.raises(ValueError, match="`out` must be a directory, got the file"):
        run(RunConfig(**TINY, epochs=1, out=str(file)))  # type: ignore[arg-type]
    assert file.read_text() == "keep"


def test_the_same_configuration_starts_over_with_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "again"
    cfg = RunConfig(**TINY, epochs=1, out=str(out), compressor="topk:ratio=0.1")  # type: ignore[arg-type]
    first = run(cfg)
    (out / "metrics.jsonl").write_text((out / "metrics.jsonl").read_text() * 2)
    second = run(cfg, overwrite=True)
    assert len(records(out)) == 1 and second["final_accuracy"] == first["final_accuracy"]
    assert sorted(p.name for p in (out / "checkpoint").iterdir()) == ["epoch-00001",
                                                                      "latest.json"]


# -- resume == uninterrupted ------------------------------------------------------------------
def lm_text(tmp_path: Path) -> str:
    text = tmp_path / "t.txt"
    words = "the cat sat on a mat while dogs ran in the park".split()
    text.write_text("\n".join(" ".join(words[i % 7:] + words[:i % 7]) for i in range(24)) + "\n")
    return str(text)


SIM_CASES = [
    pytest.param({"compressor": "powersgd:rank=1", "accordion": "powersgd:rank=4",
                  "interval_epochs": 0.5, "log_every": 4}, id="accordion-powersgd"),
    pytest.param({"compressor": "threshold:budget=0.05", "accordion_batch": (32, 64),
                  "interval_epochs": 0.5}, id="threshold-accordion-batch"),
    pytest.param({"task": "lm", "batch_size": 2, "bptt": 5, "limit_train": None,
                  "model": "lstm:embed=8,hidden=8,layers=2,dropout=0.3",
                  "compressor": "topk:ratio=0.2", "threads": 1}, id="lm-dropout"),
]


@pytest.mark.parametrize("extra", SIM_CASES)
def test_sim_run_resumed_to_more_epochs_equals_the_uninterrupted_run(
    tmp_path: Path, extra: dict[str, Any]
) -> None:
    if extra.get("task") == "lm":
        extra = {**extra, "data": lm_text(tmp_path)}
    base = {**TINY, "milestones": (2.0,), **extra}
    run(RunConfig(**base, epochs=3, out=str(tmp_path / "whole")))  # type: ignore[arg-type]
    part = tmp_path / "part"
    run(RunConfig(**base, epochs=1, out=str(part)))  # type: ignore[arg-type]
    assert read_manifest(part).epoch == 1  # type: ignore[union-attr]
    run(RunConfig(**base, epochs=3, out=str(part)), resume=True)  # type: ignore[arg-type]
    assert_same_run(part, tmp_path / "whole")


def test_resume_of_a_finished_run_changes_nothing(tmp_path: Path, snapshot) -> None:
    out = tmp_path / "done"
    cfg = RunConfig(**TINY, epochs=2, out=str(out), compressor="topk:ratio=0.1")  # type: ignore[arg-type]
    first = run(cfg)
    before = snapshot(out)
    assert run(cfg, resume=True) == first
    assert snapshot(out) == before


def test_checkpoint_every_keeps_only_the_latest(tmp_path: Path) -> None:
    out = tmp_path / "every2"
    run(RunConfig(**TINY, epochs=3, out=str(out), checkpoint_every=2))  # type: ignore[arg-type]
    manifest = read_manifest(out)
    assert manifest is not None and manifest.epoch == 3 and manifest.processes == 1
    assert [p.name for p in (out / "checkpoint").iterdir() if p.is_dir()] == ["epoch-00003"]
    never = tmp_path / "never"
    run(RunConfig(**TINY, epochs=1, out=str(never), checkpoint_every=0))  # type: ignore[arg-type]
    assert not (never / "checkpoint").exists()


def _train_cmd(out: Path, epochs: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "gradzip", "train", "--task", "digits", "--workers", "2",
            "--limit-train", "200", "--milestones", "20", "--compressor", "topk:ratio=0.1",
            "--log-every", "2", "--epochs", str(epochs), "--out", str(out), "--quiet", *extra]


#: The run killed below: the real ``gradzip train``, with one pause added at the start of epoch
#: 3's checkpoint (epoch 3's records written, its checkpoint not yet): it writes the marker file
#: named by ``argv[1]`` and then blocks on stdin. The test kills it once the marker exists, so
#: the point of the kill does not depend on how fast the machine runs.
_PAUSED_RUN = """
import sys
from pathlib import Path

from gradzip.cli import main
from gradzip.train.resume import Checkpointer

marker, argv = Path(sys.argv[1]), sys.argv[2:]
save = Checkpointer.__call__


def save_or_pause(self, loop):
    if loop.done["epoch"] == 3:
        marker.write_text("epoch 3 recorded, not checkpointed")
        sys.stdin.read()  # never returns: the test holds stdin open and kills the process
    save(self, loop)


Checkpointer.__call__ = save_or_pause
sys.exit(main(argv))
"""


@pytest.mark.slow
def test_a_killed_run_resumes_to_the_uninterrupted_result(tmp_path: Path) -> None:
    """SIGKILL the whole process tree between checkpoints, then resume with --resume."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    killed, marker = tmp_path / "killed", tmp_path / "paused"
    cmd = _train_cmd(killed, 16)
    proc = subprocess.Popen([cmd[0], "-c", _PAUSED_RUN, str(marker), *cmd[3:]], env=env,
                            start_new_session=True, stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        # Polls for the marker; the deadline is only a safety net against a broken run.
        deadline = time.monotonic() + 600
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), proc.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    manifest = read_manifest(killed)
    assert manifest is not None and manifest.epoch == 2
    # Epoch 3's records were written after the checkpoint: the resume must drop them.
    assert (killed / "metrics.jsonl").stat().st_size > manifest.metrics_bytes
    assert not (killed / "summary.json").exists()
    done = subprocess.run(_train_cmd(killed, 16, "--resume"), env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    whole = tmp_path / "whole"
    ref = subprocess.run(_train_cmd(whole, 16), env=env, capture_output=True, text=True,
                         timeout=600)
    assert ref.returncode == 0, ref.stderr[-2000:]
    assert_same_run(killed, whole)


@pytest.mark.slow
def test_procs_run_resumed_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    """Two gloo processes, each restoring its own residuals, warm starts and generators."""
    base = {**TINY, "launcher": "procs", "timeout": 300, "threads": 1, "log_every": 3,
            "compressor": "powersgd:rank=1", "accordion": "powersgd:rank=4",
            "interval_epochs": 0.5}
    run(RunConfig(**base, epochs=2, out=str(tmp_path / "whole")))  # type: ignore[arg-type]
    part = tmp_path / "part"
    run(RunConfig(**base, epochs=1, out=str(part)))  # type: ignore[arg-type]
    manifest = read_manifest(part)
    assert manifest is not None and manifest.processes == 2
    assert sorted(p.name for p in (part / "checkpoint" / manifest.directory).iterdir()) == [
        "rank-0.pt", "rank-1.pt"]
    run(RunConfig(**base, epochs=2, out=str(part)), resume=True)  # type: ignore[arg-type]
    assert_same_run(part, tmp_path / "whole")


@pytest.mark.slow
def test_torchrun_run_resumed_to_more_epochs_matches_the_simulator(tmp_path: Path) -> None:
    """Under torchrun rank 0 reads the directory and every rank loads its own file."""
    out = tmp_path / "torchrun"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "-m", "gradzip", "train", "--task", "digits", "--limit-train", "200",
           "--milestones", "2", "--compressor", "topk:ratio=0.1", "--threads", "1",
           "--out", str(out), "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for extra in (["--epochs", "1"], ["--epochs", "2", "--resume"]):
        proc = subprocess.run(cmd + extra, env=env, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-4000:]
    assert read_manifest(out).processes == 2  # type: ignore[union-attr]
    sim = tmp_path / "sim"
    run(RunConfig(**TINY, epochs=2, compressor="topk:ratio=0.1", out=str(sim)))  # type: ignore[arg-type]
    got, want = records(out), records(sim)
    assert [r["epoch"] for r in got] == [1, 2]
    for a, b in zip(got, want, strict=True):
        assert (a["accuracy"], a["wire_bytes"], a["step"]) == (b["accuracy"], b["wire_bytes"],
                                                               b["step"])
        assert a["test_loss"] == pytest.approx(b["test_loss"], rel=1e-5)
