"""The run directory's failure table: each row a damaged, changed or held directory and what a
run asked to use it must do (refuse in one line and change nothing, or resume to the
uninterrupted run's records). The invariants are listed in
:mod:`gradzip.train.run_directory`."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gradzip.cli import main
from gradzip.train.run_directory import RunDirectory
from gradzip.train.rundir import LOCK_FILE, lock_out_dir, read_manifest
from gradzip.train.runner import RunConfig, resolve_config, run

TINY = dict(task="digits", workers=2, limit_train=200, milestones=(20.0,),
            compressor="topk:ratio=0.1")
WALL = {"seconds", "epoch_seconds", "eval_seconds", "wall_seconds", "train_seconds"}


def cfg(out: Path, **extra: Any) -> RunConfig:
    return RunConfig(**{**TINY, "epochs": 2, "out": str(out), **extra})  # type: ignore[arg-type]


def records(out: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_bytes().splitlines()]
    return [{k: v for k, v in r.items() if k not in WALL} for r in rows]


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` but the lock file (whose holder's pid may change)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != LOCK_FILE}


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``one``: a run interrupted after its epoch-1 checkpoint; ``two``: the same run
    finished after 2 epochs (the reference of every resumed row)."""
    root = tmp_path_factory.mktemp("made")
    one, two = root / "one", root / "two"
    run(cfg(one, epochs=1))
    (one / "summary.json").unlink()
    shutil.copytree(one, two)
    run(cfg(two), resume=True)
    return {"one": one, "two": two}


# -- the rows' changes to a directory -------------------------------------------------------
def _manifest(out: Path) -> dict[str, Any]:
    return json.loads((out / "checkpoint" / "latest.json").read_text())


def earlier_epochs_file(out: Path, made: dict[str, Path]) -> None:
    """The epoch-2 checkpoint's file replaced by epoch 1's, the manifest's digest updated to
    match (a consistent tampering: every digest checks)."""
    (out / "summary.json").unlink()
    old = made["one"] / "checkpoint" / "epoch-00001" / "rank-0.pt"
    target = out / "checkpoint" / "epoch-00002" / "rank-0.pt"
    target.write_bytes(old.read_bytes())
    manifest = _manifest(out)
    manifest["sha256"]["rank-0.pt"] = hashlib.sha256(old.read_bytes()).hexdigest()
    (out / "checkpoint" / "latest.json").write_text(json.dumps(manifest))


def crlf_records(out: Path, made: dict[str, Path]) -> None:
    path = out / "metrics.jsonl"
    path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))


def deleted_records(out: Path, made: dict[str, Path]) -> None:
    (out / "metrics.jsonl").unlink()


def torn_records(out: Path, made: dict[str, Path]) -> None:
    path = out / "metrics.jsonl"
    path.write_bytes(path.read_bytes()[:-10])


def garbled_record(out: Path, made: dict[str, Path]) -> None:
    path = out / "metrics.jsonl"
    data = path.read_bytes()
    path.write_bytes(b"[1, 2]" + data[6:])


def missing_rank_file(out: Path, made: dict[str, Path]) -> None:
    (out / "checkpoint" / "epoch-00001" / "rank-0.pt").unlink()


def other_format_manifest(out: Path, made: dict[str, Path]) -> None:
    manifest = _manifest(out)
    manifest["format_version"] = 99
    (out / "checkpoint" / "latest.json").write_text(json.dumps(manifest))


def nothing(out: Path, made: dict[str, Path]) -> None:
    pass


@dataclass(frozen=True)
class Row:
    """A directory (a copy of ``base`` changed by ``change``) and what a resumed run does."""

    name: str
    base: str
    change: Callable[[Path, dict[str, Path]], None]
    refused: str | None = None  # the refusal's fragment (a regular expression); None: resumes
    options: dict[str, Any] = field(default_factory=dict)
    held: bool = False  # another run holds the directory's lock
    mode: str = "resume"  # what the run is asked: resume, overwrite or fresh (neither)


TABLE = [
    # Another run holds it: refused before anything is read (its files may be mid-write:
    # here it is pruning the checkpoint the second run would have loaded).
    Row("held", "one", missing_rank_file, r"`out` '.*' is in use by another gradzip run "
        rf"\(pid {os.getpid()}\); wait for it to end", held=True),
    Row("held-finished", "two", nothing, r"is in use by another gradzip run", held=True),
    Row("held-start-over", "two", nothing, r"is in use by another gradzip run", held=True,
        mode="overwrite"),
    Row("finished-no-flag", "two", nothing, "holds a finished run of this configuration; "
        "--resume continues it, --overwrite starts it over", mode="fresh"),
    Row("interrupted-no-flag", "one", nothing, "holds a run interrupted after epoch 1",
        options={"epochs": 1}, mode="fresh"),
    Row("earlier-epochs-file", "two", earlier_epochs_file,
        r"rank-0.pt holds epoch 1 \(step \d+\), but its manifest records epoch 2",
        options={"epochs": 3}),
    Row("missing-rank-file", "one", missing_rank_file, r"checkpoint is missing .*rank-0.pt"),
    Row("other-format-manifest", "one", other_format_manifest, "checkpoint of another format"),
    Row("torn-records", "one", torn_records, r"must begin with the \d+ bytes of records .*; "
        r"it cannot be resumed as it is: restore it, remove it \(its epoch records are then rebuilt from the checkpoint\)"),
    Row("garbled-record", "one", garbled_record, r"line 1 must be a JSON record, got b'\[1, 2\]"),
    Row("other-configuration", "one", nothing, "holds a run of another configuration",
        options={"seed": 5}),
    Row("crlf-records", "one", crlf_records),
    Row("deleted-records", "one", deleted_records),
    Row("intact", "one", nothing),
]


@pytest.mark.parametrize("row", TABLE, ids=[r.name for r in TABLE])
def test_the_failure_table(row: Row, made: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "run"
    shutil.copytree(made[row.base], out)
    row.change(out, made)
    before = snapshot(out)
    config = cfg(out, **row.options)
    if row.refused is not None:
        lock = lock_out_dir(out) if row.held else None
        try:
            with pytest.raises(ValueError, match=row.refused) as info:
                run(config, resume=row.mode == "resume", overwrite=row.mode == "overwrite")
        finally:
            if lock is not None:
                lock.release()
        assert "\n" not in str(info.value)
        assert snapshot(out) == before
        return
    run(config, resume=True)
    assert records(out) == records(made["two"])
    assert b"\r" not in (out / "metrics.jsonl").read_bytes()
    manifest = read_manifest(out)
    assert manifest is not None and manifest.epoch == 2


def test_deleted_records_keep_the_epoch_records_of_the_checkpoint(
        made: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Step records are not in a checkpoint: the rebuilt file holds the epoch records, and
    the run says what was lost."""
    out = tmp_path / "run"
    run(cfg(out, epochs=1, log_every=2))
    (out / "summary.json").unlink()
    (out / "metrics.jsonl").unlink()
    ref = tmp_path / "ref"
    run(cfg(ref, log_every=2))
    with caplog.at_level("WARNING"):
        run(cfg(out, log_every=2), resume=True)
    assert "its 1 epoch records were rebuilt from the checkpoint" in caplog.text
    whole = records(ref)
    first = next(i for i, r in enumerate(whole) if r["kind"] == "epoch")
    assert whole[0]["kind"] == "step"  # lost: the step records of epoch 1
    assert records(out) == whole[first:]


def test_a_resumed_run_says_from_which_epoch(made: dict[str, Path], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    shutil.copytree(made["one"], out)
    argv = ["train", "--task", "digits", "--workers", "2", "--limit-train", "200",
            "--milestones", "20", "--compressor", "topk:ratio=0.1", "--epochs", "2",
            "--out", str(out), "--quiet", "--resume"]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert stdout.startswith(f"gradzip train: resuming {out} from epoch 1 of 2 (its checkpoint, "
                             "step ")
    assert main(argv) == 0  # nothing left to do
    assert capsys.readouterr().out.startswith(
        f"gradzip train: {out} already holds this run, finished after 2 epochs")


def test_open_locks_before_planning_and_close_releases(made: dict[str, Path],
                                                       tmp_path: Path) -> None:
    out = tmp_path / "run"
    shutil.copytree(made["one"], out)
    config = resolve_config(cfg(out))
    with RunDirectory.open(config, resume=True, overwrite=False) as directory:
        assert directory.plan.manifest is not None and directory.plan.manifest.epoch == 1
        with pytest.raises(ValueError, match="is in use by another gradzip run"):
            lock_out_dir(out)
        assert directory.shared_plan.records == ""
        assert directory.plan.records == (out / "metrics.jsonl").read_text()
    with lock_out_dir(out):  # released
        pass
    fresh = tmp_path / "fresh"
    with RunDirectory.open(resolve_config(cfg(fresh)), resume=False, overwrite=False):
        assert not fresh.exists()  # nothing created before the first write


def test_outer_steps_beyond_the_run_are_refused(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "never"
    with pytest.raises(ValueError, match=re.escape(
            "`outer_steps` must let the workers synchronise within the run's 12 optimizer "
            "steps (2 epochs of 6), got 13")):
        run(cfg(out, outer_steps=13))
    assert not out.exists()
    with pytest.raises(ValueError, match="first synchronisation would come after step 13"):
        run(cfg(out, epochs=2, outer_steps=24, fragments=2, outer_delay=1))
    run(cfg(out, epochs=2, outer_steps=12))  # one synchronisation, at the last step
    argv = ["train", "--task", "digits", "--workers", "2", "--limit-train", "200",
            "--epochs", "1", "--outer-steps", "7", "--out", str(tmp_path / "cli"), "--quiet"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "`outer_steps` must let the workers synchronise" in err
