"""Top-k sparsification: each tensor's largest entries by magnitude."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from gradzip._validate import check_choice, check_int, check_real
from gradzip.comm.base import Collective
from gradzip.compressors.base import (
    Compressor,
    Job,
    SegmentPlan,
    StepContext,
    dense_reduce,
    dense_tail,
)
from gradzip.compressors.sharded_sparse import (
    EXCHANGES,
    by_form,
    choose_exchange,
    outside_own_part,
    sharded_reduce,
)
from gradzip.compressors.sparse import (
    exchange_positions,
    gather_flat,
    gather_full,
    index_bytes,
    positions_plan,
    select_positions,
)
from gradzip.ops.flat import cat_rows
from gradzip.ops.segmented import MAX_ENTRIES, segment_layout
from gradzip.ops.select import topk_abs

__all__ = ["TopK"]


@dataclass(frozen=True)
class TopK(Compressor):
    """Keep the ``ratio`` fraction of largest-magnitude entries of every tensor (at least one).

    The message is the kept values (fp32) and their indices (int32 where they fit), all-gathered
    since different workers keep different entries. A tensor for which that costs more than a
    dense all-reduce (``k`` above about ``numel / W``) is sent dense instead. Selection is exact:
    on a GPU one sort covers the whole call (:func:`~gradzip.ops.segmented.segmented_topk`,
    ties to the lower position), on the CPU one narrowed selection per distinct tensor size;
    indices travel as int32 positions in the call's tensors laid end to end.

    Where it costs fewer wire bytes (from about three workers on), a tensor travels by the
    sharded exchange instead (:mod:`gradzip.compressors.sharded_sparse`): each worker sends each
    part's owner its top-k entries (chosen outside its own part) in that part (fixed
    capacity, overflow stays in its residual), owners pass on the top ``owner_keep * k / W``
    of their part's sum and all-gather them, so bytes per worker stay about
    ``(2 + owner_keep) k`` entries whatever ``W``.

    Args:
        ratio: fraction of entries kept, in (0, 1].
        exchange: ``"auto"`` (the fewest wire bytes of dense, all-gather and sharded, per
            tensor), ``"allgather"`` or ``"sharded"`` (see :data:`~gradzip.compressors.sharded_sparse.EXCHANGES`).
        owner_keep: in the sharded exchange, what each part's owner passes on, as a multiple
            of ``k / W`` (an integer >= 1): more keeps the average closer to the all-gather's
            (which delivers up to ``W k`` entries), each unit costing ``k`` entries more per
            worker.

    References:
        Aji and Heafield, "Sparse Communication for Distributed Gradient Descent", 2017;
        Stich et al., "Sparsified SGD with Memory", NeurIPS 2018.
    """

    ratio: float = 0.01
    exchange: str = "auto"
    owner_keep: int = 4
    spec_name: ClassVar[str] = "topk"
    device_decisions: ClassVar[bool] = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "ratio", check_real("ratio", self.ratio, low=0, high=1, low_open=True))
        object.__setattr__(self, "exchange", check_choice("exchange", self.exchange, EXCHANGES))
        object.__setattr__(self, "owner_keep", check_int("owner_keep", self.owner_keep, minimum=1))

    def k_for(self, numel: int) -> int:
        """Entries kept in a tensor of ``numel`` entries."""
        return max(1, min(numel, int(self.ratio * numel)))

    def exchange_for(self, numel: int, world: int) -> str:
        """How a tensor of ``numel`` entries travels among ``world`` workers: ``"dense"``,
        ``"allgather"`` or ``"sharded"`` (shapes and configuration only: every worker agrees)."""
        k = self.k_for(numel)
        return choose_exchange(self.exchange, numel, world, k, k * (4 + index_bytes(numel)),
                               self.owner_keep)

    def report(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """The configured density (tensors sent dense are not counted apart)."""
        return {"density": self.ratio}

    def reduce(
        self, jobs: Sequence[Job], state: dict[str, Any], comm: Collective, ctx: StepContext
    ) -> None:
        # Per tensor, from sizes only: the same form on every worker, and a tensor's form
        # does not depend on which tensors share the call.
        forms = by_form(jobs, lambda numel: self.exchange_for(numel, comm.world_size))
        dense_reduce(forms["dense"], comm)
        self._reduce_gathered(forms["allgather"], comm)
        # Last: an all-to-all cannot carry the engine's call header, so a call whose first
        # collective is the sharded exchange's sends the header apart.
        self._reduce_sharded(forms["sharded"], comm)

    def segment_plan(
        self, names: Sequence[str], sizes: Sequence[int], world_size: int, device: torch.device,
        shapes: Sequence[torch.Size] | None = None, *, state: Mapping[str, Any] | None = None,
    ) -> SegmentPlan | None:
        """The row's order (the all-gathered tensors, then those sent dense, each kind in
        the engine's order, as :meth:`reduce` groups them) and the selection's layout, where
        no tensor takes the sharded exchange and flat positions fit (see
        :meth:`Compressor.segment_plan`); else ``None``."""
        return positions_plan([self.exchange_for(n, world_size) for n in sizes], sizes,
                              self.k_for, device)

    def reduce_segments(
        self, flat: torch.Tensor, plan: SegmentPlan, state: dict[str, Any], comm: Collective,
        ctx: StepContext, raw: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`reduce` on tensors already laid end to end (see
        :meth:`Compressor.reduce_segments`): the dense tensors' all-reduce first, then the
        one selection and all-gather of the others; the same messages and averages."""
        layout, count = plan.data
        average = dense_tail(flat, count, comm)
        if layout is not None:
            sparse = flat[:, :count]
            total, _ = exchange_positions(sparse, select_positions(sparse, layout), layout, comm)
            torch.div(total, comm.world_size, out=average[:count])
        return average

    def _reduce_gathered(self, sparse: Sequence[Job], comm: Collective) -> None:
        if not sparse:
            return
        workers = comm.local_workers
        numels = [job.numel for job in sparse]
        ks = [self.k_for(n) for n in numels]
        if sum(numels) > MAX_ENTRIES:  # flat positions would not fit int32: per tensor
            self._reduce_per_size(sparse, comm)
            return
        layout = segment_layout(numels, ks, sparse[0].tensor.device)
        # A fresh buffer (it becomes the residuals): the call's tensors laid end to end.
        flat = cat_rows([job.tensor for job in sparse], workers)
        # One selection for the whole call off the CPU, a fixed number of ops (a GPU launches
        # a few kernels per call instead of a few per distinct tensor size). Each tensor's
        # entries are ranked among its own only: the same choice whatever the grouping.
        gather_flat(sparse, flat, select_positions(flat, layout), layout, comm)

    def _reduce_per_size(self, sparse: Sequence[Job], comm: Collective) -> None:
        """Calls too large for int32 flat positions: one selection per distinct size, each
        tensor's own indices on the wire (:func:`~gradzip.compressors.sparse.gather_full`)."""
        workers = comm.local_workers
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

    def _reduce_sharded(self, jobs: Sequence[Job], comm: Collective) -> None:
        if not jobs:
            return
        workers, picks = comm.local_workers, []
        for job in jobs:
            flat = outside_own_part(job.tensor.reshape(workers, -1), comm)
            # The positions alone: the exchange splits the k picks among the owners.
            picks.append(topk_abs(flat, self.k_for(job.numel))[1])
        sharded_reduce(jobs, picks, [self.k_for(job.numel) for job in jobs], comm, self.owner_keep)
