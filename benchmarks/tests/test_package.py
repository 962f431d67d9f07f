"""``benchmarks/`` as a package: no script edits ``sys.path``; every script imports as
``benchmarks.<name>`` and runs as ``python -m benchmarks.<name>`` from any folder; the shared
helpers validate their input; tables come from ``gradzip.bench``'s layout."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
from pathlib import Path

import pytest

from benchmarks import _claims_results, _common, _quality_report, loopback_steps
from benchmarks._common import ROOT, module_command, package_env

SCRIPTS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", SCRIPTS)
def test_no_script_touches_sys_path_and_each_imports_from_the_package(name: str) -> None:
    tree = ast.parse((ROOT / "benchmarks" / f"{name}.py").read_text())
    touched = [node.lineno for node in ast.walk(tree)
               if isinstance(node, ast.Attribute) and node.attr == "path"
               and isinstance(node.value, ast.Name) and node.value.id == "sys"]
    assert touched == [], f"benchmarks/{name}.py edits sys.path at lines {touched}"
    importlib.import_module(f"benchmarks.{name}")


@pytest.mark.slow  # starts a process
def test_a_script_runs_as_a_module_from_another_folder(tmp_path: Path) -> None:
    # What a launcher does for its children: the interpreter, -m, and the root on PYTHONPATH.
    done = subprocess.run([*module_command("micro"), "--help"], cwd=tmp_path, capture_output=True,
                          text=True, env=package_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--numel" in done.stdout


def test_module_command_and_package_env() -> None:
    assert module_command("netem_worker")[1:] == ["-m", "benchmarks.netem_worker"]
    for bad in ("no_such_script", "../src/gradzip/cli", 3):
        with pytest.raises(ValueError, match="`module` must name a module of benchmarks/, got"):
            module_command(bad)  # type: ignore[arg-type]
    base = {"PYTHONPATH": os.pathsep.join(["/a", str(ROOT)]), "X": "1"}
    env = package_env(base, "/src")
    assert env["PYTHONPATH"].split(os.pathsep) == ["/src", str(ROOT), "/a"]
    assert env["X"] == "1" and base["PYTHONPATH"] == os.pathsep.join(["/a", str(ROOT)])
    assert package_env({})["PYTHONPATH"] == str(ROOT)
    assert _common.RESULTS == ROOT / "benchmarks" / "results"


def test_loopback_table_uses_the_library_layout() -> None:
    row = {"config": "ddp", "ms_per_step": 12.34, "vs_ddp": 1.0, "vs_floor": None,
           "cpu_ms_per_step": 20.0, "cpu_vs_ddp": 1.0, "cpu_vs_floor": None}
    lines = loopback_steps.table([("main", [row]), ("src", [row])]).splitlines()
    assert len(lines) == 4 and len({len(line) for line in lines}) == 1  # aligned columns
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    assert cells[0][:3] == ["src", "config", "wall ms/step"]
    assert cells[3] == ["src", "ddp", "12.3", "1.000", "-", "20.0", "1.000", "-"]


def test_quality_table_uses_the_library_layout() -> None:
    base = {"final_accuracy_mean": 0.7512, "final_accuracy_spread": 0.01,
            "bytes_sent_per_worker": 3 * 2**20, "compression": 4.0}
    rows = [{**base, "label": "dense", "critical_found": None},
            {**base, "label": "accordion", "critical_found": 2.0, "critical_forced": 1.0,
             "decision_points": 10, "critical_step_share": 0.25}]
    lines = _quality_report.markdown({"part": "cifar10", "rows": rows}).splitlines()
    assert len(lines) == 4 and len({len(line) for line in lines}) == 1
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    assert cells[0][1] == "test accuracy % (mean, spread)"
    assert cells[2] == ["dense", "75.12 (1.00)", "3.00", "4.0x", "-", "-"]
    assert cells[3] == ["accordion", "75.12 (1.00)", "3.00", "4.0x", "2.0 (1.0) of 10", "25%"]


def test_claims_table_averages_seeds_in_the_library_layout() -> None:
    rows = [{"setting": "smoke", "family": "powersgd", "role": "gentle", "spec": "powersgd:rank=4",
             "seed": seed, "final": final, "wire_bytes_per_worker": 2_000_000 * (seed + 1)}
            for seed, final in ((0, 70.0), (1, 72.0))]
    lines = _claims_results.table(rows).splitlines()
    assert len(lines) == 3 and len({len(line) for line in lines}) == 1
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    assert cells[0] == ["setting", "family", "role", "seeds", "final", "spread", "MB/worker", "spec"]
    assert cells[2] == ["smoke", "powersgd", "gentle", "2", "71.00", "2.00", "3.0", "powersgd:rank=4"]
