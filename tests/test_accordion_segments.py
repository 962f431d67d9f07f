"""Accordion with PowerSGD at both levels on the segment path (a bucket as one row), against
the ordinary device path and the host path.

The row's plan depends on the levels: after a decision changes one, the engine asks for a new
plan. Across decisions, with both signals, with and without error feedback and with a NaN
step, the segment path must leave the same averages, residuals, controller state, counters
and compression errors as the ordinary call, bit for bit.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import gradzip.engine.core
import test_segments_single as single_bucket
from gradzip import Engine
from gradzip.comm.simulated import SingleWorker

#: Two matrices of one shape (so a shape's group splits when one of them changes level), one
#: of another, a matrix PowerSGD sends dense at rank 4 but not at rank 1, and biases.
SHAPES = {"a.weight": (16, 32), "b.weight": (16, 32), "c.weight": (24, 8, 3, 3),
          "d.weight": (6, 5), "a.bias": (16,), "c.bias": (24,)}


def _scale(name: str, step: int) -> float:
    """Gradient scales whose window norms change by more than eta for some tensors at some
    decisions and not for others, so levels go both ways."""
    if name.startswith("a.") and step >= 6:
        return 8.0
    if name.startswith("c.") and 4 <= step < 10:
        return 0.1
    return 1.0


def run(spec: str, decide_on: str, *, nan_at: int | None = None, steps: int = 16,
         error_feedback: bool = True, device: str = "cpu") -> dict[str, Any]:
    engine = Engine({n: torch.Size(s) for n, s in SHAPES.items()}, spec,
                    collective=SingleWorker(), decide_on=decide_on,
                    error_feedback=error_feedback)
    buffer, views = single_bucket.bucket(device, SHAPES)
    layout = engine.bucket_layout(views, buffer)
    averages = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        for name, view in views.items():
            view.copy_((torch.randn(view.shape, generator=gen) * _scale(name, step)).to(device))
        if step == nan_at:
            views["b.weight"][3, 5] = float("nan")
        engine.reduce_bucket(layout, finish_step=True, step=step)
        averages.append(buffer.cpu().clone())
    segs = layout.segments
    return {"averages": torch.stack(averages), "state": engine.state_dict(),
            "stats": engine.stats, "error": engine.compression_error(),
            "levels": engine.compressor.levels(engine.compressor_state),
            "segment_calls": segs.calls if segs is not None else 0}


def equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype
                and torch.equal(a.cpu().nan_to_num(7.0), b.cpu().nan_to_num(7.0)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(equal(x, y) for x, y in zip(a, b, strict=True)))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    return bool(a == b)


def ordinary(spec: str, monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> dict[str, Any]:
    """The run with the segment path switched off (the ordinary device call)."""
    with monkeypatch.context() as m:
        m.setattr(gradzip.engine.core, "segments_apply", lambda *args: False)
        return run(spec, "device", **kwargs)


SPECS = [
    "accordion(steady=powersgd:rank=1,critical=powersgd:rank=4,eta=0.5,interval=2)",
    "accordion(steady=powersgd:rank=1,critical=powersgd:rank=4,eta=0.5,interval=3,window=2,"
    "signal=sent)",
    "accordion(steady=powersgd:rank=1,critical=powersgd:rank=2,eta=0.3,interval=2,"
    "per_layer=false)",
    # The gentle level dense: its tensors ride in PowerSGD's first message.
    "accordion(steady=powersgd:rank=4,critical=none,eta=0.5,interval=2)",
]


@pytest.mark.parametrize("spec", SPECS)
def test_the_segment_path_equals_the_ordinary_call_across_decisions(
    spec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    got = run(spec, "device")
    want = ordinary(spec, monkeypatch)
    host = run(spec, "host")
    assert want["segment_calls"] == 0 and got["segment_calls"] > 0
    # Levels went both ways during the run (the plan was rebuilt), and both levels served.
    log = got["state"]["compressor_state"]["controller"]["log"]
    assert {r["level"] for r in log} >= {"steady", "critical"}, log
    for other in (want, host):
        assert equal(got["averages"], other["averages"])
        assert equal(got["state"], other["state"])
        assert got["stats"] == other["stats"] and got["error"] == other["error"]
        assert got["levels"] == other["levels"]


def test_a_plan_is_made_again_when_a_level_changes_and_only_then(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    from gradzip.engine import segments

    made: list[tuple[str, ...]] = []
    build = segments._build

    def counting(engine: Any, layout: Any, key: Any) -> Any:
        made.append(tuple(lv for _, lv in key[2]))
        return build(engine, layout, key)

    monkeypatch.setattr(segments, "_build", counting)
    got = run(SPECS[0], "device")
    assert got["segment_calls"] > 0
    # A new plan exactly when the levels differ from those of the plan before (a return to
    # earlier levels makes one again: one plan is kept per bucket).
    assert len(made) >= 3 and all(a != b for a, b in zip(made, made[1:], strict=False)), made


@pytest.mark.parametrize("spec", SPECS[:2])
def test_a_nan_and_no_error_feedback_as_on_the_ordinary_call(
    spec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for kwargs in ({"nan_at": 7}, {"error_feedback": False}):
        got = run(spec, "device", **kwargs)  # type: ignore[arg-type]
        want = ordinary(spec, monkeypatch, **kwargs)  # type: ignore[arg-type]
        assert got["segment_calls"] > 0, kwargs
        assert equal(got["averages"], want["averages"]), kwargs
        assert equal(got["state"], want["state"]), kwargs
        assert got["stats"] == want["stats"] and got["error"] == want["error"], kwargs
    nan = run(spec, "device", nan_at=7)
    assert nan["stats"]["skipped_steps"] == 1


def test_levels_of_other_kinds_take_the_ordinary_call() -> None:
    for spec in ("accordion(steady=topk:ratio=0.1,critical=topk:ratio=0.5,interval=2)",
                 "accordion(steady=powersgd:rank=1,critical=powersgd:rank=2,power_iterations=2,"
                 "interval=2)"):
        assert run(spec, "device", steps=4)["segment_calls"] == 0, spec
