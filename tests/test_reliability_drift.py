"""Rank drift behind the DDP hook: a rank that runs one backward more than the others (a
retried batch) and one fewer later. The engine's own step count advances alike on every rank,
so only the hook's count of optimizer steps, carried in every call's header, reveals it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip
import shared_launch
from ddp_helpers import batch, mlp

OUT_OF_STEP = "ranks are out of step"


def _drift(rank: int, world: int, spec: str, overlap: bool, with_optimizer: bool,
           bucket_cap_mb: float) -> dict[str, Any]:
    model = mlp()
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = gradzip.ddp.register(ddp, spec, overlap=overlap,
                                 optimizer=opt if with_optimizer else None)
    plan = list(range(6))
    if rank == 0:
        plan.insert(2, -1)  # a retried batch: one backward without an optimizer step ...
        plan.pop()          # ... and one step fewer at the end, so the ranks' calls pair up
    error, failed_at = None, None
    for i, step in enumerate(plan):
        x, y = batch(max(step, 0), rank)
        try:
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            if step >= 0:
                opt.step()
        except RuntimeError as err:
            error, failed_at = str(err), i
            break
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"error": error, "failed_at": failed_at, "params": params,
            "steps": state.engine.step if error is None else None}


#: (spec, overlap, with the optimizer, bucket_cap_mb) of each scenario.
CASES = [
    ("none", True, True, 25.0),              # the flat path, on the communication thread
    ("topk:ratio=0.1", False, True, 25.0),   # the ordinary path, inside the hook
    ("powersgd:rank=2", True, True, 1e-5),   # one bucket per parameter
    ("none", False, False, 25.0),            # without the optimizer
]


def _drifts(rank: int, world: int) -> list[dict[str, Any]]:
    """Every case in one set of processes (starting them costs more than the cases; each case
    builds its own model, DDP and hook, and a caught drift fails on both ranks at the same
    call, so the collectives stay paired for the next case)."""
    return [_drift(rank, world, *case) for case in CASES]


shared_launch.register(2, "drift", _drifts, threads=1)


@pytest.fixture(scope="module")
def drifts(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, Any]]]:
    """``drifts[case][rank]``."""
    # Launched with the other modules' workers of this world size (see shared_launch).
    by_rank = shared_launch.results(2, "drift", tmp_path_factory)
    return [list(ranks) for ranks in zip(*by_rank, strict=True)]


@pytest.mark.slow
@pytest.mark.parametrize("case", range(3), ids=[c[0] for c in CASES[:3]])
def test_a_rank_with_an_extra_backward_is_caught_on_every_rank(
    drifts: list[list[dict[str, Any]]], case: int
) -> None:
    results = drifts[case]
    for rank, res in enumerate(results):
        assert res["error"] is not None and OUT_OF_STEP in res["error"], (rank, res["error"])
    # Caught at the first reduction after the retried one: rank 0's fourth backward (plan
    # index 3), rank 1's fourth (index 3): the calls pair up by position.
    assert [r["failed_at"] for r in results] == [3, 3]


@pytest.mark.slow
def test_without_the_optimizer_the_drift_goes_unseen(drifts: list[list[dict[str, Any]]]) -> None:
    """What the header cannot know without the optimizer: both ranks finish and the replicas
    differ (why the integrations always pass the optimizer)."""
    results = drifts[3]
    assert [r["error"] for r in results] == [None, None]
    assert not torch.equal(results[0]["params"], results[1]["params"])
