"""The kernel and DDP hook scripts (``benchmarks/micro.py``, ``benchmarks/hooks.py``): their
tables and verdicts, on seconds-long real runs and on fixed rows."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import hooks as hooks_script
from benchmarks import micro as micro_script
from gradzip import bench


def _json_rows(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_micro_script_prints_table_and_verdicts(capsys: pytest.CaptureFixture[str]) -> None:
    code = micro_script.run(["--numel", "1048576", "--repeat", "1", "--threads", "1",
                             "--heap", "default", "--compressors", "topk:ratio=0.01",
                             "powersgd:rank=4"])
    assert code == 0
    out = capsys.readouterr().out
    assert "| compressor" in out and "torch " + torch.__version__ in out
    verdicts = [line for line in out.splitlines() if line.startswith("- ")]
    assert len(verdicts) == 2
    assert verdicts[0].startswith("- topk compress >= 3x faster than torch.topk at 1048576: ")
    assert verdicts[1].startswith("- powersgd compress no slower than the built-in's math at ")
    assert all(("met" in v or "MISSED" in v) for v in verdicts)


def test_micro_script_json_prints_rows_only(capsys: pytest.CaptureFixture[str]) -> None:
    code = micro_script.run(["--json", "--numel", "1048576", "--repeat", "1", "--threads", "1",
                             "--heap", "default", "--compressors", "threshold:lam=2.5758"])
    assert code == 0
    (row,) = _json_rows(capsys.readouterr().out)
    assert row["compressor"] == "threshold:lam=2.5758" and row["numel"] == 1048576


def _micro_row(spec: str, numel: int, compress: float, baseline: float | None,
               select: float | None = None) -> bench.MicroRow:
    return bench.MicroRow(
        compressor=spec, numel=numel, layout=f"[{numel}]", compress_seconds=compress,
        decode_seconds=1.0, clone_seconds=1.0, baseline_seconds=baseline, baseline="b",
        baseline_decode_seconds=None, select_seconds=select, density=None, workers=4,
        threads=1, repeat=1, heap="warm",
    )


def test_micro_verdicts_apply_the_targets() -> None:
    rows = [
        _micro_row("threshold:lam=2.5758", 1_000_000, compress=2.0, baseline=None),
        _micro_row("threshold:lam=2.5758", 2_000_000, compress=2.01, baseline=None),
        _micro_row("topk:ratio=0.01", 1_000_000, compress=1.0, baseline=3.0, select=0.5),
        _micro_row("topk:ratio=0.01", 2_000_000, compress=1.0, baseline=2.99),
        _micro_row("powersgd:rank=4", 1_000_000, compress=1.0, baseline=1.0),
        _micro_row("powersgd:rank=4", 2_000_000, compress=1.01, baseline=1.0),
        _micro_row("topk:ratio=0.01", 999_999, compress=1.0, baseline=0.5),  # below 1M: none
        _micro_row("none", 1_000_000, compress=9.0, baseline=None),  # no target
    ]
    assert micro_script.micro_verdicts(rows) == [
        "threshold compress <= 2x clone at 1000000: met (2.00x)",
        "threshold compress <= 2x clone at 2000000: MISSED (2.01x)",
        "topk compress >= 3x faster than torch.topk at 1000000: met (3.00x; select op alone 6.00x)",
        "topk compress >= 3x faster than torch.topk at 2000000: MISSED (2.99x)",
        "powersgd compress no slower than the built-in's math at 1000000: met "
        "(built-in / gradzip = 1.00)",
        "powersgd compress no slower than the built-in's math at 2000000: MISSED "
        "(built-in / gradzip = 0.99)",
    ]


def test_micro_verdicts_hold_qsgd_and_sign_decoding_under_eight_clones() -> None:
    rows = [_micro_row("qsgd", 1_000_000, compress=1.0, baseline=None),
            _micro_row("sign", 1_000_000, compress=1.0, baseline=None)]
    rows[0].decode_seconds, rows[1].decode_seconds = 7.99, 8.0
    rows[0].kernels = "compiled"
    assert micro_script.micro_verdicts(rows) == [
        "qsgd decode < 8x clone at 1000000: met (7.99x, compiled kernels)",
        "sign decode < 8x clone at 1000000: MISSED (8.00x, fallback kernels)",
    ]


def _hook_row(config: str, workers: int, ratio: float, cpu_ratio: float) -> bench.HookRow:
    return bench.HookRow(
        config=config, workers=workers, seconds_per_step=ratio, ratio_to_nohook=ratio,
        cpu_seconds_per_step=cpu_ratio, cpu_ratio_to_nohook=cpu_ratio, model="m", parameters=1,
        batch_per_worker=1, threads_per_worker=1, steps_per_round=1, rounds=1,
    )


def test_hook_verdicts_apply_the_targets() -> None:
    rows = [
        _hook_row("nohook", 2, 1.0, 1.0), _hook_row("gradzip:none", 2, 1.05, 1.5),
        _hook_row("gradzip:powersgd:rank=4", 2, 1.2, 1.0),
        _hook_row("builtin-powersgd:rank=4", 2, 1.2, 2.0),
        _hook_row("nohook", 4, 1.0, 1.0), _hook_row("gradzip:none", 4, 1.06, 1.0),
        _hook_row("gradzip:powersgd:rank=4", 4, 1.3, 1.0),
        _hook_row("builtin-powersgd:rank=4", 4, 1.2, 1.0),
    ]
    assert hooks_script.hook_verdicts(rows) == [
        "gradzip none within 5% of no hook, 2 workers: met (1.050x; CPU time 1.500x)",
        "gradzip powersgd no slower than the built-in hook, 2 workers: met "
        "(gradzip / built-in = 1.000; CPU time 0.500)",
        "gradzip none within 5% of no hook, 4 workers: MISSED (1.060x; CPU time 1.000x)",
        "gradzip powersgd no slower than the built-in hook, 4 workers: MISSED "
        "(gradzip / built-in = 1.083; CPU time 1.000)",
    ]
    assert hooks_script.hook_verdicts(rows[:2]) == [  # no PowerSGD pair: one line
        "gradzip none within 5% of no hook, 2 workers: met (1.050x; CPU time 1.500x)"]


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
    lines = hooks_script.hook_verdicts([bench.HookRow(**r) for r in rows])
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
    script = micro_script if argv[0] == "micro" else hooks_script
    assert script.run(argv[1:]) == 2
    assert message in capsys.readouterr().err
