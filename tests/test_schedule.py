"""Level schedules: validation, specs, levels step by step, LR drops, checkpoints, the CLI."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

import gradzip
from gradzip import Engine, Schedule, SimulatedGroup, compressor_from_spec
from gradzip.control import parse_level_schedule
from test_accordion_state import scaled_grads

C, S, D = "critical", "steady", "dense"
SHAPES = {n: g.shape[1:] for n, g in scaled_grads(0).items()}


@pytest.mark.parametrize(
    ("kwargs", "exc", "message"),
    [
        ({"gentle_steps": [(3, 3)]}, ValueError, "`gentle_steps` ranges must satisfy 0 <= start < end, got (3, 3)"),
        ({"gentle_steps": [(4, 8), (2, 3)]}, ValueError, "`gentle_steps` ranges must be sorted and disjoint"),
        ({"gentle_steps": [(0, 1.5)]}, TypeError, "`gentle_steps` must be an integer, got 1.5"),
        ({"gentle_steps": "0-5"}, TypeError, "`gentle_steps` must be a sequence of (start, end) pairs"),
        ({"gentle_epochs": [(0, 1)]}, ValueError, "`steps_per_epoch` must be given with `gentle_epochs`"),
        ({"gentle_epochs": [(0, 1)], "steps_per_epoch": 0}, ValueError, "`steps_per_epoch` must be >= 1, got 0"),
        ({"after_drop": -1}, ValueError, "`after_drop` must be >= 0, got -1"),
    ],
)
def test_schedule_validates(kwargs: dict, exc: type, message: str) -> None:
    with pytest.raises(exc) as info:
        Schedule("powersgd:rank=4", "powersgd:rank=1", **kwargs)
    assert message in str(info.value)


def test_levels_must_be_of_one_kind_and_not_controllers() -> None:
    with pytest.raises(ValueError, match="`gentle` must be the same kind of compressor as `aggressive`"):
        Schedule("topk:ratio=0.5", "powersgd:rank=1")
    with pytest.raises(TypeError, match="`gentle` must be a plain compressor"):
        Schedule(Schedule.warmup("topk:ratio=0.1", 5), "topk:ratio=0.1")


def test_spec_round_trip_epochs_and_warmup() -> None:
    sched = Schedule("powersgd:rank=4", "powersgd:rank=1", gentle_epochs=[(0, 1.5), (3, 4)],
                     steps_per_epoch=10)
    assert sched.gentle_steps == ((0, 15), (30, 40))
    spec = "schedule(gentle=powersgd:rank=4,aggressive=powersgd:rank=1,gentle_steps=0-15;30-40,after_drop=0)"
    assert sched.spec() == spec
    assert compressor_from_spec(spec) == sched == Schedule.parse(spec)
    warm = Schedule.warmup("topk:ratio=0.01", steps=100)
    assert warm.spec() == "schedule(gentle=none,aggressive=topk,gentle_steps=0-100,after_drop=0)"
    assert warm.biased and gradzip.Schedule is Schedule
    with pytest.raises(ValueError, match="`steps` must be >= 1, got 0"):
        Schedule.warmup("topk:ratio=0.01", steps=0)
    with pytest.raises(ValueError, match="must give integer steps"):
        Schedule.parse("schedule(gentle=none,aggressive=topk:ratio=0.1,gentle_steps=0-x)")


def test_parse_level_schedule() -> None:
    text = "gentle:0-5,aggressive:5-15,gentle:15-18,aggressive:18-30"
    assert parse_level_schedule(text) == [(0, 5), (15, 18)]
    assert parse_level_schedule("aggressive:0-2, gentle:2-2.5") == [(2, 2.5)]
    with pytest.raises(ValueError, match="part kinds must be 'gentle' or 'aggressive', got 'dense'"):
        parse_level_schedule("dense:0-5")
    with pytest.raises(ValueError, match="sorted and disjoint"):
        parse_level_schedule("gentle:0-5,aggressive:4-30")


def used_levels(engine: Engine, steps: int, drop_at: int | None = None,
                opt: torch.optim.Optimizer | None = None) -> list[str]:
    """The level ``fc.weight`` is reduced at in each step (read between the step's calls)."""
    used = []
    for t in range(steps):
        if t == drop_at and opt is not None:
            opt.param_groups[0]["lr"] *= 0.1
        engine.reduce(scaled_grads(t), finish_step=False)
        used.append(Schedule.levels(engine)["fc.weight"])
        engine.reduce({}, finish_step=True)
    return used


def test_levels_follow_the_ranges_and_counts_and_records_match() -> None:
    sched = Schedule("powersgd:rank=4", "powersgd:rank=1", gentle_steps=[(0, 3), (6, 8)])
    engine = Engine(SHAPES, sched, collective=SimulatedGroup(4))
    used = used_levels(engine, 10)
    assert used == [C] * 3 + [S] * 3 + [C] * 2 + [S] * 2
    assert Schedule.levels(engine)["fc.bias"] == D  # dense at both PowerSGD levels
    counts = Schedule.counts(engine)
    assert (counts["critical_steps"], counts["steady_steps"], counts["dense_steps"]) == (10, 10, 10)
    assert counts["switches"] == 3 and counts["reasons"]["schedule"] == 4
    log = Schedule.decisions(engine, since=0)
    assert [(r["step"], r["level"]) for r in log] == [(0, C), (3, S), (6, C), (8, S)]
    # Bytes: the gentle level costs more in its 5 steps than the aggressive one in the others.
    static = Engine(SHAPES, "powersgd:rank=1", collective=SimulatedGroup(4))
    for t in range(10):
        static.reduce(scaled_grads(t))
    assert engine.stats["payload_bytes"][0] > static.stats["payload_bytes"][0]


def test_after_drop_holds_the_gentle_level_for_that_many_steps() -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = Schedule("topk:ratio=0.2", "topk:ratio=0.02", gentle_steps=[(0, 2)], after_drop=3)
    engine = Engine(SHAPES, sched, collective=SimulatedGroup(4), optimizer=opt)
    used = used_levels(engine, 10, drop_at=5, opt=opt)
    assert used == [C] * 2 + [S] * 3 + [C] * 3 + [S] * 2
    assert [r["reason"] for r in Schedule.decisions(engine, since=0)] == [
        "schedule", "schedule", "lr_drop", "schedule"]


def test_checkpoint_resumes_mid_schedule_bit_exactly() -> None:
    def engine() -> Engine:
        return Engine(SHAPES, Schedule("powersgd:rank=4", "powersgd:rank=1",
                                       gentle_steps=[(0, 4), (9, 14)]),
                      collective=SimulatedGroup(4))

    straight = engine()
    expected = [straight.reduce(scaled_grads(t)) for t in range(20)]
    first = engine()
    for t in range(11):  # inside the second gentle range
        first.reduce(scaled_grads(t))
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = engine()
    resumed.load_state_dict(torch.load(buffer, weights_only=False))
    for t in range(11, 20):
        got = resumed.reduce(scaled_grads(t))
        assert all(torch.equal(got[n], expected[t][n]) for n in SHAPES), t
    assert Schedule.counts(resumed) == Schedule.counts(straight)
    assert Schedule.decisions(resumed, since=0) == Schedule.decisions(straight, since=0)
    other = Engine(SHAPES, Schedule("powersgd:rank=4", "powersgd:rank=1", gentle_steps=[(0, 5)]),
                   collective=SimulatedGroup(4))
    with pytest.raises(ValueError, match="gentle_steps=0-4;9-14"):
        other.load_state_dict(first.state_dict())


def test_cli_level_schedule_and_warmup(tmp_path: Path) -> None:
    from gradzip.cli import main

    out = tmp_path / "sched"
    code = main(["train", "--task", "digits", "--workers", "2", "--epochs", "3",
                 "--limit-train", "200", "--compressor", "powersgd:rank=1", "--gentle",
                 "powersgd:rank=2", "--level-schedule", "aggressive:0-1,gentle:1-2,aggressive:2-3",
                 "--out", str(out), "--quiet"])
    assert code == 0
    epochs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in epochs if r.get("kind") == "epoch"]
    assert [r["critical_fraction"] for r in epochs] == [0.0, 1.0, 0.0]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["level_schedule"] == "aggressive:0-1,gentle:1-2,aggressive:2-3"
    assert summary["accordion_counts"]["switches"] == 2
    warm = tmp_path / "warm"
    assert main(["train", "--task", "digits", "--workers", "2", "--epochs", "2",
                 "--limit-train", "200", "--compressor", "topk:ratio=0.1", "--warmup-steps", "3",
                 "--out", str(warm), "--quiet"]) == 0
    decisions = json.loads((warm / "accordion_decisions.json").read_text())
    assert [(r["step"], r["level"]) for r in decisions] == [(0, C), (3, S)]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--level-schedule", "gentle:0-1", "--warmup-steps", "2"], "`warmup_steps` must be 0"),
        (["--warmup-steps", "2", "--accordion", "none"], "`accordion` must be unset"),
        (["--gentle", "none"], "`gentle` needs `level_schedule` or `warmup_steps`"),
        (["--level-schedule", "gentle:0-x"], "--level-schedule: `level_schedule` epochs must"),
    ],
)
def test_cli_rejects_inconsistent_schedule_options(args: list[str], message: str,
                                                   tmp_path: Path) -> None:
    from gradzip.train.runner import RunConfig, resolve_config

    values = {"task": "digits", "out": str(tmp_path / "x"), "compressor": "topk:ratio=0.1"}
    flags = dict(zip(args[::2], args[1::2], strict=True))
    for flag, value in flags.items():
        key = flag[2:].replace("-", "_")
        values[key] = int(value) if key == "warmup_steps" else value
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("`", "`")):
        resolve_config(RunConfig.from_dict(values))
