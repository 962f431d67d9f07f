"""After a worker dies, restarting every rank from the last checkpoint continues exactly as an
uninterrupted run would."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip.ddp
from ddp_helpers import batch, mlp
from gradzip.comm import run_processes

SPEC = "powersgd:rank=2"
STEPS = 8
CHECKPOINT_EVERY = 3


def _train(rank: int, world: int, folder: str, die_at: int | None, resume: bool) -> torch.Tensor:
    # DDP reorders a bucket's parameters when it rebuilds buckets after the first step, so the
    # resumed run's first step sees another order than the uninterrupted run's step; the
    # engine's fixed tensor order keeps the all-reduced buffers' layout (and so the order in
    # which a ring of three workers adds each element) the same.
    model = DDP(mlp(seed=0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = gradzip.ddp.register(model, SPEC, optimizer=optimizer)
    path = Path(folder) / f"rank{rank}.pt"
    start = 0
    if resume:
        saved = torch.load(path, weights_only=True)
        model.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        state.load_state_dict(saved["gradzip"])
        start = saved["step"]
    for step in range(start, STEPS):
        if die_at is not None and rank == world - 1 and step == die_at:
            os._exit(1)
        x, y = batch(step, rank)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        if (step + 1) % CHECKPOINT_EVERY == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "gradzip": state.state_dict(), "step": step + 1}, path)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _restart(rank: int, world: int, crashed: str, straight: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The restart from the crashed run's checkpoints, then, in the same processes and group
    (saving one launch), the uninterrupted run from scratch. The restart runs first, so it
    sees fresh processes just as after a real crash."""
    torch.set_num_threads(1)
    resumed = _train(rank, world, crashed, None, True)
    return resumed, _train(rank, world, straight, None, False)


def _crash(rank: int, world: int, folder: str) -> torch.Tensor:
    torch.set_num_threads(1)
    return _train(rank, world, folder, 5, False)


@pytest.mark.slow
def test_restart_from_checkpoint_after_a_dead_worker_matches_the_uninterrupted_run(tmp_path: Path) -> None:
    (tmp_path / "straight").mkdir()
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    # Rank 2 dies at step 5: the others fail in their next collective instead of hanging.
    results = run_processes(_crash, 3, str(crashed), timeout=180, return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in results), results
    assert sorted(p.name for p in crashed.iterdir()) == ["rank0.pt", "rank1.pt", "rank2.pt"]
    # Every rank restarts from its own last checkpoint (step 3) and finishes the run; the
    # same processes then run the uninterrupted reference.
    ranks = run_processes(_restart, 3, str(crashed), str(tmp_path / "straight"), timeout=180)
    for rank, (resumed, straight) in enumerate(ranks):
        assert torch.equal(resumed, straight), rank
