"""Run the project's scripts from tests: under torchrun with 2 CPU (gloo) processes, or loaded
as a module.

The examples run the way users run them (``tests/test_ddp_examples.py``), and each
``test_integrations_*.py`` file is also its own worker: run as a script (by torchrun) it
trains with the real framework and saves what every rank saw under an output folder; the
tests then compare those files (:func:`trees_equal`).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def torchrun(script: Path, *args: str, timeout: float = 180.0) -> str:
    """``torchrun --standalone --nproc-per-node 2 <script> <args>``; returns stdout.

    One thread per process, unbuffered output, and Hugging Face libraries offline and without
    tokenizer threads. The launcher and its workers run in their own session, killed as a
    group on timeout so a hang fails the test instead of blocking it.

    Args:
        script: the script's path.
        args: its command-line arguments.
        timeout: seconds before the whole group is killed and the test fails.

    Returns:
        What the ranks printed on stdout.
    """
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
        pytest.fail(f"{script.name} {' '.join(args)} hung for {timeout} s:\n{out}\n{err[-4000:]}")
    assert proc.returncode == 0, f"{script.name} failed ({proc.returncode}):\n{out}\n{err[-6000:]}"
    return out


def load_script(path: Path, name: str) -> ModuleType:
    """The script at ``path`` (an example or a benchmark; their folders are no packages) as a
    module called ``name``, without running its ``__main__`` block.

    The module is registered in ``sys.modules`` under ``name`` before it runs: dataclasses
    (and pickling) look a class's module up there by name."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def trees_equal(a: Any, b: Any) -> bool:
    """Nested dicts/lists of tensors and plain values equal exactly (dtype included)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(trees_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, type(a)) and len(a) == len(b) and all(map(trees_equal, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b
