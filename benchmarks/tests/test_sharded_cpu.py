"""benchmarks/sharded_cpu.py: one row per (spec, W), both forms timed, the files written."""

from __future__ import annotations

import json

import pytest

from benchmarks import sharded_cpu


def test_a_small_run_writes_both_forms_for_every_spec(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(sharded_cpu, "SHAPES", {"w": (16, 16), "b": (16,)})
    assert sharded_cpu.main(["--out", str(tmp_path), "--workers", "3", "--steps", "1",
                             "--repeats", "1"]) == 0
    rows = json.loads((tmp_path / "sharded_cpu.json").read_text())["rows"]
    assert [(r["spec"], r["workers"]) for r in rows] == [(s, 3) for s in sharded_cpu.SPECS]
    for r in rows:
        assert r["allgather_ms"] > 0 and r["sharded_ms"] > 0
        assert r["sharded_over_allgather"] == pytest.approx(r["sharded_ms"] / r["allgather_ms"])
    assert "| `topk:ratio=0.01` | 3 |" in (tmp_path / "sharded_cpu.md").read_text()


def test_arguments_are_checked() -> None:
    with pytest.raises(SystemExit):
        sharded_cpu.main(["--workers", "1"])
