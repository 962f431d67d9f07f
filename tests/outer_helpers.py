"""Helpers of the outer-loop tests: a tiny model, deterministic data, and the same run in a
simulated group or in one process of a real group."""

from __future__ import annotations

import io
from typing import Any

import torch
from torch import nn

import gradzip


def make_model() -> nn.Module:
    """A small MLP with fixed initial parameters (no global RNG)."""
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.4 * torch.randn(p.shape, generator=gen))
    return model


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker ``rank``'s batch at inner step ``step`` (0-based)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 6, generator=gen)
    return x, torch.sin(x[:, :3] * (1 + rank))


def inner_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    x, y = batch(step, rank)
    loss = (model(x) - y).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def make_inner(model: nn.Module, kind: str = "sgd") -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    return torch.optim.SGD(model.parameters(), lr=0.05)


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def run_simulated(
    workers: int, steps: int, spec: str, inner: str = "sgd", **kwargs: Any
) -> tuple[list[nn.Module], gradzip.Outer]:
    """``steps`` inner steps of ``workers`` simulated workers with an Outer around them."""
    models = [make_model() for _ in range(workers)]
    opts = [make_inner(m, inner) for m in models]
    outer = gradzip.Outer(models, spec, collective=gradzip.SimulatedGroup(workers), **kwargs)
    for step in range(steps):
        for rank, (model, opt) in enumerate(zip(models, opts, strict=True)):
            inner_step(model, opt, step, rank)
        outer.step()
    return models, outer


def run_rank(rank: int, world: int, cases: list[tuple[int, str, str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """In a process of a real group: each case ``(steps, spec, inner, kwargs)`` run on this
    worker; its final parameters, the Outer's stats, then its ``consensus()`` and the stats
    after it."""
    torch.set_num_threads(1)
    out = []
    for steps, spec, inner, kwargs in cases:
        model = make_model()
        opt = make_inner(model, inner)
        outer = gradzip.Outer(model, spec, **kwargs)
        for step in range(steps):
            inner_step(model, opt, step, rank)
            outer.step()
        stats = outer.stats
        mean = outer.consensus()
        out.append({"params": params_of(model), "stats": stats, "consensus": mean,
                    "stats_after": outer.stats})
    return out


def round_trip(obj: Any) -> Any:
    """``obj`` through ``torch.save`` / ``torch.load`` (what a checkpoint file does)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)
