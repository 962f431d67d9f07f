"""The outer-step example learns, in one process and under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from integrations_launch import load_script

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "outer_torchrun.py"


def test_outer_example_learns_with_simulated_workers(capsys) -> None:
    module = load_script(EXAMPLE, "outer_torchrun")
    result = module.main(["--workers", "2", "--epochs", "3", "--inner-steps", "5",
                          "--compressor", "chunktopk:chunk=256,k=16,bits=2,average=senders",
                          "--outer", "ef-momentum"])
    assert result["accuracy"] > 0.5  # ten classes: chance is 0.1
    assert result["syncs"] > 10 and result["compression"] > 5
    assert "synchronisations" in capsys.readouterr().out


@pytest.mark.slow
def test_outer_example_under_torchrun(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(EXAMPLE), "--epochs", "2", "--compressor", "binmean:bits=8"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    accuracy = float(proc.stdout.split("accuracy ")[1].split(";")[0])
    assert accuracy > 0.5
