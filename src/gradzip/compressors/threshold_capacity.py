"""The hard threshold's fixed-capacity all-gather: message sizes from shapes alone.

Each worker's message holds ``slots`` entries per tensor (a ``capacity`` fraction of its
entries): its entries at or above lambda when they fit, else the largest of them (the rest stay
in its residual), free slots travelling as padding (value 0). No worker reads a count on the
host, so with an absolute ``lam`` the engine keeps its decisions on the device. The default,
sized form is :mod:`gradzip.compressors.threshold_sized`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from gradzip.comm.base import Collective
from gradzip.compressors.base import Job
from gradzip.compressors.sparse import exchange_positions, gather_flat, select_positions
from gradzip.ops.flat import cat_rows
from gradzip.ops.segmented import SegmentLayout, pieces, segment_layout

__all__ = ["gather_row", "reduce_capacity"]


def reduce_capacity(jobs: Sequence[Job], lam: float, slots_for: Callable[[int], int],
                    padded: bool, comm: Collective) -> tuple[torch.Tensor, int]:
    """Average every job through the fixed-capacity all-gather and record residuals.

    Args:
        jobs: the tensors, in an order identical on every worker (at least one).
        lam: the threshold (identical on every worker).
        slots_for: entries one worker's message holds for a tensor of ``n`` entries.
        padded: count every slot of every worker as sent (else the non-zero values sent).
        comm: the collective.

    Returns:
        ``(sent, offered)``: entries sent (a 0-d float64 tensor on the messages' device, no
        host read) and entries offered (``W`` times the jobs' entries).
    """
    # Calls whose flat positions would pass int32 go in pieces (nothing depends on which
    # tensors share a call).
    ranges = pieces([job.numel for job in jobs]) or [(0, 0)]
    sent = _gather_call(jobs[: ranges[0][1]], lam, slots_for, padded, comm)
    for start, stop in ranges[1:]:
        sent = sent + _gather_call(jobs[start:stop], lam, slots_for, padded, comm)
    return sent, comm.world_size * sum(j.numel for j in jobs)


def _gather_call(jobs: Sequence[Job], lam: float, slots_for: Callable[[int], int], padded: bool,
                 comm: Collective) -> torch.Tensor:
    numels = [j.numel for j in jobs]
    layout = segment_layout(numels, [slots_for(n) for n in numels], jobs[0].tensor.device)
    # A fresh buffer (it becomes the residuals): the call's tensors laid end to end.
    flat = cat_rows([j.tensor for j in jobs], comm.local_workers)
    positions, values, left = _slots(flat, layout, lam)
    received = gather_flat(jobs, flat, positions, layout, comm, values=values, left=left)
    return _sent(received, layout, padded, comm.world_size)


def gather_row(flat: torch.Tensor, layout: SegmentLayout, lam: float, padded: bool,
               comm: Collective) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed-capacity all-gather of the tensors laid end to end in the rows of
    ``flat[L, total]`` (``layout``: each tensor's slots), ``flat`` left with the residuals:
    :func:`reduce_capacity`'s exchange without a job per tensor.

    Returns:
        ``(total, sent)``: ``[total]`` the sum over workers of what they sent (a new tensor),
        and the entries counted as sent (a 0-d float64 tensor; see :func:`reduce_capacity`).
    """
    positions, values, left = _slots(flat, layout, lam)
    total, received = exchange_positions(flat, positions, layout, comm, values=values, left=left)
    return total, _sent(received, layout, padded, comm.world_size)


def _slots(flat: torch.Tensor, layout: SegmentLayout,
           lam: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each tensor's slots in the rows of ``flat``: ``(positions, values sent, what the
    residual keeps there)``."""
    # Each tensor's ``slots`` largest entries: every entry at or above lambda when there are
    # no more of them than slots, else the largest of them. Sizes come from shapes only, so
    # no worker reads a count on the host.
    positions = select_positions(flat, layout)
    picked = flat.gather(1, positions)
    above = picked.abs() >= lam  # NaN never reaches lambda
    values = picked.masked_fill(above.logical_not(), 0.0)  # a slot below lambda: padding
    return positions, values, picked.masked_fill(above, 0.0)


def _sent(received: torch.Tensor, layout: SegmentLayout, padded: bool, world: int) -> torch.Tensor:
    """The entries counted as sent: with ``padded`` the wire's volume (every slot of every
    worker), else the non-zero values of every message (``received``)."""
    if padded:
        return torch.tensor(float(world * layout.selected), dtype=torch.float64)
    return received.ne(0).sum(dtype=torch.float64)
