"""Shared-support Top-k: one set of blocks for every worker, chosen from summed block scores."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from gradzip._validate import check_int, check_real
from gradzip.comm.base import Collective, ordered_wire_bytes
from gradzip.compressors.base import Compressor, Job, StepContext, give_averages, job_rows
from gradzip.ops.blocks import block_layout, block_positions, block_scores, top_blocks
from gradzip.ops.flat import cat_rows

__all__ = ["SharedTopK"]


@dataclass(frozen=True)
class SharedTopK(Compressor):
    """Send the entries of each tensor's best blocks, the same blocks on every worker, so the
    values are summed by all-reduce and no index travels.

    Each tensor is cut into blocks of ``block`` consecutive entries (the last one shorter).
    Every worker scores every block by the sum of squares of its error-compensated entries,
    one all-reduce sums the scores over the group (4 bytes a block), and every worker takes
    the same ``m`` blocks of each tensor with the highest summed score (ties to the lower
    block), ``m`` the nearest whole number of blocks to ``ratio * numel`` entries (at least
    one). A second all-reduce sums those blocks' entries (fp32, ``m * block`` a tensor; a
    shorter last block padded with zeros; the tensors sent dense ride in the same message):
    the average is exact on the chosen blocks and zero elsewhere, and every worker keeps
    everything outside them in its error-feedback residual. Both all-reduces are
    :meth:`~gradzip.comm.base.Collective.all_reduce_ordered` (a reduce-scatter adding the
    workers in rank order, then an all-gather), so a process group gives the simulator's bits.

    The summed score is the right one for a shared support: a worker's residual is its
    compensated tensor with the chosen blocks zeroed, so the residuals' total squared norm over
    the group is the compensated tensors' minus the chosen blocks' summed scores; taking the
    highest scores minimises it (the total error of Sahu et al. 2021, over one support).

    Bytes per worker per tensor of ``n`` entries in ``b = ceil(n / block)`` blocks: two
    all-reduces, of ``b`` and of ``m block`` fp32 values, ``2 (W-1) * 4 (ceil(b / W) +
    ceil(m block / W))`` on the wire, a ring's: flat in ``W``, below a dense ring's when sent
    (a tensor with ``b + m block >= n`` goes dense: shapes and configuration decide, the same
    on every worker). At ``ratio=0.01`` and ``block=256`` a 256 x 256 tensor sends 256 scores
    and 768 values: 1.6 % of a dense ring's bytes.

    What it changes against Top-k: every worker sends the same entries (the blocks where the
    group's compensated gradients hold the most energy), not each its own largest; an entry
    large on one worker only waits in that worker's residual until its block's summed score
    ranks, and entries travel by whole blocks.

    Args:
        ratio: fraction of entries sent, in (0, 1].
        block: entries per block, in [2, 1048576]: larger blocks cost fewer score bytes
            (``1 / block`` of the entries) and choose more coarsely.

    References:
        Sahu et al., "Rethinking gradient sparsification as total error minimization",
        NeurIPS 2021; Stich et al., "Sparsified SGD with Memory", NeurIPS 2018.
    """

    ratio: float = 0.01
    block: int = 256
    spec_name: ClassVar[str] = "sharedtopk"
    device_decisions: ClassVar[bool] = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "ratio", check_real("ratio", self.ratio, low=0, high=1, low_open=True))
        object.__setattr__(self, "block", check_int("block", self.block, minimum=2, maximum=1 << 20))

    def blocks_for(self, numel: int) -> tuple[int, int]:
        """``(blocks, kept)``: the blocks of a tensor of ``numel`` entries and how many of them
        it sends (the nearest whole number to ``ratio * numel / block``, at least one)."""
        blocks = -(-numel // self.block)
        entries = max(1, int(self.ratio * numel))
        return blocks, max(1, min(blocks, (entries + self.block // 2) // self.block))

    def sends_sparse(self, numel: int) -> bool:
        """Whether a tensor of ``numel`` entries travels as scores and blocks (fewer bytes than
        its dense fp32 all-reduce), else dense: shapes and configuration only."""
        blocks, kept = self.blocks_for(numel)
        return numel > 0 and blocks + kept * self.block < numel

    def wire_bytes(self, numel: int, world: int) -> int:
        """Wire bytes one worker sends for a tensor of ``numel`` entries among ``world`` workers
        alone in its call (a call sums its tensors' scores, and its values with its dense
        tensors, in one exchange each, whose parts round up once for the call)."""
        if not self.sends_sparse(numel):
            return ordered_wire_bytes(numel, 4, world)
        blocks, kept = self.blocks_for(numel)
        return ordered_wire_bytes(blocks, 4, world) + ordered_wire_bytes(kept * self.block, 4, world)

    def report(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """The configured density (tensors sent dense are not counted apart)."""
        return {"density": self.ratio}

    def reduce(
        self, jobs: Sequence[Job], state: dict[str, Any], comm: Collective, ctx: StepContext
    ) -> None:
        # Per tensor, from sizes and configuration only: the same form on every worker, and a
        # tensor's form does not depend on which tensors share the call.
        if not jobs:
            return
        sparse = [j for j in jobs if self.sends_sparse(j.numel)]
        dense = [j for j in jobs if not self.sends_sparse(j.numel)]
        workers, world = comm.local_workers, comm.world_size
        # Every sum adds the workers in rank order (all_reduce_ordered), so a process group
        # gives the simulator's bits whatever the backend's all-reduce order.
        if not sparse:
            _finish_dense(dense, comm.all_reduce_ordered(_rows(dense, workers)) / world)
            return
        layout = block_layout([j.numel for j in sparse], self.block,
                              [self.blocks_for(j.numel)[1] for j in sparse], sparse[0].tensor.device)
        # A fresh buffer with one padding slot at the end (it becomes the residuals).
        flat = cat_rows([*(j.tensor for j in sparse), sparse[0].tensor.new_zeros(workers, 1)],
                        workers)
        # The blocks must be the same on every worker (their entries are summed position by
        # position), so they are chosen from the scores summed over the group: identical
        # everywhere, and ties broken by block order, never by a worker's own values.
        scores = comm.all_reduce_ordered(block_scores(flat[:, :-1], layout))
        where = block_positions(top_blocks(scores, layout), layout)
        # The chosen entries, then the dense tensors whole: one message.
        message = flat.index_select(1, where)
        if dense:
            message = torch.cat([message, _rows(dense, workers)], dim=1)
        total = comm.all_reduce_ordered(message) / world
        _finish_dense(dense, total[where.numel():])
        averaged = torch.zeros(layout.total + 1, dtype=torch.float32, device=flat.device)
        # Each chosen entry appears once in ``where``; the padding slot (repeated, zeros) is
        # dropped.
        averaged.index_add_(0, where, total[: where.numel()])
        # Sent entries are sent unchanged: the residual is the tensor with them zeroed.
        flat.index_fill_(1, where, 0.0)
        give_averages(sparse, averaged[:-1])
        for job, rest in zip(sparse, job_rows(sparse, flat[:, :-1]), strict=True):
            job.keep(rest)


def _rows(jobs: Sequence[Job], workers: int) -> torch.Tensor:
    """The jobs' tensors side by side, ``[L, entries]`` (fp32)."""
    return torch.cat([j.tensor.reshape(workers, -1).to(torch.float32) for j in jobs], dim=1)


def _finish_dense(jobs: Sequence[Job], averaged: torch.Tensor) -> None:
    """Give the jobs sent dense their slices of ``averaged``; each sent its tensor whole."""
    give_averages(jobs, averaged)
    for job in jobs:
        job.decoded = job.tensor
