"""The runner's DDP stepper skips DDP's broadcast of the model where the replicas are equal.

DDP sends rank 0's parameters and buffers to every rank when it is built: a whole model over
the link before the first step. The runner's replicas come from one seed, so a 24-byte digest
per rank checks them instead, and the broadcast runs only where they differ.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.parallel.distributed as ddp_module
from torch import nn

import shared_launch
from gradzip.train.config import resolve_config
from gradzip.train.runner import RunConfig
from gradzip.train.steppers import DDPStepper

WORLD = 2


class _Task:
    def loss(self, model: nn.Module, batch: Any, carry: Any) -> tuple[torch.Tensor, Any]:
        x, y = batch
        return nn.functional.cross_entropy(model(x), y), carry


def _start(rank: int, world: int, folder: str) -> dict[str, Any]:
    """Build the stepper over equal replicas, then over replicas rank 1 changed (a weight and
    a running mean); count DDP's broadcasts, and return each rank's parameters and buffers as
    built and its gradients after one step."""
    calls = []
    sync = ddp_module._sync_module_states

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return sync(*args, **kwargs)

    ddp_module._sync_module_states = counted
    cfg = resolve_config(RunConfig(task="digits", workers=world, out=folder))
    out: dict[str, Any] = {}
    try:
        for case in ("equal", "differ"):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
            if case == "differ" and rank == 1:
                with torch.no_grad():
                    model[0].weight.add_(1.0)
                    model[1].running_mean.add_(2.0)
            before = len(calls)
            stepper = DDPStepper(model, _Task(), "none", cfg,  # type: ignore[arg-type]
                                 torch.optim.SGD(model.parameters(), lr=0.1),
                                 torch.device("cpu"))
            state = {k: v.clone() for k, v in model.state_dict().items()}  # as built
            batch = (torch.randn(6, 4, generator=torch.Generator().manual_seed(rank)),
                     torch.tensor([0, 1, 0, 1, 1, 0]))
            stepper.step([[batch]], [None])  # each rank its own batch; the hook averages
            out[case] = {"broadcasts": len(calls) - before,
                         "synced_at_start": stepper.synced_at_start, "state": state,
                         "grads": [p.grad.clone() for p in model.parameters()]}
    finally:
        ddp_module._sync_module_states = sync
    return out


shared_launch.register(WORLD, "ddp_stepper_start", _start, with_folder=True, threads=1,
                       timeout=120)


@pytest.mark.slow
def test_ddp_is_built_without_its_broadcast_only_where_the_replicas_are_equal(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    # Launched with the other modules' workers of this world size (see shared_launch).
    ranks = shared_launch.results(WORLD, "ddp_stepper_start", tmp_path_factory)
    equal, differ = ([r[case] for r in ranks] for case in ("equal", "differ"))
    # Equal replicas (one seed): no broadcast, and the replicas and averaged gradients agree.
    assert [r["broadcasts"] for r in equal] == [0, 0]
    assert [r["synced_at_start"] for r in equal] == [False, False]
    # Rank 1 changed its weights and running statistics: DDP's broadcast ran on every rank
    # and made rank 1's replica rank 0's before the first step.
    assert [r["broadcasts"] for r in differ] == [1, 1]
    assert [r["synced_at_start"] for r in differ] == [True, True]
    for case in (equal, differ):
        first, second = case
        assert first["state"].keys() == second["state"].keys()
        assert all(torch.equal(first["state"][k], second["state"][k]) for k in first["state"])
        assert all(torch.equal(a, b) for a, b in zip(first["grads"], second["grads"], strict=True))
