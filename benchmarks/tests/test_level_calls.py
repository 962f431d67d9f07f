"""benchmarks/level_calls.py: the joint and the separate exchange of PowerSGD levels compared."""

from __future__ import annotations

import json

import pytest

from benchmarks import level_calls
from gradzip.compressors.powersgd import PowerSGD


def test_a_small_run_compares_both_ways_and_restores_the_classes(tmp_path) -> None:
    shares, levels = PowerSGD.shares_exchange, level_calls.gradzip.Accordion._run_levels
    assert level_calls.main(["--out", str(tmp_path), "--workers", "2", "--width", "4",
                             "--steps", "30"]) == 0
    assert PowerSGD.shares_exchange is shares
    assert level_calls.gradzip.Accordion._run_levels is levels
    result = json.loads((tmp_path / "level_calls.json").read_text())
    joint, apart = result["joint"], result["apart"]
    assert result["same_bits"] and joint["calls"] == apart["calls"] == 30
    assert joint["payload_bytes_per_step"] == apart["payload_bytes_per_step"]
    # Every call holding both levels saves two all-reduces, or one where a level's tensors
    # all travel dense (that level alone makes one all-reduce, not two).
    saved = round((apart["collective_calls_per_step"] - joint["collective_calls_per_step"]) * 30)
    both = joint["calls_with_both_levels"]
    assert both <= saved <= 2 * both
    assert joint["calls_with_both_levels"] > 0
    assert "| together |" in (tmp_path / "level_calls.md").read_text()


def test_the_dense_gentle_level_saves_one_all_reduce_per_mixed_call(tmp_path) -> None:
    spec = "accordion(steady=powersgd:rank=4,critical=none,eta=0.5,interval=10)"
    assert level_calls.main(["--out", str(tmp_path), "--workers", "2", "--width", "4",
                             "--steps", "30", "--spec", spec, "--name", "dense"]) == 0
    result = json.loads((tmp_path / "dense.json").read_text())
    joint, apart = result["joint"], result["apart"]
    assert result["spec"] == spec and result["same_bits"]
    saved = round((apart["collective_calls_per_step"] - joint["collective_calls_per_step"]) * 30)
    assert saved == joint["calls_with_both_levels"] > 0


def test_arguments_are_checked() -> None:
    with pytest.raises(SystemExit):
        level_calls.main(["--steps", "0"])
    with pytest.raises(SystemExit):
        level_calls.main(["--spec", "powersgd:rank=4"])
    with pytest.raises(SystemExit):
        level_calls.main(["--spec", "accordion(steady=nope)"])
