"""The test suite's own settings: property tests run derandomized under CI, and a test that
needs an optional package skips naming the extra that installs it."""

from __future__ import annotations

import ast
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


def _extras() -> set[str]:
    import tomllib  # Python 3.11+; the check below is skipped on 3.10

    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"])


@pytest.mark.skipif(sys.version_info < (3, 11), reason="reads pyproject.toml with tomllib (3.11+)")
def test_every_skip_for_a_missing_package_names_its_extra() -> None:
    extras = _extras()
    missing = []
    for path in [*(ROOT / "tests").rglob("test_*.py"), *(ROOT / "benchmarks").rglob("test_*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "pytest.importorskip":
                reason = next((k.value for k in node.keywords if k.arg == "reason"), None)
                text = reason.value if isinstance(reason, ast.Constant) else ""
                if not any(f"`{extra}` extra" in text for extra in extras):
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert missing == [], "importorskip without a reason naming the extra: " + ", ".join(missing)
