"""The small model, batches and sharding shared by the FSDP2 tests (HSDP, the compressed
reduce-scatter and the sharded outer loop)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

__all__ = ["Net", "batch", "refusal", "sharded"]


class Net(nn.Module):
    """A per-feature scale (a parameter of the root group), then a ReLU MLP.

    ``nan_to_num`` keeps a NaN of the input out of the forward pass, so it reaches one
    gradient only: the scale's entry of that feature, which lives in one shard. (On finite
    values it changes nothing, the gradient through it included.) With one output the last
    layer has one row, so the second shard of its weight and bias is empty.
    """

    def __init__(self, out: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(12))
        self.fc1 = nn.Linear(12, 32)
        self.fc2 = nn.Linear(32, 16)
        self.fc3 = nn.Linear(16, out)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                fan_in = p.shape[1] if p.dim() > 1 else p.shape[0]
                p.copy_(torch.randn(p.shape, generator=gen) / fan_in**0.5)
            self.scale.add_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nan_to_num(x * self.scale, nan=0.0)
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(h)))))


def batch(step: int, rank: int, out: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of step ``step``: 8 inputs of 12 features and their targets."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 12, generator=gen), torch.randn(8, out, generator=gen)


def sharded(mesh: Any, out: int = 3) -> Net:
    """A :class:`Net` with each layer and the root ``fully_shard``-ed on ``mesh``."""
    model = Net(out)
    for layer in (model.fc1, model.fc2, model.fc3):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def refusal(fn: Any, *args: Any, **kwargs: Any) -> str:
    """What ``fn(*args, **kwargs)`` refuses, as ``"TypeError: ..."`` or ``"ValueError: ..."``;
    ``"accepted"`` where it raises nothing."""
    try:
        fn(*args, **kwargs)
    except (TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted"
