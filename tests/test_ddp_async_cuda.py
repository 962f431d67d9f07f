"""The asynchronous DDP hook on CUDA (skipped without a GPU).

On CUDA the hook's work runs on the communication thread's own stream, after an event of
the autograd stream, and DDP's consumer waits on the stream the future was completed on.
Any missing wait shows up as averages that differ from the synchronous hook's, or replicas
that drift apart. Two processes share one GPU over gloo (NCCL refuses two ranks on one
device); one process runs NCCL, where compressors that decide on the device run inline in
the hook (no thread) even with ``overlap=True``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip.ddp
from ddp_helpers import TINY_BUCKET_MB, batch, flat_params, init_, replicas_identical, spawn
from test_ddp_async import MODES, SPECS, chain

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BUCKET_COUNTS = (1, 5, 16)
WIDTH = 1024


def wide(layers: int = 6) -> nn.Sequential:
    """Large enough that kernels queue up behind each other: a missing stream wait races."""
    model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())])
    init_(model, 7)
    return model


def _wide_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1_000 * step + rank)
    return torch.randn(256, WIDTH, generator=gen), torch.randn(256, WIDTH, generator=gen)


def _train(rank: int, spec: str, n: int, kwargs: dict[str, Any], device: torch.device,
           steps: int = 3) -> dict[str, Any]:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = (chain(n) if n else wide()).to(device)
    ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None,
              bucket_cap_mb=TINY_BUCKET_MB if n else 4.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = gradzip.ddp.register(ddp, spec, optimizer=opt, **kwargs)
    identical = []
    for step in range(steps):
        x, y = (t.to(device) for t in (batch(step, rank) if n else _wide_batch(step, rank)))
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        identical.append(replicas_identical(model) if torch.distributed.get_world_size() > 1
                         else True)
    saved = state.state_dict()  # read right after the step: waits for the thread's stream
    return {"params": flat_params(model).cpu(), "stats": state.stats,
            "residuals": {k: v.cpu() for k, v in saved["residuals"].items()},
            "identical": identical, "inline": state._inline}


def cuda_group(rank: int, world: int, specs: tuple[str, ...], device: str = "cuda:0") -> dict[Any, Any]:
    """Every spec with 1, 5 and 16 buckets of a small chain, and with a wide model (``n = 0``:
    6 layers of 1024 x 1024, one bucket per layer)."""
    out = {}
    for spec in specs:
        for n in (*BUCKET_COUNTS, 0):
            runs = {mode: _train(rank, spec, n, kwargs, torch.device(device))
                    for mode, kwargs in MODES.items()}
            a, s = runs["async"], runs["sync"]
            out[(spec, n)] = {
                "params": torch.equal(a["params"], s["params"]),
                "stats": a["stats"] == s["stats"],
                "residuals": a["residuals"].keys() == s["residuals"].keys() and all(
                    torch.equal(a["residuals"][k], s["residuals"][k]) for k in a["residuals"]),
                "identical": all(a["identical"]),
            }
    return out


def _check(results: list[dict[Any, Any]]) -> None:
    for result in results:
        for key, run in result.items():
            assert run == {"params": True, "stats": True, "residuals": True, "identical": True}, key


@pytest.mark.slow
def test_two_ranks_on_one_gpu_over_gloo(tmp_path: Path) -> None:
    specs = ("none", "fp16", "topk:ratio=0.1", "powersgd:rank=2", "threshold:budget=0.05")
    _check(spawn(cuda_group, 2, tmp_path, specs, timeout=400))


@pytest.mark.slow
def test_one_rank_over_nccl(tmp_path: Path) -> None:
    _check(spawn(cuda_group, 1, tmp_path, SPECS, timeout=400, backend="nccl"))


def nccl_inline(rank: int, world: int, specs: tuple[str, ...]) -> dict[str, Any]:
    """Per spec: whether ``overlap=True`` ran inline, and gave the synchronous hook's bits."""
    out = {}
    for spec in specs:
        runs = {mode: _train(rank, spec, 5, kwargs, torch.device("cuda:0"))
                for mode, kwargs in MODES.items()}
        a, s = runs["async"], runs["sync"]
        out[spec] = {"inline": a["inline"], "params": torch.equal(a["params"], s["params"]),
                     "stats": a["stats"] == s["stats"]}
    return out


@pytest.mark.slow
def test_nccl_runs_device_deciding_compressors_inline(tmp_path: Path) -> None:
    inline = ("none", "topk:ratio=0.1", "qsgd:levels=4", "sign", "randk:ratio=0.1")
    threaded = ("threshold:budget=0.05",)
    (result,) = spawn(nccl_inline, 1, tmp_path, inline + threaded, timeout=400, backend="nccl")
    for spec in inline:
        assert result[spec] == {"inline": True, "params": True, "stats": True}, spec
    for spec in threaded:
        assert result[spec] == {"inline": False, "params": True, "stats": True}, spec
