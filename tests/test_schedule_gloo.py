"""Level schedules in 2 real gloo processes: through an Engine on the world group and through
the DDP hook (one bucket per parameter), every rank reduces each step at the scheduled level,
the simulator's, including the gentle steps after a learning-rate drop."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip.ddp
import shared_launch
from ddp_helpers import TINY_BUCKET_MB, batch, mlp, replicas_identical
from gradzip import Engine, Schedule, SimulatedGroup
from test_accordion_state import scaled_grads

WORLD = 2
STEPS = 14
DROP_AT = 10
SPEC = ("schedule(gentle=powersgd:rank=4,aggressive=powersgd:rank=1,gentle_steps=0-3;6-8,"
        "after_drop=2)")
# Steps 0-2 and 6-7 by the ranges, 10-11 after the drop.
EXPECTED = ["c"] * 3 + ["s"] * 3 + ["c"] * 2 + ["s"] * 2 + ["c"] * 2 + ["s"] * 2


def level_of_step(before: dict[str, Any], after: dict[str, Any]) -> str:
    """``"c"`` or ``"s"``: the level a step ran its deciding tensors at, from the counts."""
    crit = after["critical_steps"] - before["critical_steps"]
    steady = after["steady_steps"] - before["steady_steps"]
    assert (crit == 0) != (steady == 0), (crit, steady)  # one level for every tensor
    return "c" if crit else "s"


def engine_levels(rank: int | None) -> list[str]:
    """An Engine (world group, or 2 simulated workers for ``rank=None``) fed fixed gradients."""
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    shapes = {n: g.shape[1:] for n, g in scaled_grads(0, WORLD).items()}
    engine = Engine(shapes, SPEC, optimizer=opt,
                    collective=SimulatedGroup(WORLD) if rank is None else None)
    used = []
    for t in range(STEPS):
        if t == DROP_AT:
            opt.param_groups[0]["lr"] = 0.01
        grads = scaled_grads(t, WORLD)
        if rank is not None:
            grads = {n: g[rank] for n, g in grads.items()}
        before = Schedule.counts(engine)
        engine.reduce(grads)
        used.append(level_of_step(before, Schedule.counts(engine)))
    return used


def ddp_levels(rank: int) -> dict[str, Any]:
    model = mlp()
    ddp = DDP(model, bucket_cap_mb=TINY_BUCKET_MB)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = gradzip.ddp.register(ddp, SPEC, optimizer=opt)
    used, identical = [], []
    for t in range(STEPS):
        if t == DROP_AT:
            opt.param_groups[0]["lr"] = 0.005
        opt.zero_grad()
        x, y = batch(t, rank)
        before = Schedule.counts(state.engine)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        used.append(level_of_step(before, Schedule.counts(state.engine)))
        identical.append(replicas_identical(model))
    return {"used": used, "identical": identical,
            "levels": Schedule.levels(state.engine), "log": Schedule.decisions(state.engine, since=0)}


def _worker(rank: int, world: int) -> dict[str, Any]:
    return {"engine": engine_levels(rank), "ddp": ddp_levels(rank)}


shared_launch.register(WORLD, "schedule", _worker, threads=1)


@pytest.mark.slow
def test_levels_follow_the_schedule_on_every_rank(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    # Launched with the other modules' workers of this world size (see shared_launch).
    results = shared_launch.results(WORLD, "schedule", tmp_path_factory)
    assert engine_levels(None) == EXPECTED
    for rank, got in enumerate(results):
        assert got["engine"] == EXPECTED, rank
        assert got["ddp"]["used"] == EXPECTED, rank
        assert all(got["ddp"]["identical"]), rank
    assert results[0]["ddp"]["log"] == results[1]["ddp"]["log"]
    assert [r["reason"] for r in results[0]["ddp"]["log"]] == [
        "schedule", "schedule", "schedule", "schedule", "lr_drop", "schedule"]
    # Biases go dense at both PowerSGD levels: they have no level to follow.
    assert {lv for n, lv in results[0]["ddp"]["levels"].items() if n.endswith("bias")} == {"dense"}
