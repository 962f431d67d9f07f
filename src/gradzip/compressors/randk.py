"""Random-k sparsification with indices shared by every worker."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from gradzip._validate import check_int, check_real
from gradzip.comm.base import Collective
from gradzip.compressors.base import Compressor, Job, StepContext, dense_reduce
from gradzip.ops.flat import split_flat
from gradzip.ops.select import randk_indices

__all__ = ["RandK"]


@dataclass(frozen=True)
class RandK(Compressor):
    """Send a random ``ratio`` fraction of every tensor's entries, the same entries on every
    worker (drawn from a generator seeded by ``(seed, step, name)``), so the values can be
    summed by all-reduce and no index travels.

    Args:
        ratio: fraction of entries sent, in (0, 1].
        seed: seed of the shared index stream (>= 0).

    References:
        Stich et al., "Sparsified SGD with Memory", NeurIPS 2018.
    """

    ratio: float = 0.01
    seed: int = 0
    spec_name: ClassVar[str] = "randk"
    device_decisions: ClassVar[bool] = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "ratio", check_real("ratio", self.ratio, low=0, high=1, low_open=True))
        object.__setattr__(self, "seed", check_int("seed", self.seed, minimum=0))

    def k_for(self, numel: int) -> int:
        return max(1, min(numel, int(self.ratio * numel)))

    def reduce(
        self, jobs: Sequence[Job], state: dict[str, Any], comm: Collective, ctx: StepContext
    ) -> None:
        sparse = [j for j in jobs if self.k_for(j.numel) < j.numel]
        dense_reduce([j for j in jobs if self.k_for(j.numel) >= j.numel], comm)
        if not sparse:
            return
        picks = [
            randk_indices(j.numel, self.k_for(j.numel), self.seed, ctx.step, j.name,
                          device=j.tensor.device)
            for j in sparse
        ]
        flats = [j.tensor.reshape(comm.local_workers, -1) for j in sparse]
        message = torch.cat([f.index_select(1, idx) for f, idx in zip(flats, picks, strict=True)], dim=1)
        total = comm.all_reduce(message) / comm.world_size
        sizes = [idx.numel() for idx in picks]
        for job, idx, avg, own in zip(
            sparse, picks, split_flat(total, sizes), split_flat(message, sizes), strict=True
        ):
            dense_avg = torch.zeros(job.numel, dtype=torch.float32, device=job.tensor.device)
            job.averaged = dense_avg.index_copy_(0, idx, avg).reshape(job.shape)
            local = torch.zeros(comm.local_workers, job.numel, dtype=torch.float32,
                                device=job.tensor.device)
            job.decoded = local.index_copy_(1, idx, own).reshape(job.tensor.shape)
