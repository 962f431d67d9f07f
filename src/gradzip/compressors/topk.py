"""Top-k sparsification: each tensor's largest entries by magnitude."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from gradzip._validate import check_real
from gradzip.comm.base import Collective
from gradzip.compressors.base import Compressor, Job, StepContext, dense_reduce, sparse_pays
from gradzip.compressors.sparse import gather_full, index_bytes
from gradzip.ops.select import topk_abs

__all__ = ["TopK"]


@dataclass(frozen=True)
class TopK(Compressor):
    """Keep the ``ratio`` fraction of largest-magnitude entries of every tensor (at least one).

    The message is the kept values (fp32) and their indices (int32 where they fit), all-gathered
    since different workers keep different entries. A tensor for which that costs more than a
    dense all-reduce (``k`` above about ``numel / W``) is sent dense instead. Selection is exact.

    Args:
        ratio: fraction of entries kept, in (0, 1].

    References:
        Aji and Heafield, "Sparse Communication for Distributed Gradient Descent", 2017;
        Stich et al., "Sparsified SGD with Memory", NeurIPS 2018.
    """

    ratio: float = 0.01
    spec_name: ClassVar[str] = "topk"
    device_decisions: ClassVar[bool] = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "ratio", check_real("ratio", self.ratio, low=0, high=1, low_open=True))

    def k_for(self, numel: int) -> int:
        """Entries kept in a tensor of ``numel`` entries."""
        return max(1, min(numel, int(self.ratio * numel)))

    def report(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """The configured density (tensors sent dense are not counted apart)."""
        return {"density": self.ratio}

    def reduce(
        self, jobs: Sequence[Job], state: dict[str, Any], comm: Collective, ctx: StepContext
    ) -> None:
        sparse, dense = [], []
        for job in jobs:
            k = self.k_for(job.numel)
            pays = sparse_pays(job.numel, k, 4 + index_bytes(job.numel), comm)
            (sparse if pays else dense).append(job)
        dense_reduce(dense, comm)
        if not sparse:
            return
        workers = comm.local_workers
        # Tensors of one size share k: one selection over all their rows (each row's
        # selection is the one it would get alone), so the work grows with the number of
        # distinct sizes, not of tensors.
        groups: dict[int, list[int]] = {}
        for i, job in enumerate(sparse):
            groups.setdefault(job.numel, []).append(i)
        values: list[torch.Tensor] = [torch.empty(0)] * len(sparse)
        indices: list[torch.Tensor] = [torch.empty(0)] * len(sparse)
        for numel, members in groups.items():
            parts = [sparse[i].tensor.reshape(workers, numel) for i in members]
            rows = parts[0] if len(parts) == 1 else torch.cat(parts)  # one tensor: no copy
            val, idx = topk_abs(rows, self.k_for(numel))
            for g, i in enumerate(members):
                values[i] = val[g * workers : (g + 1) * workers]
                indices[i] = idx[g * workers : (g + 1) * workers]
        gather_full(sparse, torch.cat(values, dim=1), torch.cat(indices, dim=1),
                    [self.k_for(job.numel) for job in sparse], comm)
