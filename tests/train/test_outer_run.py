"""Outer-step training through the runner: options, and resumed runs equal to uninterrupted
ones (in-process, and after SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from test_resume import TINY, assert_same_run, records

from gradzip.train.config import resolve_config
from gradzip.train.rundir import load_rank_file, read_manifest
from gradzip.train.runner import RunConfig, run
from gradzip.train.tasks import get_task

MODES = {
    "diloco": {"outer_steps": 4, "optimizer": "adamw", "lr": 0.002},
    "streaming": {"outer_steps": 4, "fragments": 2, "outer_delay": 1,
                  "compressor": "chunktopk:chunk=64,k=8,bits=2"},
    "sparseloco": {"outer_steps": 3, "outer_optimizer": "ef-momentum", "optimizer": "adamw",
                   "lr": 0.002, "compressor": "chunktopk:chunk=64,k=4,bits=2,average=senders"},
}


def test_outer_run_synchronises_every_h_steps_and_sends_the_formula(tmp_path: Path) -> None:
    out = tmp_path / "diloco"
    summary = run(RunConfig(**TINY, epochs=2, out=str(out), outer_steps=3, log_every=1))  # type: ignore[arg-type]
    rows = records(out)
    epochs = [r for r in rows if r["kind"] == "epoch"]
    steps = epochs[-1]["step"]
    assert epochs[-1]["rounds"] == steps // 3  # one exchange per 3 optimizer steps
    # `none`: each exchange is the dense pseudo-gradient (plus the call header), so the
    # dense-equivalent bytes are those of steps // 3 exchanges.
    per_sync = epochs[-1]["dense_payload_bytes"] // (steps // 3)
    assert per_sync * (steps // 3) == epochs[-1]["dense_payload_bytes"]
    assert summary["final_accuracy"] > 0.1
    # Step records (and their TensorBoard scalars): bytes grow at the synchronising steps only.
    wire = [(r["step"], r["wire_bytes"]) for r in rows if r["kind"] == "step"]
    grew = [step for (step, after), (_, before) in zip(wire[1:], wire, strict=False) if after > before]
    assert grew and all(step % 3 == 0 for step in grew)


def test_an_outer_run_ending_between_synchronisations_is_evaluated_as_the_workers_mean(
        tmp_path: Path) -> None:
    """6 steps at H=4: the epoch's record is the test metrics of the workers' mean, not of
    worker 0's own replica (the checkpoint keeps the replicas as they are)."""
    out = tmp_path / "mid"
    cfg = resolve_config(RunConfig(**TINY, epochs=1, out=str(out), outer_steps=4))  # type: ignore[arg-type]
    run(cfg)
    epoch = [r for r in records(out) if r["kind"] == "epoch"][-1]
    assert epoch["step"] == 6 and epoch["rounds"] == 1
    manifest = read_manifest(out)
    assert manifest is not None
    state = load_rank_file(out, manifest, 0)
    worker0, worker1 = state["model"], state["gradzip"]["replicas"][0]
    task = get_task(cfg.task)
    data = task.load(cfg)
    model = task.build_model(cfg, data)

    def metrics(params: dict[str, torch.Tensor]) -> dict[str, float]:
        model.load_state_dict({**worker0, **params})
        model.eval()
        return task.metrics(sum(task.eval_sums(model, data, cfg, 2, r) for r in range(2)).double())

    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any(not torch.equal(worker0[n], worker1[n]) for n in trained)
    mean = metrics({n: (worker0[n] + worker1[n]) / 2 for n in trained})
    assert epoch["test_loss"] == mean["test_loss"] and epoch["accuracy"] == mean["accuracy"]
    assert metrics({})["test_loss"] != mean["test_loss"]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_sim_outer_run_resumed_to_more_epochs_equals_the_uninterrupted_run(tmp_path: Path, mode: str) -> None:
    base: dict[str, Any] = {**TINY, **MODES[mode]}
    run(RunConfig(**base, epochs=3, out=str(tmp_path / "whole")))
    part = tmp_path / "part"
    run(RunConfig(**base, epochs=1, out=str(part)))
    assert read_manifest(part).epoch == 1  # type: ignore[union-attr]
    run(RunConfig(**base, epochs=3, out=str(part)), resume=True)
    assert_same_run(part, tmp_path / "whole")


def _flags(mode: str) -> list[str]:
    flags = []
    for key, value in MODES[mode].items():
        flags += ["--" + key.replace("_", "-"), str(value)]
    return flags


def _train_cmd(out: Path, epochs: int, mode: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "gradzip", "train", "--task", "digits", "--workers", "2",
            "--limit-train", "200", "--milestones", "20", "--log-every", "2",
            "--epochs", str(epochs), "--out", str(out), "--quiet", *_flags(mode), *extra]


@pytest.mark.slow
@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_killed_outer_run_resumes_to_the_uninterrupted_result(tmp_path: Path, mode: str) -> None:
    """SIGKILL the process tree once its second checkpoint exists (the kill point is a file
    the run writes), then resume with --resume.

    The uninterrupted reference, a process of its own with one thread, runs meanwhile: it
    shares nothing with the killed run but the machine."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    whole = tmp_path / "whole"
    ref = subprocess.Popen(_train_cmd(whole, 12, mode), env=env, start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        killed = tmp_path / "killed"
        proc = subprocess.Popen(_train_cmd(killed, 12, mode), env=env, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            while proc.poll() is None:
                manifest = read_manifest(killed) if (killed / "checkpoint").exists() else None
                if manifest is not None and manifest.epoch >= 2:
                    os.killpg(proc.pid, signal.SIGKILL)
                    break
                time.sleep(0.005)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
        assert not (killed / "summary.json").exists()
        done = subprocess.run(_train_cmd(killed, 12, mode, "--resume"), env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        _, ref_err = ref.communicate(timeout=300)
    finally:
        if ref.poll() is None:
            os.killpg(ref.pid, signal.SIGKILL)
            ref.communicate()
    assert ref.returncode == 0, ref_err[-2000:]
    assert_same_run(killed, whole)


@pytest.mark.slow
def test_procs_outer_run_resumed_equals_the_uninterrupted_run_and_sends_the_simulators_bytes(
    tmp_path: Path,
) -> None:
    """Two gloo processes, one worker each, each restoring its own residuals and inner
    optimizer; byte counts as in the simulator."""
    base: dict[str, Any] = {**TINY, **MODES["sparseloco"], "launcher": "procs", "timeout": 300,
                            "threads": 1}
    run(RunConfig(**base, epochs=2, out=str(tmp_path / "whole")))
    part = tmp_path / "part"
    run(RunConfig(**base, epochs=1, out=str(part)))
    manifest = read_manifest(part)
    assert manifest is not None and manifest.processes == 2
    run(RunConfig(**base, epochs=2, out=str(part)), resume=True)
    assert_same_run(part, tmp_path / "whole")
    sim = tmp_path / "sim"
    run(RunConfig(**{**base, "launcher": "sim"}, epochs=2, out=str(sim)))
    for procs_row, sim_row in zip(records(part), records(sim), strict=True):
        for key in ("payload_bytes", "wire_bytes", "dense_wire_bytes", "rounds", "step"):
            assert procs_row[key] == sim_row[key], key


@pytest.mark.parametrize(("extra", "message"), [
    ({"outer_steps": 5, "fragments": 2}, "`outer_steps` must be a multiple of `fragments` (2), got 5"),
    ({"outer_steps": 4, "fragments": 2, "outer_delay": 2}, "`outer_delay` must be below outer_steps / fragments (2), got 2"),
    ({"fragments": 2}, "need `outer_steps` >= 1, got outer_steps=0"),
    ({"outer_steps": 4, "accordion_batch": (32, 64)}, "`accordion_batch` must be unset with `outer_steps`"),
    ({"outer_steps": 4, "outer_optimizer": "ef-momentum", "outer_momentum": 0.9}, "`outer_momentum` must be 0"),
])
def test_outer_options_that_do_not_fit_together_are_one_line_errors(tmp_path: Path, extra, message) -> None:
    with pytest.raises(ValueError) as info:
        resolve_config(RunConfig(**TINY, out=str(tmp_path / "x"), **extra))  # type: ignore[arg-type]
    assert message in str(info.value) and "\n" not in str(info.value)
