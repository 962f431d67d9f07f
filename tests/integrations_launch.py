"""Run a framework-integration worker script under torchrun with 2 CPU (gloo) processes.

Each ``test_integrations_*.py`` file is also its own worker: run as a script (by torchrun) it
trains with the real framework and saves what every rank saw under an output folder; the
tests then compare those files.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def torchrun(script: Path, *args: str, timeout: float = 180.0) -> str:
    """``torchrun --standalone --nproc-per-node 2 <script> <args>``; returns stdout.

    The launcher and its workers run in their own session, killed as a group on timeout so a
    hang fails the test instead of blocking it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{script.name} hung for {timeout} s:\n{out}\n{err[-4000:]}")
    assert proc.returncode == 0, f"{script.name} failed ({proc.returncode}):\n{out}\n{err[-6000:]}"
    return out


def trees_equal(a: Any, b: Any) -> bool:
    """Nested dicts/lists of tensors and plain values equal exactly (dtype included)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(trees_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, type(a)) and len(a) == len(b) and all(map(trees_equal, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b
