"""A group of N workers simulated in one process, on a leading tensor axis."""

from __future__ import annotations

import torch

from gradzip._validate import check_int
from gradzip.comm.base import Collective

__all__ = ["SimulatedGroup", "SingleWorker"]


class SimulatedGroup(Collective):
    """N workers in one process: worker ``i`` is index ``i`` of every tensor's first axis.

    Sums add the workers in rank order, one at a time, as a sequential reduction would; the
    accounting is the same as for a real process group of ``workers`` ranks.

    Args:
        workers: number of simulated workers (>= 1).
    """

    simulated = True

    def __init__(self, workers: int) -> None:
        workers = check_int("workers", workers, minimum=1)
        super().__init__(world_size=workers, local_workers=workers, first_rank=0)

    def _sum(self, x: torch.Tensor) -> torch.Tensor:
        total = x[0].clone()
        for i in range(1, x.shape[0]):
            total += x[i]
        return total

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    def _exchange(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1).clone()  # [sender, receiver] -> [receiver, sender]

    def __repr__(self) -> str:
        return f"SimulatedGroup(workers={self.world_size})"


class SingleWorker(Collective):
    """A group of one worker that takes plain gradients (no worker axis): the default when
    ``torch.distributed`` is not initialised. Nothing travels; payload bytes still count what
    would have been sent."""

    def __init__(self) -> None:
        super().__init__(world_size=1, local_workers=1, first_rank=0)

    def _sum(self, x: torch.Tensor) -> torch.Tensor:
        return x[0].clone()

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    def __repr__(self) -> str:
        return "SingleWorker()"
