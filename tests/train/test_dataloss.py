"""Run directories never lose results: re-runs, failed starts, shared TensorBoard folders,
orphaned workers, second writers and damaged checkpoints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gradzip.cli import main
from gradzip.train.overwrite import STAGING_DIR
from gradzip.train.resume import plan_out_dir
from gradzip.train.rundir import LOCK_FILE, lock_out_dir, read_manifest
from gradzip.train.runner import RunConfig, resolve_config, run

TINY = dict(task="digits", workers=2, limit_train=200, milestones=(20.0,),
            compressor="topk:ratio=0.1")
WALL = {"seconds", "epoch_seconds", "eval_seconds", "wall_seconds", "train_seconds"}
Snapshot = Callable[[Path], dict[str, tuple[bytes, int]]]
#: Generous safety nets only: every wait below ends on an event the run signals.
SAFETY_S = 240.0


def records(out: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in WALL} for r in rows]


def cfg(out: Path, **extra: Any) -> RunConfig:
    return RunConfig(**{**TINY, "epochs": 1, "out": str(out), **extra})  # type: ignore[arg-type]


def _train_cmd(out: Path, epochs: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "gradzip", "train", "--task", "digits", "--workers", "2",
            "--limit-train", "200", "--milestones", "20", "--compressor", "topk:ratio=0.1",
            "--epochs", str(epochs), "--out", str(out), "--quiet", *extra]


def _without(snap: dict[str, Any], *prefixes: str) -> dict[str, Any]:
    return {k: v for k, v in snap.items() if not k.startswith(prefixes)}


def _wait_for(path: Path, proc: subprocess.Popen[bytes]) -> None:
    """Until ``path`` exists (the run signals a point in its life); fail if the run ends."""
    deadline = time.monotonic() + SAFETY_S
    while not path.exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


@pytest.fixture
def group() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes started in their own session; every one left is killed with its group."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _start(cmd: list[str], procs: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    procs.append(proc)
    return proc


# -- an identical re-run --------------------------------------------------------------------
def test_a_rerun_over_a_finished_run_is_refused_untouched(tmp_path: Path, snapshot: Snapshot,
                                                           capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    out = tmp_path / "run"
    run(cfg(out))
    before = snapshot(out)
    with pytest.raises(ValueError, match="holds a finished run of this configuration; "
                                         "--resume continues it, --overwrite starts it over"):
        run(cfg(out))
    assert snapshot(out) == before
    (out / "summary.json").unlink()  # as if killed after its checkpoint
    before = snapshot(out)
    with pytest.raises(ValueError, match="holds a run interrupted after epoch 1"):
        run(cfg(out))
    with pytest.raises(ValueError, match="`resume` and `overwrite` exclude each other"):
        run(cfg(out), resume=True, overwrite=True)
    assert snapshot(out) == before
    argv = ["train", "--task", "digits", "--workers", "2", "--limit-train", "200",
            "--milestones", "20", "--compressor", "topk:ratio=0.1", "--epochs", "1",
            "--out", str(out), "--quiet"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--overwrite starts it over" in err
    assert snapshot(out) == before


def test_overwrite_replaces_the_results_once_the_new_run_finished(tmp_path: Path) -> None:
    out, ref = tmp_path / "run", tmp_path / "ref"
    run(cfg(out, epochs=1))
    (out / "metrics.jsonl").write_text((out / "metrics.jsonl").read_text() * 2)
    summary = run(cfg(out, epochs=2), overwrite=True)  # another number of epochs is fine
    run(cfg(ref, epochs=2))
    assert records(out) == records(ref)
    assert summary["config"]["out"] == str(out) and summary["epochs"] == 2
    assert json.loads((out / "run.json").read_text())["config"]["out"] == str(out)
    assert sorted(p.name for p in (out / "checkpoint").iterdir()) == ["epoch-00002",
                                                                      "latest.json"]
    assert not (out / STAGING_DIR).exists()
    assert plan_out_dir(resolve_config(cfg(out, epochs=2)), resume=True).finished is not None
    with pytest.raises(ValueError, match="another configuration"):  # only this configuration
        run(cfg(out, epochs=2, seed=3), overwrite=True)
    (out / "summary.json").unlink()
    (out / "checkpoint" / "latest.json").write_text("{torn")
    with pytest.raises(ValueError, match="holds a run with a damaged checkpoint"):
        run(cfg(out, epochs=2))
    run(cfg(out, epochs=2), overwrite=True)  # starting over needs nothing from the old run
    assert records(out) == records(ref)


@pytest.mark.slow
def test_an_overwrite_killed_midway_leaves_the_old_run_whole(
        tmp_path: Path, snapshot: Snapshot, group: list[subprocess.Popen[bytes]]) -> None:
    out = tmp_path / "run"
    run(cfg(out, epochs=2, log_every=3))
    before = snapshot(out)
    proc = _start(_train_cmd(out, 40, "--log-every", "3", "--overwrite"), group)
    # The new run has trained and checkpointed an epoch of its own: kill it there.
    _wait_for(out / STAGING_DIR / "checkpoint" / "latest.json", proc)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    after = snapshot(out)
    assert _without(after, LOCK_FILE, STAGING_DIR) == _without(before, LOCK_FILE)
    plan = plan_out_dir(resolve_config(cfg(out, epochs=2, log_every=3)), resume=True)
    assert plan.finished is not None  # still the finished old run
    # The next start over clears the abandoned attempt and replaces the run when it ends.
    run(cfg(out, epochs=1, log_every=3), overwrite=True)
    run(cfg(tmp_path / "ref", epochs=1, log_every=3))
    assert records(out) == records(tmp_path / "ref")
    assert not (out / STAGING_DIR).exists()


# -- TensorBoard ----------------------------------------------------------------------------
def test_an_unusable_tensorboard_folder_is_refused_before_any_write(
        tmp_path: Path, snapshot: Snapshot) -> None:
    pytest.importorskip("tensorboard", reason="needs the `tensorboard` extra")
    out = tmp_path / "run"
    run(cfg(out))
    (out / "tensorboard").write_text("not a folder")
    before = snapshot(out)
    for options in ({"resume": True}, {"overwrite": True}):
        with pytest.raises(ValueError, match="`tensorboard` needs the folder .* got a file"):
            run(cfg(out, epochs=2, tensorboard=True), **options)
        assert snapshot(out) == before, options
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "tensorboard").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="got a link to nothing"):
        run(cfg(fresh, tensorboard=True))
    assert sorted(p.name for p in fresh.iterdir()) == ["tensorboard"]


def test_only_this_runs_event_files_are_replaced(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="needs the `tensorboard` extra")
    shared = tmp_path / "shared-logs"  # a log folder other runs and tools write to as well
    shared.mkdir()
    foreign = {"events.out.tfevents.1.otherhost.7.0": b"another tool",
               "events.out.tfevents.2.otherhost.8.0.v2": b"another run"}
    for name, data in foreign.items():
        (shared / name).write_bytes(data)
    out = tmp_path / "run"
    out.mkdir()
    (out / "tensorboard").symlink_to(shared)

    def mine() -> list[str]:
        return sorted(p.name for p in shared.iterdir() if p.name not in foreign)

    run(cfg(out, tensorboard=True))
    first = mine()
    assert len(first) == 1
    run(cfg(out, epochs=2, tensorboard=True), resume=True)
    assert len(mine()) == 1 and mine() != first  # rewritten whole from the records
    other = tmp_path / "other"  # a second gradzip run logging to the same folder
    other.mkdir()
    (other / "tensorboard").symlink_to(shared)
    run(cfg(other, tensorboard=True))
    assert len(mine()) == 2
    run(cfg(out, epochs=2, tensorboard=True), overwrite=True)
    assert len(mine()) == 2
    for name, data in foreign.items():
        assert (shared / name).read_bytes() == data
    assert not (out / STAGING_DIR).exists()


# -- a second writer; workers outliving their parent ----------------------------------------
def test_a_second_writer_is_refused_while_the_directory_is_locked(
        tmp_path: Path, snapshot: Snapshot) -> None:
    out = tmp_path / "run"
    run(cfg(out))
    (out / "summary.json").unlink()
    before = snapshot(out)
    with lock_out_dir(out):  # as a run still writing there holds it
        with pytest.raises(ValueError, match=f"is in use by another gradzip run \\(pid "
                                             f"{os.getpid()}\\)"):
            run(cfg(out, epochs=2), resume=True)
    assert _without(snapshot(out), LOCK_FILE) == _without(before, LOCK_FILE)
    run(cfg(out, epochs=2), resume=True)  # free again
    fresh = tmp_path / "fresh"
    with lock_out_dir(fresh):  # the procs launcher's parent takes the lock for its workers
        with pytest.raises(ValueError, match="is in use by another gradzip run"):
            run(cfg(fresh, launcher="procs", timeout=300, threads=1))
    assert sorted(p.name for p in fresh.iterdir()) == [LOCK_FILE]


def _workers_of(parent: int) -> list[int]:
    """The spawned workers in ``parent``'s process group (it leads its own session)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == parent:
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == parent and b"spawn_main" in cmdline:
            pids.append(int(entry.name))
    return pids


def _alive(pid: int) -> bool:
    """Running (a zombie left unreaped by a container's init counts as dead)."""
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_killing_the_procs_parent_kills_its_workers_and_frees_the_directory(
        tmp_path: Path, group: list[subprocess.Popen[bytes]]) -> None:
    out = tmp_path / "run"
    # Far more epochs than the test waits for: orphaned workers would still be training.
    cmd = _train_cmd(out, 5000, "--launcher", "procs", "--threads", "1")
    proc = _start(cmd, group)
    _wait_for(out / "checkpoint" / "latest.json", proc)
    workers = _workers_of(proc.pid)
    assert len(workers) == 2, workers
    # While it runs, a second writer is refused with one line and changes nothing; one
    # resuming is refused before it reads the checkpoint the first is rewriting.
    for flag in ("--overwrite", "--resume"):
        second = subprocess.run([*cmd, flag], capture_output=True, text=True,
                                timeout=SAFETY_S)
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"`out` {str(out)!r} is in use by another gradzip run (pid {proc.pid})" in \
            second.stderr
        assert second.stderr.count("\n") == 1
        assert not (out / STAGING_DIR).exists()
    os.kill(proc.pid, signal.SIGKILL)  # the parent alone
    assert proc.wait() == -signal.SIGKILL
    deadline = time.monotonic() + 60
    while any(_alive(w) for w in workers):
        assert time.monotonic() < deadline, "workers outlived their parent"
        time.sleep(0.01)
    with lock_out_dir(out):  # nobody holds the directory any more
        pass
    manifest = read_manifest(out)
    assert manifest is not None and manifest.processes == 2
    frozen = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    plan = plan_out_dir(resolve_config(RunConfig(**{**TINY, "epochs": 5000, "out": str(out),  # type: ignore[arg-type]
                                                    "launcher": "procs", "threads": 1})),
                        resume=True)
    assert plan.manifest == manifest
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == frozen


# -- checkpoint integrity -------------------------------------------------------------------
def _flip_a_weight_bit(path: Path) -> None:
    """Flip one exponent bit of one model weight in place: the file still loads."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    weight = max(state["model"].values(), key=lambda t: t.numel())
    raw = path.read_bytes()
    at = raw.find(weight.contiguous().numpy().tobytes())
    assert at > 0
    data = bytearray(raw)
    data[at + 3] ^= 0x40
    path.write_bytes(bytes(data))
    torch.load(path, map_location="cpu", weights_only=True)  # loads without complaint


@pytest.mark.parametrize("launcher", ["sim", pytest.param("procs", marks=pytest.mark.slow)])
def test_a_changed_checkpoint_file_is_refused_naming_it(
        tmp_path: Path, snapshot: Snapshot, capsys: pytest.CaptureFixture[str],
        launcher: str) -> None:
    out = tmp_path / "run"
    extra = {"launcher": launcher, "timeout": 300, "threads": 1}
    run(cfg(out, **extra))
    (out / "summary.json").unlink()  # as if killed after its checkpoint
    manifest = read_manifest(out)
    assert manifest is not None and manifest.sha256 is not None
    assert sorted(manifest.sha256) == [f"rank-{r}.pt" for r in range(manifest.processes)]
    victim = out / "checkpoint" / manifest.directory / f"rank-{manifest.processes - 1}.pt"
    good = victim.read_bytes()
    _flip_a_weight_bit(victim)
    before = snapshot(out)
    with pytest.raises(ValueError, match=f"{victim.name} does not match the sha256 its "
                                         "manifest records"):
        run(cfg(out, epochs=2, **extra), resume=True)
    assert snapshot(out) == before
    argv = ["train", "--task", "digits", "--workers", "2", "--limit-train", "200",
            "--milestones", "20", "--compressor", "topk:ratio=0.1", "--epochs", "2",
            "--launcher", launcher, "--threads", "1", "--out", str(out), "--quiet", "--resume"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(victim) in err and "sha256" in err
    assert snapshot(out) == before
    victim.write_bytes(good)
    run(cfg(out, epochs=2, **extra), resume=True)
    resumed = records(out)
    # Starting over (every process writing to the staging folder) gives the same run again.
    run(cfg(out, epochs=2, **extra), overwrite=True)
    assert records(out) == resumed and not (out / STAGING_DIR).exists()
    manifest = read_manifest(out)
    assert manifest is not None and manifest.epoch == 2 and manifest.sha256 is not None


def test_a_manifest_without_digests_still_resumes(tmp_path: Path) -> None:
    """Manifests written before digests were recorded load, their files unchecked."""
    out, ref = tmp_path / "run", tmp_path / "ref"
    run(cfg(out))
    (out / "summary.json").unlink()
    latest = out / "checkpoint" / "latest.json"
    data = json.loads(latest.read_text())
    del data["sha256"]
    latest.write_text(json.dumps(data))
    run(cfg(out, epochs=2), resume=True)
    run(cfg(ref, epochs=2))
    assert records(out) == records(ref)
    manifest = read_manifest(out)
    assert manifest is not None and manifest.sha256 is not None  # written with digests again
