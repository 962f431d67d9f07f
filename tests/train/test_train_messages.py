"""What ``gradzip train`` says it did: how to resume after Ctrl-C, and an outer-step run's
header (H, and its bytes against per-step averaging)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradzip._cli_train import interrupted_hint
from gradzip.cli import main
from gradzip.comm.base import allreduce_wire_bytes
from gradzip.outer.defaults import outer_defaults
from gradzip.train.config import resolve_config
from gradzip.train.metrics import format_bytes
from gradzip.train.runner import RunConfig
from gradzip.train.tasks import get_task

TRAIN = ["train", "--task", "digits", "--workers", "2", "--limit-train", "200",
         "--milestones", "20", "--compressor", "topk:ratio=0.1", "--quiet"]

#: The real ``gradzip train`` with one pause added once epoch 1's checkpoint is committed: it
#: writes the marker file named by ``argv[1]`` and blocks on stdin, where the test interrupts
#: it (SIGINT, as Ctrl-C does); the point of the interruption does not depend on speed.
_PAUSED_RUN = """
import signal
import sys
from pathlib import Path

from gradzip._cli_train import interrupted_hint
from gradzip.cli import main
from gradzip.train.resume import Checkpointer

marker, argv = Path(sys.argv[1]), sys.argv[2:]
save = Checkpointer.__call__
# A suite started in the background inherits SIGINT ignored, and Python then keeps it ignored:
# Ctrl-C's handler is set here so that the test's SIGINT is what a terminal's would be.
signal.signal(signal.SIGINT, signal.default_int_handler)


def save_then_pause(self, loop):
    save(self, loop)
    if loop.done["epoch"] == 1:
        marker.write_text("epoch 1 checkpointed")
        sys.stdin.read()  # interrupted here by the test


Checkpointer.__call__ = save_then_pause
sys.exit(main(argv))
"""


@pytest.mark.slow
def test_ctrl_c_says_the_exact_command_that_resumes(tmp_path: Path) -> None:
    out, marker = tmp_path / "run", tmp_path / "paused"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [*TRAIN, "--epochs", "3", "--out", str(out)]
    proc = subprocess.Popen([sys.executable, "-c", _PAUSED_RUN, str(marker), *argv], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600  # a safety net only: the wait ends on the marker
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert marker.exists(), proc.stderr.read()[-2000:]  # type: ignore[union-attr]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err[-2000:]
    command = "gradzip " + shlex.join([*argv, "--resume"])
    assert err == (f"gradzip train: interrupted; {out} holds the checkpoint of epoch 1; "
                   f"resume with: {command}\n")
    done = subprocess.run([sys.executable, "-m", *shlex.split(command)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"gradzip train: resuming {out} from epoch 1 of 3")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2, 3]


def test_ctrl_c_of_a_start_over_says_the_old_results_stay(tmp_path: Path) -> None:
    argv = [*TRAIN, "--out", str(tmp_path), "--overwrite"]
    hint = interrupted_hint(argv, str(tmp_path), overwrite=True)
    assert hint == (f"the results in {tmp_path} are unchanged (a start over replaces them only "
                    "once finished); run the same command again to start over")
    argv = [*TRAIN, "--out", str(tmp_path / "new")]
    hint = interrupted_hint(argv, str(tmp_path / "new"), overwrite=False)
    assert hint == (f"no checkpoint in {tmp_path / 'new'} yet; resume (from the beginning) "
                    f"with: gradzip {shlex.join([*argv, '--resume'])}")


def test_an_outer_run_header_says_h_and_compares_with_per_step_averaging(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*TRAIN, "--epochs", "1", "--outer-steps", "3", "--out", str(tmp_path / "run")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    cfg = resolve_config(RunConfig(task="digits", workers=2, limit_train=200))
    task = get_task("digits")
    model = task.build_model(cfg, task.load(cfg))
    numel = sum(p.numel() for p in model.parameters())
    dense = allreduce_wire_bytes(4 * numel, 2)
    lr, momentum = outer_defaults(3)
    assert first == (
        f"gradzip train: outer-step training (H=3, nesterov outer lr {lr:g}, momentum "
        f"{momentum:g}): the workers synchronise every 3 optimizer "
        f"steps, about {format_bytes(dense / 3)} per worker and optimizer step before "
        f"topk:ratio=0.1 compresses it vs {format_bytes(dense)} for per-step dense averaging "
        "(3x less)")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["dense_step_bytes_per_worker"] == dense
    per_step = summary["bytes_sent_per_worker"] / summary["steps"]
    assert (f"per optimizer step {format_bytes(per_step)} sent per worker vs "
            f"{format_bytes(dense)} for per-step dense averaging "
            f"({dense / per_step:.1f}x less)") in out
