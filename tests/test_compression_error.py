"""The relative compression error: sqrt(sum ||e||^2 / sum ||x||^2), overall and per level."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from gradzip import Engine, Schedule, SimulatedGroup, TopK
from gradzip.train.runner import RunConfig, run


def _grads(seed: int, workers: int = 2, shape: tuple[int, ...] = (10, 10)) -> torch.Tensor:
    return torch.randn((workers, *shape), generator=torch.Generator().manual_seed(seed))


def test_topk_error_equals_the_hand_computed_value() -> None:
    engine = Engine({"w": (10, 10)}, "topk:ratio=0.1", collective=SimulatedGroup(2))
    g = torch.arange(200.0).reshape(2, 10, 10) - 77.5
    engine.reduce({"w": g})
    # Each worker keeps its 10 largest magnitudes; the rest stays behind.
    x = g.reshape(2, -1).double()
    kept = x.abs().sort(dim=1).values[:, -10:]
    want = math.sqrt(float(((x**2).sum() - (kept**2).sum()) / (x**2).sum()))
    assert engine.compression_error() == {"compression_error": pytest.approx(want, rel=1e-6)}
    # Read once: a new span starts, and it holds no step.
    assert engine.compression_error() == {"compression_error": None}


def test_error_sums_steps_and_uses_the_compensated_gradient() -> None:
    engine = Engine({"w": (10, 10)}, "topk:ratio=0.1", collective=SimulatedGroup(2))
    e_sq = x_sq = 0.0
    residual = torch.zeros(2, 10, 10)
    for step in range(3):
        g = _grads(step)
        x = g + residual  # error feedback: the compressor's input
        engine.reduce({"w": g})
        residual = engine.residuals["w"]
        e_sq += float(residual.double().square().sum())
        x_sq += float(x.double().square().sum())
    got = engine.compression_error(reset=False)["compression_error"]
    assert got == pytest.approx(math.sqrt(e_sq / x_sq), rel=1e-6)
    assert engine.compression_error()["compression_error"] == got  # reset=False kept it


def test_exact_and_unknown_errors() -> None:
    def error_of(spec: str, **options: Any) -> float | None:
        engine = Engine({"w": (10, 10)}, spec, collective=SimulatedGroup(2), **options)
        engine.reduce({"w": _grads(0)})
        return engine.compression_error()["compression_error"]

    assert error_of("none") == 0.0  # sends everything: exact, no residual needed
    assert error_of("none", error_feedback=True) == 0.0  # a residual of zeros
    assert error_of("fp16") is None  # lossy without a residual: unknown
    assert error_of("topk:ratio=0.1", error_feedback=False) is None
    assert error_of("topk:ratio=0.1") > 0.5


def test_tensors_routed_dense_are_left_out() -> None:
    shapes = {"w": (10, 10), "b": (10,)}
    plain = Engine({"w": (10, 10)}, "topk:ratio=0.1", collective=SimulatedGroup(2))
    routed = Engine(shapes, "topk:ratio=0.1", collective=SimulatedGroup(2), dense_1d=True)
    g = _grads(0)
    plain.reduce({"w": g})
    routed.reduce({"w": g, "b": 100 * _grads(1, shape=(10,))})
    assert routed.compression_error() == plain.compression_error()


@dataclasses.dataclass(frozen=True)
class _AlwaysCritical(TopK):
    """A compressor of one level that reports it the way controllers report theirs."""

    def tensor_levels(self, state: Any) -> dict[str, str] | None:
        return {"w": "critical"}


def test_the_meter_learns_levels_from_the_compressor_not_its_type() -> None:
    assert TopK(ratio=0.1).tensor_levels({}) is None
    schedule = Schedule("topk:ratio=0.3", "topk:ratio=0.05", gentle_steps=[(0, 2)])
    fresh = schedule.init_state({"w": torch.Size([10, 10])})
    assert schedule.tensor_levels(fresh) == schedule.levels(fresh) == {"w": "critical"}
    engine = Engine({"w": (10, 10)}, _AlwaysCritical(ratio=0.1), collective=SimulatedGroup(2))
    for step in range(2):
        engine.reduce({"w": _grads(step)})
    out = engine.compression_error()
    assert out["compression_error_aggressive"] is None
    assert out["compression_error_gentle"] == out["compression_error"] > 0.0


def test_a_schedule_splits_the_error_by_level() -> None:
    schedule = Schedule("topk:ratio=0.3", "topk:ratio=0.05", gentle_steps=[(0, 2)])
    engine = Engine({"w": (10, 10)}, schedule, collective=SimulatedGroup(2))
    sums = {"gentle": [0.0, 0.0], "aggressive": [0.0, 0.0]}
    residual = torch.zeros(2, 10, 10)
    for step in range(5):
        g = _grads(step)
        x = g + residual
        engine.reduce({"w": g})
        residual = engine.residuals["w"]
        level = "gentle" if step < 2 else "aggressive"
        sums[level][0] += float(residual.double().square().sum())
        sums[level][1] += float(x.double().square().sum())
        if step == 1:  # an epoch spent at the gentle level only
            first = engine.compression_error()
            assert first["compression_error_aggressive"] is None
            gentle = math.sqrt(sums["gentle"][0] / sums["gentle"][1])
            assert first["compression_error_gentle"] == pytest.approx(gentle, rel=1e-6)
            assert first["compression_error"] == first["compression_error_gentle"]
    later = engine.compression_error()
    assert later["compression_error_gentle"] is None
    aggressive = math.sqrt(sums["aggressive"][0] / sums["aggressive"][1])
    assert later["compression_error_aggressive"] == pytest.approx(aggressive, rel=1e-6)
    assert later["compression_error_aggressive"] > first["compression_error_gentle"]


def test_a_step_the_nonfinite_policy_skips_is_left_out() -> None:
    for device in (False, True):
        engine = Engine({"w": (10, 10)}, "powersgd:rank=1", collective=SimulatedGroup(2),
                        nonfinite="skip", decide_on="device" if device else "host")
        engine.reduce({"w": _grads(0)})
        clean = engine.compression_error(reset=False)
        bad = _grads(1)
        bad[0, 0, 0] = float("nan")
        engine.reduce({"w": bad})
        assert engine.stats["skipped_steps"] == 1
        assert engine.compression_error() == clean, device


def test_the_device_path_measures_what_the_host_path_does() -> None:
    results = []
    for device in (False, True):
        engine = Engine({"w": (10, 10)}, "powersgd:rank=1", collective=SimulatedGroup(2),
                        decide_on="device" if device else "host")
        for step in range(3):
            engine.reduce({"w": _grads(step)})
        results.append(engine.compression_error())
    assert results[0] == results[1]
    assert 0.0 < results[0]["compression_error"] < 1.0  # type: ignore[operator]


def test_invalid_arguments_are_refused() -> None:
    engine = Engine({"w": (10, 10)}, "topk:ratio=0.1", collective=SimulatedGroup(2))
    with pytest.raises(TypeError, match="`reset` must be a bool"):
        engine.compression_error(reset="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`pool` must be a callable or None, got int"):
        engine.compression_error(pool=3)  # type: ignore[arg-type]


def test_pool_sums_over_processes() -> None:
    engine = Engine({"w": (10, 10)}, "topk:ratio=0.1", collective=SimulatedGroup(2))
    engine.reduce({"w": _grads(0)})
    alone = engine.compression_error(reset=False)
    # Two processes holding the very same sums have the same ratio.
    assert engine.compression_error(pool=lambda t: 2 * t) == pytest.approx(alone)


# -- the training loop's epoch records -----------------------------------------------------
TINY = dict(task="digits", workers=2, limit_train=200, milestones=(2.0,))


def _records(out: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "epoch"]


def test_epoch_records_carry_the_error_and_a_resumed_run_equals_the_whole(tmp_path: Path) -> None:
    base = dict(TINY, compressor="topk:ratio=0.1")
    run(RunConfig(**base, epochs=2, out=str(tmp_path / "whole")))  # type: ignore[arg-type]
    whole = _records(tmp_path / "whole")
    assert [0.0 < r["compression_error"] < 1.0 for r in whole] == [True, True]
    assert "compression_error_gentle" not in whole[0]  # no controller
    part = tmp_path / "part"
    run(RunConfig(**base, epochs=1, out=str(part)))  # type: ignore[arg-type]
    run(RunConfig(**base, epochs=2, out=str(part)), resume=True)  # type: ignore[arg-type]
    keys = ("compression_error", "step", "train_loss")
    assert [[r[k] for k in keys] for r in _records(part)] == [[r[k] for k in keys] for r in whole]


def test_a_schedule_run_records_each_level(tmp_path: Path) -> None:
    # Gentle for the first epoch's 6 steps, aggressive for the second epoch's.
    cfg = RunConfig(**TINY, epochs=2, compressor="topk:ratio=0.02", warmup_steps=6,  # type: ignore[arg-type]
                    out=str(tmp_path))
    run(cfg)
    first, second = _records(tmp_path)
    assert (first["step"], second["step"]) == (6, 12)
    assert first["compression_error_gentle"] == 0.0  # the gentle level is "none"
    assert first["compression_error_aggressive"] is None
    assert second["compression_error_gentle"] is None
    assert second["compression_error_aggressive"] > 0.5
    assert first["compression_error"] == 0.0
    assert second["compression_error"] == second["compression_error_aggressive"]


@pytest.mark.slow
def test_procs_runs_pool_the_ranks_like_the_simulator(tmp_path: Path) -> None:
    """Two gloo processes, each measuring its own worker, sum their norms before the ratio:
    the simulator's value over both workers, to float rounding."""
    base = dict(TINY, epochs=1, compressor="topk:ratio=0.1", threads=1)
    run(RunConfig(**base, out=str(tmp_path / "sim")))  # type: ignore[arg-type]
    run(RunConfig(**base, launcher="procs", timeout=300, out=str(tmp_path / "procs")))  # type: ignore[arg-type]
    (sim,), (procs,) = _records(tmp_path / "sim"), _records(tmp_path / "procs")
    assert procs["compression_error"] == pytest.approx(sim["compression_error"], rel=1e-4)
