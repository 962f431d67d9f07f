"""The host-time benchmark behind benchmarks/host_time.py: its arithmetic, its verdicts and
the structure of what it writes (never its timings)."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import host_time


def _row(scheme: str, step_ms: float, path: str = "device") -> dict:
    return {"path": path, "scheme": scheme, "step_ms": step_ms}


def test_extras_are_over_no_ddp_and_ratios_over_native_ddp() -> None:
    rows = host_time.with_extras([
        _row("local", 10.0), _row("ddp", 12.0), _row("gradzip:none", 13.0),
        _row("gradzip:sign", 16.0, "auto")])
    by = {(r["path"], r["scheme"]): r for r in rows}
    assert by[("device", "ddp")]["x_ddp"] == 1.0
    assert by[("device", "gradzip:none")]["extra_ms"] == 3.0
    assert by[("device", "gradzip:none")]["x_ddp"] == 1.5
    assert by[("auto", "gradzip:sign")]["x_ddp"] == 3.0
    found = {v["target"]: v["met"] for v in host_time.verdicts(rows)}
    assert found == {"gradzip:none (device path) extra host time <= 2.0x native DDP's": True,
                     "gradzip:sign (auto path) extra host time <= 2.0x native DDP's": False}


def test_a_ddp_no_slower_than_no_ddp_gives_no_ratio() -> None:
    rows = host_time.with_extras([_row("local", 10.0), _row("ddp", 9.0), _row("gradzip:none", 11.0)])
    assert math.isnan(rows[-1]["x_ddp"])
    assert host_time.verdicts(rows)[0]["met"] is False


def test_arguments_are_validated() -> None:
    with pytest.raises(SystemExit):
        host_time.main(["--paths", "gpu"])
    with pytest.raises(SystemExit):
        host_time.main(["--only", "gradzip:topk"])
    with pytest.raises(SystemExit):
        host_time.main(["--rounds", "0"])


@pytest.mark.slow
def test_a_tiny_run_writes_every_row_and_verdict(tmp_path) -> None:
    code = host_time.main(["--out", str(tmp_path), "--rounds", "2", "--steps", "1",
                           "--warmup", "1", "--width", "2", "--paths", "device,auto",
                           "--only", "gradzip:none", "--only", "gradzip:topk:ratio=0.01"])
    assert code == 0
    saved = json.loads((tmp_path / "host_time.json").read_text())
    assert saved["meta"]["paths"] == ["device", "auto"] and saved["meta"]["world_size"] == 1
    keys = [(r["path"], r["scheme"]) for r in saved["rows"]]
    assert keys == [("device", "local"), ("device", "ddp"), ("device", "gradzip:none"),
                    ("device", "gradzip:topk:ratio=0.01"), ("auto", "gradzip:none"),
                    ("auto", "gradzip:topk:ratio=0.01")]
    for row in saved["rows"]:
        assert len(row["rounds_ms"]) == 2 and row["tensors"] == 62
        assert {"step_ms", "extra_ms", "x_ddp", "buckets"} <= row.keys()
    assert len(saved["verdicts"]) == 4
    text = (tmp_path / "host_time.md").read_text()
    assert text.startswith("| path | scheme |") and "| target | measured | verdict |" in text
