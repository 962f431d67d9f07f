"""A background checkpoint thread reading the asynchronous DDP hook's state while training
runs: every snapshot must be one step's state, whole (never one step's residuals beside the
next step's warm starts or byte counts), and reading must never fail inside a step."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip
from ddp_helpers import TINY_BUCKET_MB, batch, mlp, spawn, trees_equal

STEPS = 40


def _train_with_a_checkpoint_thread(rank: int, world: int, spec: str,
                                    overlap: bool) -> dict[str, Any]:
    model = mlp(sizes=(12, 64, 64, 64, 4))
    ddp = DDP(model, bucket_cap_mb=TINY_BUCKET_MB)  # one bucket per parameter after step 1
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = gradzip.ddp.register(ddp, spec, optimizer=opt, overlap=overlap)
    between: dict[int, Any] = {}  # step -> the state read by the training thread between steps
    seen: list[Any] = []
    errors: list[str] = []
    stop = threading.Event()

    def checkpoints() -> None:
        while not stop.is_set():
            try:
                seen.append(state.state_dict())
                seen.append({"stats": state.stats})
            except Exception as err:  # noqa: BLE001 - recorded and judged by the test
                errors.append(f"{type(err).__name__}: {err}")

    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, rank)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        if step == 1:  # the engine exists: start reading from another thread
            thread = threading.Thread(target=checkpoints)
            thread.start()
        if step >= 1:
            between[int(state.engine.step)] = {"sd": state.state_dict(), "stats": state.stats}
    stop.set()
    thread.join()
    return {"between": between, "seen": seen, "errors": errors}


@pytest.mark.slow
@pytest.mark.parametrize("spec,overlap", [("powersgd:rank=2", True), ("topk:ratio=0.1", False)])
def test_every_snapshot_from_another_thread_is_one_whole_step(
    tmp_path: Path, spec: str, overlap: bool
) -> None:
    (result,) = spawn(_train_with_a_checkpoint_thread, 1, tmp_path, spec, overlap)
    assert result["errors"] == []
    between = result["between"]
    snapshots = [s for s in result["seen"] if "stats" not in s]
    stats = [s["stats"] for s in result["seen"] if "stats" in s]
    assert len(snapshots) >= 5 and len(stats) >= 5  # the reader really ran during training
    torn = []
    for snap in snapshots:
        ref = between.get(snap["step"])
        if ref is not None and not trees_equal(snap, ref["sd"]):
            torn.append(snap["step"])
    for got in stats:
        ref = between.get(got["steps"])
        if ref is not None and got != ref["stats"]:
            torn.append(("stats", got["steps"]))
    assert torn == [], f"{len(torn)} of {len(snapshots) + len(stats)} snapshots mix two steps"
