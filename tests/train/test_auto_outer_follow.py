"""``--auto-outer-follow``: once outer steps run, the candidates are weighed again at each
synchronisation, and H changes where two in a row choose another candidate.

A scripted clock stands for the machine: the task moves it by ``per_loss`` seconds for every
loss (two simulated workers: two losses a step), and nothing else does, so a synchronising
step takes as long as any other (the measured link is free) and the link is priced where the
configuration pins it, at one second per dense exchange. Candidates are priced at time per
step times the step cost of their H (1 at H = 10, 1.15 at H = 30). With 0.1 s per loss, H = 30
is the cheapest (0.233 s a step, 0.268 priced, against 0.3 s at H = 10); at 50 s per loss the
link no longer matters and H = 10 is (100.1 s against 115.0 priced).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from test_auto_outer_run import FORCED, _Net, _Ticks, _TimedTask

from gradzip.comm.base import allreduce_wire_bytes
from gradzip.plan import Auto
from gradzip.train.auto_outer import SwitchingStepper
from gradzip.train.config import resolve_config
from gradzip.train.runner import RunConfig

BATCH = (torch.randn(5, 4, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 0, 1, 1]))


def _stepper(tmp_path: Path, clock: _Ticks, follow: bool = True) -> SwitchingStepper:
    torch.manual_seed(0)
    model = _Net()
    dense = 4 * sum(p.numel() for p in model.parameters())
    cfg = resolve_config(RunConfig(**{  # type: ignore[arg-type]
        **FORCED, "auto_outer_early": True, "auto_outer_follow": follow,
        "auto_outer_steps": (10, 30), "out": str(tmp_path / "x"),
        "auto_outer_bandwidth_mbit": dense * 8 / 1e6}))
    auto = Auto(levels="none", warmup=0, every=3, eta=100, clock=clock)
    return SwitchingStepper(model, _TimedTask(clock), auto, cfg,
                            torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"))


def _steps(stepper: SwitchingStepper, clock: _Ticks, per_loss: list[float]) -> list[int]:
    """One step per entry, at that compute; the completed steps after which the run would
    evaluate (each synchronisation)."""
    evals = []
    for seconds in per_loss:
        clock.per_loss = seconds
        torch.manual_seed(stepper.steps)  # dropout draws, the same on a resume
        stepper.step([[BATCH], [BATCH]], [0, 0])
        if stepper.eval_due(stepper.steps, 1000):
            evals.append(stepper.steps)
    return evals


SCRIPT = [0.1] * 60 + [50.0] * 60 + [50.0] * 20


def test_h_follows_the_compute_after_two_agreeing_synchronisations(tmp_path: Path) -> None:
    clock = _Ticks(0.1)
    stepper = _stepper(tmp_path, clock)
    evals = _steps(stepper, clock, SCRIPT)
    (switch, *follows) = stepper.take_records()
    assert (switch["switch"], switch["candidate"]) == (True, "diloco-h30")
    assert [(r["kind"], r["step"], r["in_force"], r["chosen"], r["change"]) for r in follows] == [
        ("outer_follow", 29, "diloco-h30", "diloco-h30", False),
        ("outer_follow", 59, "diloco-h30", "diloco-h30", False),
        ("outer_follow", 89, "diloco-h30", "diloco-h10", False),
        ("outer_follow", 119, "diloco-h30", "diloco-h10", True),
        ("outer_follow", 129, "diloco-h10", "diloco-h10", False),
        ("outer_follow", 139, "diloco-h10", "diloco-h10", False)]
    assert follows[3]["to"] == {"candidate": "diloco-h10", "outer_steps": 10, "outer_lr": 0.7,
                                "outer_momentum": 0.5, "exchange": "none"}
    assert follows[0]["compute_ms"] == pytest.approx(200.0)  # two losses a step
    assert follows[2]["compute_ms"] == pytest.approx(100_000.0)
    # H = 30 is a hair faster per step at 50 s a loss, but its step cost makes H = 10 cheaper.
    ms = follows[2]["predicted_ms"]
    assert ms["diloco-h30"] < ms["diloco-h10"] < 1.05 * ms["diloco-h30"]
    # Evaluations at every synchronisation: every 30 steps, then every 10 after the change.
    assert evals == [30, 60, 90, 120, 130, 140]
    assert stepper.changes == 1 and stepper.active is not None
    assert (stepper.active["outer_steps"], stepper.active["since"]) == (10, 120)
    assert stepper.epoch_fields() == {"outer_steps": 10}
    assert stepper.eval_fields() == {"outer_steps": 10, "switched_at": 0, "outer_since": 120}
    assert stepper.summary_fields()["auto_outer"]["in_force"]["candidate"] == "diloco-h10"


def test_the_totals_count_every_exchange_and_weighing(tmp_path: Path) -> None:
    """Bytes: the switch's, six exchanges (four at H = 30, two at H = 10, one engine carried
    across the change: the same exchange), and six weighings of two floats per worker
    (float64, one row per rank, one all-reduce each); a run without following is the
    reference for the switch's and one exchange's bytes."""
    clock = _Ticks(0.1)
    stepper = _stepper(tmp_path, clock)
    plain_clock = _Ticks(0.1)
    plain = _stepper(tmp_path, plain_clock, follow=False)
    _steps(stepper, clock, SCRIPT)
    _steps(plain, plain_clock, SCRIPT[:60])  # the switch and two exchanges
    mine, theirs = stepper.stats, plain.stats
    one = (theirs["wire_bytes"][0] - plain.exchange["wire"][0]) // 2
    weighing = allreduce_wire_bytes(2 * 2 * 8, 2)
    assert stepper.exchange["wire"][0] == plain.exchange["wire"][0] + 6 * weighing
    assert mine["wire_bytes"][0] == plain.exchange["wire"][0] + 6 * weighing + 6 * one
    assert mine["steps"] == theirs["steps"] + 4  # rounds: one per exchange


def test_a_changed_exchange_keeps_the_replaced_loop_in_the_totals(tmp_path: Path) -> None:
    """Where the exchange changes, the new loop's engine starts empty and the replaced one's
    counters stay in the run's totals."""
    clock = _Ticks(0.1)
    stepper = _stepper(tmp_path, clock)
    _steps(stepper, clock, SCRIPT[:60])
    before = stepper.stats
    assert stepper.outer is not None
    outer = stepper.outer
    stepper._change(outer, {"to": {"candidate": "diloco-h10-8bit", "outer_steps": 10,
                                   "outer_lr": 0.7, "outer_momentum": 0.5,
                                   "exchange": "scatterq:bits=8"},
                            "in_force": "diloco-h30", "predicted_ms": {"diloco-h10-8bit": 1.0,
                                                                      "diloco-h30": 1.0},
                            "bandwidth_mbit": 1.0, "compute_ms": 1.0})
    assert stepper.outer is not outer and stepper.stats == before
    assert stepper.outer.outer.engine.stats["wire_bytes"] == [0, 0]


def test_a_resume_in_the_middle_of_a_streak_continues_exactly(tmp_path: Path) -> None:
    clock = _Ticks(0.1)
    whole = _stepper(tmp_path, clock)
    _steps(whole, clock, SCRIPT)
    first_clock = _Ticks(0.1)
    first = _stepper(tmp_path, first_clock)
    _steps(first, first_clock, SCRIPT[:100])  # one synchronisation has chosen H = 10
    assert first.streak == ("diloco-h10", 1)
    state = copy.deepcopy(first.state_dict())
    model_state = copy.deepcopy(first.model.state_dict())
    later_clock = _Ticks(0.1)
    later_clock.now = first_clock.now
    later = _stepper(tmp_path, later_clock)
    later.model.load_state_dict(model_state)
    later.load_state_dict(state)
    _steps(later, later_clock, SCRIPT[100:])
    assert later.changes == 1 and later.active == whole.active
    assert later.stats == whole.stats
    for a, b in zip(later.model.state_dict().values(), whole.model.state_dict().values(),
                    strict=True):
        assert torch.equal(a, b)
    assert later.outer is not None and whole.outer is not None
    for a, b in zip(later.outer.replicas[1].parameters(), whole.outer.replicas[1].parameters(),
                    strict=True):
        assert torch.equal(a, b)


def test_without_follow_h_stays(tmp_path: Path) -> None:
    clock = _Ticks(0.1)
    stepper = _stepper(tmp_path, clock, follow=False)
    evals = _steps(stepper, clock, SCRIPT)
    assert evals == [30, 60, 90, 120] and stepper.changes == 0
    assert [r.get("kind") for r in stepper.take_records()] == ["outer_switch"]


def test_follow_needs_auto_outer() -> None:
    with pytest.raises(ValueError, match="`auto_outer_follow`.*need `auto_outer`"):
        resolve_config(RunConfig(**{"compressor": "none", "auto_outer_follow": True}))  # type: ignore[arg-type]




@pytest.mark.slow
def test_procs_weigh_at_every_synchronisation_like_the_simulator(tmp_path: Path) -> None:
    """Two gloo processes weigh at every synchronisation with the maxima over the ranks: the
    same choice on both (the link pinned slow: H = 4 with the 8-bit exchange stays), the
    weighings' bytes counted as the simulator counts them, and the simulator's bits."""
    from test_auto_outer_run import EIGHT, _assert_same_run, _summary

    from gradzip.train.runner import run

    base: dict[str, Any] = {**EIGHT, "timeout": 300, "threads": 1, "auto_outer_early": True,
                            "auto_outer_follow": True, "auto_outer_steps": (2, 4),
                            "compressor": EIGHT["compressor"].replace("warmup=2", "warmup=0")}
    procs, sim = tmp_path / "procs", tmp_path / "sim"
    run(RunConfig(**base, epochs=2, launcher="sim", out=str(sim)))  # type: ignore[arg-type]
    run(RunConfig(**base, epochs=2, launcher="procs", out=str(procs)))  # type: ignore[arg-type]
    a, b = _summary(procs)["auto_outer"], _summary(sim)["auto_outer"]
    assert a["in_force"] == b["in_force"] and a["in_force"]["candidate"] == "diloco-h4-8bit"
    assert a["changes"] == b["changes"] == 0
    _assert_same_run(procs, sim)
