"""The GPU check script: its dry run, its argument checks, and a real run on the CPU.

``benchmarks/gpu_check.sh`` only runs in full on a CUDA machine; what can run here does: the
plan it prints for one and for two GPUs, and the whole timing driver (``gpu_step.py``) with two
gloo processes and a tiny model.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "benchmarks" / "gpu_step.py"
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
EXPECTED = [
    "local", "ddp", "torch-fp16", "torch-powersgd:rank=4", "gradzip:none", "gradzip:fp16",
    "gradzip:powersgd:rank=4", "gradzip:topk:ratio=0.01", "gradzip:accordion(",
]


def _run(*args: str, script: Path = DRIVER) -> subprocess.CompletedProcess[str]:
    command = ["bash", str(script)] if script.suffix == ".sh" else [sys.executable, "-m",
                                                                 "benchmarks.gpu_step"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("OUT", None)
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=120,
                          env=env, cwd=ROOT)


def _rows(stdout: str) -> list[str]:
    return [line.strip() for line in stdout.splitlines() if line.strip().startswith("row ")]


@pytest.mark.slow  # starts a process
def test_dry_run_with_one_gpu_shares_it_over_gloo_and_adds_a_one_rank_nccl_setup(tmp_path: Path) -> None:
    done = _run("--dry-run", "--device", "cuda", "--gpus", "1", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "setup gloo-1gpu: backend gloo, 2 rank(s)" in done.stdout
    assert "setup nccl-1rank: backend nccl, 1 rank(s)" in done.stdout
    assert "nccl-2gpu" not in done.stdout
    rows = _rows(done.stdout)
    only = _run("--dry-run", "--device", "cuda", "--gpus", "1", "--setups", "nccl-1rank")
    assert only.returncode == 0 and "gloo-1gpu" not in only.stdout
    assert len(_rows(only.stdout)) == len(EXPECTED)
    assert len(rows) == 2 * len(EXPECTED)
    for setup in ("gloo-1gpu", "nccl-1rank"):
        for config in EXPECTED:
            assert any(r.startswith(f"row {setup} {config}") for r in rows), (setup, config)
    assert not list(tmp_path.iterdir())  # a dry run writes nothing


@pytest.mark.slow  # starts a process
def test_dry_run_with_two_gpus_uses_nccl_one_gpu_per_rank() -> None:
    done = _run("--dry-run", "--device", "cuda", "--gpus", "2")
    assert done.returncode == 0, done.stderr
    assert "setup nccl-2gpu: backend nccl, 2 rank(s)" in done.stdout
    assert "gloo-1gpu" not in done.stdout


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.slow  # starts a process
def test_shell_script_dry_run() -> None:
    done = _run("--dry-run", "--device", "cuda", "--gpus", "1", script=SCRIPT)
    assert done.returncode == 0, done.stderr
    assert "tests/test_cuda.py tests/test_ddp_async_cuda.py" in done.stdout
    assert "benchmarks.host_time --device cuda" in done.stdout
    assert "benchmarks.gpu_profile --configs torch-powersgd:rank=4" in done.stdout
    assert "budget 300 s" in done.stdout
    assert len(_rows(done.stdout)) == 2 * len(EXPECTED)


@pytest.mark.slow  # starts a process
def test_arguments_are_checked() -> None:
    done = _run("--dry-run", "--warmup", "2")
    assert done.returncode == 2
    assert "--warmup must be >= 3" in done.stderr and "got 2" in done.stderr
    done = _run("--dry-run", "--configs", "gradzip:sign")
    assert done.returncode == 2 and "invalid choice" in done.stderr
    done = _run("--dry-run", "--device", "cuda", "--gpus", "1", "--setups", "nccl-2gpu")
    assert done.returncode == 2
    assert "--setups must name setups of this plan (gloo-1gpu, nccl-1rank), got nccl-2gpu" in done.stderr


@pytest.mark.slow
def test_cpu_run_writes_every_row_and_the_table(tmp_path: Path) -> None:
    configs = ["local", "ddp", "gradzip:none", "gradzip:powersgd:rank=4", "torch-powersgd:rank=4"]
    done = _run("--device", "cpu", "--out", str(tmp_path), "--steps", "2", "--warmup", "3",
                "--configs", *configs)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "gpu_step.json").read_text())
    rows = result["rows"]
    assert [r["config"] for r in rows] == configs
    for row in rows:
        assert row["error"] is None, row
        assert row["backend"] == "gloo" and row["world"] == 2 and row["device"] == "cpu"
        assert row["steps"] == 2 and 0 < row["min_s"] <= row["median_s"]
    assert result["meta"]["setups"][0]["name"] == "cpu-gloo-2"
    table = (tmp_path / "gpu_step.md").read_text()
    assert table.count("| cpu-gloo-2 |") == len(configs)
    # The table is what a truncated log keeps: it comes last.
    assert done.stdout.rstrip().endswith(table.rstrip().splitlines()[-1])
