"""Smoke versions of ``gradzip bench``: they run and print well-formed rows (no timing checks)."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys

import pytest
import torch

from gradzip import bench
from gradzip.benchmarks_impl import micro
from gradzip.comm.simulated import SimulatedGroup
from gradzip.compressors.base import Job, StepContext
from gradzip.compressors.spec import compressor_from_spec

MICRO_KEYS = {
    "compressor": str, "numel": int, "compress_seconds": float, "decode_seconds": float,
    "clone_seconds": float,
}


def _json_rows(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_micro_json_rows_cover_every_compressor(capsys: pytest.CaptureFixture[str]) -> None:
    code = bench.main(["micro", "--json", "--numel", "70000", "--repeat", "1", "--threads", "1",
                       "--heap", "default"])
    assert code == 0
    rows = _json_rows(capsys.readouterr().out)
    assert [r["compressor"] for r in rows] == list(micro.MICRO_SPECS)
    for row in rows:
        for key, kind in MICRO_KEYS.items():
            assert isinstance(row[key], kind), (row["compressor"], key)
        for key in ("compress_seconds", "decode_seconds", "clone_seconds"):
            assert math.isfinite(row[key]) and row[key] >= 0
        assert row["threads"] == 1 and row["workers"] == 4 and row["heap"] in ("default", "unmanaged")
        has_baseline = row["compressor"].split(":")[0] in ("topk", "powersgd")
        assert (row["baseline_seconds"] is not None) == has_baseline, row["compressor"]
    by_name = {r["compressor"].split(":")[0]: r for r in rows}
    assert by_name["topk"]["density"] == pytest.approx(0.01, rel=0.01)
    assert by_name["powersgd"]["layout"] == "1x[64, 64, 3, 3]"


def test_micro_table_and_verdicts(capsys: pytest.CaptureFixture[str]) -> None:
    code = bench.main(["micro", "--numel", "1048576", "--repeat", "1", "--threads", "1",
                       "--heap", "default", "--compressors", "topk:ratio=0.01", "powersgd:rank=4"])
    assert code == 0
    out = capsys.readouterr().out
    assert "| compressor" in out and "torch " + torch.__version__ in out
    verdicts = [line for line in out.splitlines() if line.startswith("- ")]
    assert len(verdicts) == 2
    assert all(("met" in v or "MISSED" in v) for v in verdicts)


def test_micro_warm_heap_in_its_own_process() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gradzip.bench", "micro", "--json", "--numel", "70000",
         "--repeat", "1", "--threads", "1", "--compressors", "threshold:lam=2.5758"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    (row,) = _json_rows(out)
    assert row["heap"] in ("warm", "unmanaged") and row["compress_seconds"] > 0


@pytest.mark.parametrize("spec", micro.MICRO_SPECS)
def test_replayed_worker_computes_what_the_simulator_computes(spec: str) -> None:
    """The timed pass (one worker, other workers' messages replayed) does the real work."""
    data = torch.randn(4, 40_000, generator=torch.Generator().manual_seed(0))
    compressor = compressor_from_spec(spec)
    jobs, _ = micro._jobs(spec, data)
    state = compressor.init_state({j.name: j.shape for j in jobs})
    compressor.reduce(jobs, copy.deepcopy(state), SimulatedGroup(4),
                      StepContext(0, (0, 1, 2, 3), 4))
    recorded = micro.record_messages(
        compressor, state, lambda w: [Job(j.name, j.tensor[w : w + 1]) for j in jobs], 4
    )
    mine = [Job(j.name, j.tensor[:1]) for j in jobs]
    exchange = micro._Exchange(4, 0, recorded)
    compressor.reduce(mine, copy.copy(state), exchange, StepContext(0, (0,), 4))
    assert exchange.consistent and len(exchange.entries) == len(recorded[0])
    for full, one in zip(jobs, mine, strict=True):
        torch.testing.assert_close(one.averaged, full.averaged, rtol=0, atol=1e-6)
        torch.testing.assert_close(one.own_decoded(), full.own_decoded()[:1], rtol=0, atol=1e-6)
        torch.testing.assert_close(one.leftover(), full.leftover()[:1], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_hooks_json_rows(capsys: pytest.CaptureFixture[str]) -> None:
    configs = ["gradzip:none", "gradzip:powersgd:rank=2", "builtin-powersgd:rank=2"]
    code = bench.main(["hooks", "--json", "--workers", "2", "--steps", "1", "--rounds", "2",
                       "--width", "4", "--batch", "4", "--threads", "1", "--timeout", "300",
                       "--configs", *configs])
    assert code == 0
    rows = _json_rows(capsys.readouterr().out)
    assert [r["config"] for r in rows] == ["nohook", *configs]
    for row in rows:
        assert row["workers"] == 2 and row["seconds_per_step"] > 0
        assert row["rounds"] == 2 and row["threads_per_worker"] == 1
    assert rows[0]["ratio_to_nohook"] == 1.0
    lines = bench.hook_verdicts([bench.HookRow(**r) for r in rows])
    assert len(lines) == 2 and all(("met" in v or "MISSED" in v) for v in lines)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["micro", "--repeat", "0"], "`repeat` must be"),
        (["micro", "--numel", "10", "--compressors", "zip"], "zip"),
        (["hooks", "--configs", "gradzip"], "hook configurations must be"),
        (["hooks", "--workers", "1"], "`workers` must be"),
    ],
)
def test_invalid_arguments_exit_2(argv: list[str], message: str,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(argv) == 2
    assert message in capsys.readouterr().err
