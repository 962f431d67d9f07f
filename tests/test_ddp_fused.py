"""``fuse_buckets``: a step's DDP buckets averaged in one engine call, in real gloo groups.

The reference is the simulator's one engine call per step over every gradient
(``train_simulated``): with a bucket per parameter, the fused hook must train the same
parameters, with the same bytes, as that call (the per-bucket hook sends one header per bucket
and, for a compressor that selects per call, other messages). With one DDP bucket it is the
plain hook, bit for bit. Buckets of two dtypes cannot share one buffer: each is then averaged
apart, as the plain hook does.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import gradzip.ddp
import shared_launch
from ddp_helpers import ONE_BUCKET_MB, TINY_BUCKET_MB, batch, train_ddp, train_simulated

WORLD = 2
SPECS = ("none", "topk:ratio=0.1", "powersgd:rank=2", "sign", "qsgd")
STEPS = 4


def _summary(run: dict[str, Any]) -> dict[str, Any]:
    state = run["state"]
    fused = state._fused._fused if state._fused is not None else None
    return {"params": run["params"], "identical": run["identical"], "stats": run["stats"],
            "buckets": len(fused[0]) if fused is not None else None}


class _Mixed(nn.Module):
    """A float32 layer, then a float64 one: DDP puts them in buckets of their own dtype."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(12, 16)
        self.b = nn.Linear(16, 4).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)).double()).float()


def _mixed(rank: int, fuse: bool) -> torch.Tensor:
    model = _Mixed()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=TINY_BUCKET_MB)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gradzip.ddp.register(ddp, "topk:ratio=0.2", optimizer=opt, fuse_buckets=fuse)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, rank)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return torch.cat([p.detach().double().reshape(-1) for p in model.parameters()])


def fused_group(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for spec in SPECS:
        out[spec] = _summary(train_ddp(rank, spec=spec, steps=STEPS,
                                       bucket_cap_mb=TINY_BUCKET_MB,
                                       hook_kwargs={"fuse_buckets": True}))
        out[f"{spec}-sim"] = train_simulated(spec, steps=STEPS) if rank == 0 else None
    for fuse in (False, True):
        out[f"one-{fuse}"] = _summary(train_ddp(rank, spec="topk:ratio=0.1", steps=STEPS,
                                                bucket_cap_mb=ONE_BUCKET_MB,
                                                hook_kwargs={"fuse_buckets": fuse}))
    # Two micro-batches per step, the first under no_sync(): the hook sees the second only.
    out["accum"] = _summary(train_ddp(rank, spec="powersgd:rank=2", steps=3,
                                      bucket_cap_mb=TINY_BUCKET_MB, micro_batches=2,
                                      hook_kwargs={"fuse_buckets": True}))
    out["accum-sim"] = (train_simulated("powersgd:rank=2", steps=3, micro_batches=2)
                        if rank == 0 else None)
    out["mixed"] = {fuse: _mixed(rank, fuse) for fuse in (False, True)}
    return out


shared_launch.register(WORLD, "ddp_fused", fused_group, timeout=300, threads=1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    # Launched with the other modules' workers of this world size (see shared_launch).
    return shared_launch.results(WORLD, "ddp_fused", tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS)
def test_one_call_per_step_equals_the_simulator(runs: list[dict[str, Any]], spec: str) -> None:
    real, sim = runs[0][spec], runs[0][f"{spec}-sim"]
    # A bucket per parameter (6 of them), all in one call: the simulator's single call.
    assert real["buckets"] == 6
    assert torch.equal(real["params"], sim["params"])
    assert all(real["identical"]) and real["stats"]["steps"] == STEPS
    for key in ("payload_bytes", "wire_bytes"):
        assert real["stats"][key] == sim["stats"][key][0], key
    # Both ranks end alike.
    assert torch.equal(runs[1][spec]["params"], real["params"])


@pytest.mark.slow
def test_one_bucket_is_the_plain_hook(runs: list[dict[str, Any]]) -> None:
    plain, fused = runs[0]["one-False"], runs[0]["one-True"]
    assert fused["buckets"] == 1 and plain["buckets"] is None
    assert torch.equal(plain["params"], fused["params"])
    assert plain["stats"] == fused["stats"]


@pytest.mark.slow
def test_gradient_accumulation_counts_optimizer_steps(runs: list[dict[str, Any]]) -> None:
    real, sim = runs[0]["accum"], runs[0]["accum-sim"]
    assert real["stats"]["steps"] == 3 and all(real["identical"])
    assert torch.equal(real["params"], sim["params"])


@pytest.mark.slow
def test_buckets_of_two_dtypes_are_averaged_apart(runs: list[dict[str, Any]]) -> None:
    for rank in range(WORLD):
        mixed = runs[rank]["mixed"]
        assert torch.equal(mixed[True], mixed[False])
    assert torch.equal(runs[0]["mixed"][True], runs[1]["mixed"][True])


def test_fuse_buckets_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="`fuse_buckets` must be a bool, got"):
        gradzip.ddp.GradzipHookState(nn.Linear(2, 2).named_parameters(), "none",
                                     fuse_buckets=1)  # type: ignore[arg-type]
    state = gradzip.ddp.GradzipHookState(nn.Linear(2, 2).named_parameters(), "none",
                                         fuse_buckets=True)
    assert "fuse_buckets=True" in repr(state)
