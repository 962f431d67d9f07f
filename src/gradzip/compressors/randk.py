"""Random-k sparsification with indices shared by every worker."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from gradzip._validate import check_int, check_real
from gradzip.comm.base import Collective
from gradzip.compressors.base import (
    Compressor,
    Job,
    SegmentPlan,
    StepContext,
    dense_reduce,
    dense_tail,
    gathered_or_dense_plan,
    give_averages,
    job_rows,
)
from gradzip.ops.flat import cat_rows
from gradzip.ops.random import stable_hash
from gradzip.ops.segmented import (
    MAX_ENTRIES,
    SegmentLayout,
    pieces,
    segment_keys,
    segment_layout,
    strided_random,
)

__all__ = ["RandK"]


@dataclass(frozen=True)
class RandK(Compressor):
    """Send a random ``ratio`` fraction of every tensor's entries, the same entries on every
    worker (drawn from a hash keyed by ``(seed, step, name)``), so the values can be summed
    by all-reduce and no index travels.

    A tensor of ``n`` entries sending ``k`` is cut into ``k`` strides of ``floor(n / k)`` or
    ``ceil(n / k)`` consecutive entries, and one entry is drawn uniformly in each
    (:func:`~gradzip.ops.segmented.strided_random`): ``k`` distinct entries, each sent with
    probability ``1 / len(stride)`` (exactly ``k / n`` where ``k`` divides ``n``), as in a
    uniform ``k``-subset; unlike one, two neighbours in a stride are never sent together.
    The whole call's draw is a few integer ops on the device, with nothing read on the host.

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
        sparse, dense = [], []
        for job in jobs:
            (sparse if self.k_for(job.numel) < job.numel else dense).append(job)
        dense_reduce(dense, comm)
        # Calls whose flat positions would pass int32 (the layout's bound) go in pieces; a
        # tensor's draw depends on its own key and shape only, so pieces change nothing.
        for start, stop in pieces([job.numel for job in sparse]):
            self._reduce_call(sparse[start:stop], comm, ctx)

    def _reduce_call(self, sparse: Sequence[Job], comm: Collective, ctx: StepContext) -> None:
        device = sparse[0].tensor.device
        numels = [j.numel for j in sparse]
        layout = segment_layout(numels, [self.k_for(n) for n in numels], device)
        # A fresh buffer, which becomes the residuals (the sent entries zeroed).
        flat = cat_rows([j.tensor for j in sparse], comm.local_workers)
        averaged = torch.empty(layout.total, dtype=torch.float32, device=device)
        self._sent(flat, layout, [j.name for j in sparse], averaged, comm, ctx)
        # Views made in one call each, not a slice per tensor.
        give_averages(sparse, averaged)
        for job, rest in zip(sparse, job_rows(sparse, flat), strict=True):
            job.keep(rest)

    def _sent(self, flat: torch.Tensor, layout: SegmentLayout, names: Sequence[str],
              averaged: torch.Tensor, comm: Collective, ctx: StepContext) -> None:
        """The drawn entries of the tensors laid end to end in the rows of ``flat[L, total]``
        summed by one all-reduce: their average written into ``averaged[total]`` (zero
        elsewhere), and ``flat`` left with the residuals (the sent entries zeroed)."""
        # Each tensor's key from (seed, step, name) only: every worker draws the same entries
        # (so values can be summed), a resumed run draws what the uninterrupted one drew, and
        # a tensor's draw does not depend on the tensors sharing its call. The draw itself is
        # a few integer ops on the device for the whole call.
        keys = segment_keys([stable_hash(self.seed, ctx.step, name) for name in names],
                            flat.device)
        where = strided_random(keys, layout)
        message = flat.index_select(1, where)
        total = comm.all_reduce(message) / comm.world_size
        averaged.zero_().index_copy_(0, where, total.reshape(-1))
        # Sent entries are sent unchanged: the residual is the tensor with them zeroed,
        # ``tensor - decoded`` bit for bit for finite entries.
        flat.index_fill_(1, where, 0.0)

    def segment_plan(
        self, names: Sequence[str], sizes: Sequence[int], world_size: int, device: torch.device,
        shapes: Sequence[torch.Size] | None = None, *, state: Mapping[str, Any] | None = None,
    ) -> SegmentPlan | None:
        """The row's order (the tensors that send a draw, then those sent whole, each kind in
        the engine's order, as :meth:`reduce` groups them), their layout and names, where
        their flat positions fit in one piece (see
        :meth:`~gradzip.compressors.base.Compressor.segment_plan`); else ``None``."""
        forms = ["allgather" if self.k_for(n) < n else "dense" for n in sizes]

        def drawn(picked: list[int]) -> tuple[SegmentLayout, list[str]]:
            numels = [sizes[i] for i in picked]
            return (segment_layout(numels, [self.k_for(n) for n in numels], device),
                    [names[i] for i in picked])

        return gathered_or_dense_plan(forms, sizes, drawn, most=MAX_ENTRIES)

    def reduce_segments(
        self, flat: torch.Tensor, plan: SegmentPlan, state: dict[str, Any], comm: Collective,
        ctx: StepContext, raw: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`reduce` on tensors already laid end to end (see
        :meth:`~gradzip.compressors.base.Compressor.reduce_segments`): the whole tensors'
        all-reduce first, then the drawn entries'; the same averages."""
        drawn, count = plan.data
        average = dense_tail(flat, count, comm)
        if drawn is not None:
            layout, names = drawn
            self._sent(flat[:, :count], layout, names, average[:count], comm, ctx)
        return average
