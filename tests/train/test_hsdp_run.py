"""The runner under ``--hsdp REPLICAS``: FSDP2 inside islands, gradzip across them, in real
gloo processes (2 x 2: 4 workers, 2 replicas of 2 shards); and under ``--fsdp``: FSDP2 over
every worker, its reduce-scatter through gradzip (2 workers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_resume import TINY, assert_same_run, records

from gradzip.train.config import resolve_config
from gradzip.train.rundir import read_manifest
from gradzip.train.runner import RunConfig, run
from gradzip.train.tasks import get_task

HSDP: dict[str, Any] = {**TINY, "workers": 4, "hsdp": 2, "launcher": "procs", "timeout": 300,
                        "threads": 1}


def _parameters(cfg: dict[str, Any], tmp_path: Path) -> int:
    resolved = resolve_config(RunConfig(**{**cfg, "launcher": "sim", "hsdp": 0},
                                        out=str(tmp_path / "model")))
    task = get_task(resolved.task)
    model = task.build_model(resolved, task.load(resolved))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.slow
def test_hsdp_run_resumed_equals_the_uninterrupted_run_and_sends_shards(tmp_path: Path) -> None:
    base = {**HSDP, "compressor": "powersgd:rank=2"}
    run(RunConfig(**base, epochs=2, out=str(tmp_path / "whole")))
    part = tmp_path / "part"
    run(RunConfig(**base, epochs=1, out=str(part)))
    manifest = read_manifest(part)
    assert manifest is not None and manifest.processes == 4
    run(RunConfig(**base, epochs=2, out=str(part)), resume=True)
    assert_same_run(part, tmp_path / "whole")
    # Each rank's engine holds its shards: the dense equivalent of what it exchanges across
    # replicas is half the model (2 shards) per step, every digits dimension dividing by 2.
    dense = 4 * _parameters(base, tmp_path)
    for row in records(part):
        if row["kind"] == "epoch":
            assert row["dense_payload_bytes"] * 2 == dense * row["step"]
            assert row["rounds"] == row["step"]
    summary = json.loads((part / "summary.json").read_text())
    assert summary["config"]["hsdp"] == 2


@pytest.mark.slow
def test_hsdp_outer_run_synchronises_shards_every_h_steps(tmp_path: Path) -> None:
    out = tmp_path / "outer"
    summary = run(RunConfig(**HSDP, epochs=1, outer_steps=3, compressor="topk:ratio=0.1",
                            out=str(out)))
    epoch = [r for r in records(out) if r["kind"] == "epoch"][-1]
    assert epoch["rounds"] == epoch["step"] // 3
    # One exchange of half the model's dense pseudo-gradient per synchronisation.
    assert epoch["dense_payload_bytes"] * 2 == 4 * _parameters(HSDP, tmp_path) * epoch["rounds"]
    assert summary["final_test_loss"] == summary["final_test_loss"]  # finite, not NaN


@pytest.mark.slow
def test_fsdp_run_resumed_equals_the_uninterrupted_run_and_exchanges_the_whole_model(
        tmp_path: Path) -> None:
    base = {**TINY, "launcher": "procs", "timeout": 300, "threads": 1, "fsdp": True,
            "compressor": "topk:ratio=0.1"}
    run(RunConfig(**base, epochs=2, out=str(tmp_path / "whole")))
    part = tmp_path / "part"
    run(RunConfig(**base, epochs=1, out=str(part)))
    run(RunConfig(**base, epochs=2, out=str(part)), resume=True)
    assert_same_run(part, tmp_path / "whole")
    # Each rank's engine holds the unsharded gradients: the dense equivalent of what it
    # exchanges is the whole model per step.
    dense = 4 * _parameters({**base, "fsdp": False}, tmp_path)
    for row in records(part):
        if row["kind"] == "epoch":
            assert row["dense_payload_bytes"] == dense * row["step"]
    summary = json.loads((part / "summary.json").read_text())
    assert summary["config"]["fsdp"] is True


@pytest.mark.parametrize(("extra", "message"), [
    ({"hsdp": 2, "launcher": "sim"}, "`hsdp` needs one process per worker (--launcher procs or "
                                     "torchrun), got launcher='sim' with hsdp=2"),
    ({"hsdp": 3, "launcher": "procs"}, "`hsdp` must divide `workers` (4) into islands of equal "
                                       "size, got 3"),
    ({"hsdp": -1, "launcher": "procs"}, "`hsdp` must be"),
    ({"hsdp": 2, "launcher": "procs", "accordion_batch": (64, 128)},
     "`accordion_batch` must be unset with `hsdp`"),
    ({"hsdp": 2, "launcher": "procs", "outer_steps": 4, "fragments": 2, "outer_delay": 1},
     "`outer_delay` must be 0 with `hsdp`"),
    ({"fsdp": True, "hsdp": 2, "launcher": "procs"}, "`fsdp` must be off with `hsdp`"),
    ({"fsdp": True, "launcher": "sim"}, "`fsdp` needs one process per worker"),
    ({"fsdp": True, "launcher": "procs", "outer_steps": 4}, "`outer_steps` must be unset with "
                                                           "`fsdp`"),
    ({"fsdp": True, "launcher": "procs", "accordion_batch": (64, 128)},
     "`accordion_batch` must be unset with `fsdp`"),
])
def test_hsdp_options_that_do_not_fit_are_one_line_errors(tmp_path: Path, extra: dict[str, Any],
                                                           message: str) -> None:
    with pytest.raises(ValueError) as info:
        resolve_config(RunConfig(**{**TINY, "workers": 4, **extra}, out=str(tmp_path / "x")))
    assert message in str(info.value) and "\n" not in str(info.value)
