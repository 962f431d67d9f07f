"""The test suite's own settings: property tests run derandomized under CI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = ("import conftest; from hypothesis import settings; d = settings.default; "
         "print(d.derandomize, d.database is None, d.deadline)")


@pytest.mark.parametrize(("ci", "want"), [("1", "True True None"), ("", "False False None")])
def test_hypothesis_runs_derandomized_when_ci_is_set(ci: str, want: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "HYPOTHESIS_PROFILE")}
    if ci:
        env["CI"] = ci
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == want.split()
