"""Random-k sparsification with indices shared by every worker."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from gradzip._validate import check_int, check_real
from gradzip.comm.base import Collective
from gradzip.compressors.base import Compressor, Job, StepContext, dense_reduce
from gradzip.ops.flat import to_device
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
        # Indices drawn per tensor on the host (each from its own keyed stream: the same
        # entries as ever), shifted into one flat space and moved once, so the device work is
        # a few ops per call whatever the number of tensors.
        numels = [j.numel for j in sparse]
        picks = [randk_indices(n, self.k_for(n), self.seed, ctx.step, j.name)
                 for n, j in zip(numels, sparse, strict=True)]
        shifted, offset = [], 0
        for n, idx in zip(numels, picks, strict=True):
            shifted.append(idx + offset if offset else idx)
            offset += n
        device = sparse[0].tensor.device
        where = to_device(torch.cat(shifted), device)
        flat = torch.cat([j.tensor.reshape(comm.local_workers, -1) for j in sparse], dim=1)
        message = flat.index_select(1, where)
        total = comm.all_reduce(message) / comm.world_size
        dense_avg = torch.zeros(offset, dtype=torch.float32, device=device).index_copy_(0, where, total)
        local = torch.zeros(comm.local_workers, offset, dtype=torch.float32, device=device)
        local.index_copy_(1, where, message)
        for job, avg, own in zip(sparse, torch.split(dense_avg, numels),
                                 torch.split(local, numels, dim=1), strict=True):
            job.averaged = avg.reshape(job.shape)
            job.decoded = own.reshape(job.tensor.shape)
