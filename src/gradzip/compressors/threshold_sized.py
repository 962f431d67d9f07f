"""The hard threshold's all-gather with sizes exchanged first: its default form.

Each worker sends exactly its entries at or above lambda. Workers first all-gather how many
entries each tensor sends (4 bytes per tensor; read on the host once per call, the documented
wait: the padding depends on them), then all-gather values and int32 indices padded to the
densest worker; a tensor whose densest worker would cost more than a dense all-reduce goes
dense. The message's size thus follows the entries that pass lambda (the paper's adaptive
bytes). With a ``capacity`` the threshold takes the fixed-capacity form instead, with no
host read (:class:`~gradzip.compressors.threshold.HardThreshold`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gradzip.comm.base import Collective
from gradzip.compressors.base import Job, dense_reduce, sparse_pays
from gradzip.compressors.sparse import gather_sparse, index_bytes
from gradzip.ops.branches import cpu_form
from gradzip.ops.flat import cat_rows, to_device
from gradzip.ops.select import threshold_split

__all__ = ["reduce_sized"]


def reduce_sized(jobs: Sequence[Job], lam: float, padded: bool, comm: Collective
                 ) -> tuple[int, int, int]:
    """Average every job (each worker sends its entries ``>= lam``) and record residuals.

    Args:
        jobs: the tensors, in an order identical on every worker.
        lam: the threshold (identical on every worker).
        padded: count the padded volume as sent (else the entries workers sent).
        comm: the collective.

    Returns:
        ``(sent, offered, dense)``: entries all workers sent (or, padded, that the wire
        carries), entries offered (``W`` times the jobs' entries) and the number of jobs sent
        dense (their densest worker's count made that cheaper).
    """
    if _selects_per_call(jobs[0].tensor.device):
        selected, all_counts = _select_call(jobs, lam, comm)
    else:
        # One pass per tensor finds the entries and writes what stays behind (the residual).
        selected = [threshold_split(j.tensor.reshape(comm.local_workers, -1), lam) for j in jobs]
        counts = torch.tensor(
            [[sel[0][w].numel() for sel in selected] for w in range(comm.local_workers)],
            dtype=torch.int32,
        )
        # Sizes first: every worker learns every worker's count, so the padding and the
        # sparse-or-dense choice below are identical everywhere.
        all_counts = comm.all_gather(counts).tolist()  # [W][T]
    widest = [max(column) for column in zip(*all_counts, strict=True)]
    # What counts against the budget: the entries workers said, or (padded) the entries
    # the wire carries, the densest worker's count from every worker.
    sent = sum(widest) * comm.world_size if padded else sum(map(sum, all_counts))
    offered = comm.world_size * sum(j.numel for j in jobs)
    sparse_ids = [
        t for t, job in enumerate(jobs)
        if sparse_pays(job.numel, widest[t], 4 + index_bytes(job.numel), comm)
    ]
    chosen = set(sparse_ids)
    dense_reduce([j for t, j in enumerate(jobs) if t not in chosen], comm)
    for t in sparse_ids:
        jobs[t].keep(selected[t][2].reshape(jobs[t].tensor.shape))
    gather_sparse(
        [jobs[t] for t in sparse_ids],
        [selected[t][0] for t in sparse_ids],
        [selected[t][1] for t in sparse_ids],
        [widest[t] for t in sparse_ids],
        comm,
    )
    return sent, offered, len(jobs) - len(sparse_ids)


def _selects_per_call(device: torch.device) -> bool:
    """Whether the call's entries are selected with :func:`_select_call` (off the CPU, where a
    per-tensor search would make the host wait for every tensor; the CPU's one-pass scan is
    faster there)."""
    return not cpu_form(device)


Selection = tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]


def _select_call(
    jobs: Sequence[Job], lam: float, comm: Collective
) -> tuple[list[Selection], list[list[int]]]:
    """What :func:`~gradzip.ops.select.threshold_split` gives for every job, and every
    worker's counts, with one host read per call and a few ops whatever the number of tensors.

    The call's tensors are laid end to end; the counts per tensor come from a prefix sum of the
    mask and are all-gathered on the device, then read once (the documented wait: the
    message's size depends on them); knowing its own counts, the host has the selected
    positions listed without a wait (``nonzero_static``), in the same ascending order.

    Returns:
        ``(selected, all_counts)``: per job ``(values, indices, rest)`` as ``threshold_split``
        returns them, and ``[W][T]`` counts in rank order.
    """
    workers = comm.local_workers
    device = jobs[0].tensor.device
    numels = [job.numel for job in jobs]
    flat = cat_rows([job.tensor for job in jobs], workers)  # [L, total]
    total = flat.shape[1]
    mask = flat.abs() >= lam  # NaN never reaches lambda, as in threshold_split
    bounds = [0]
    for n in numels:
        bounds.append(bounds[-1] + n)
    prefix = torch.nn.functional.pad(mask.cumsum(dim=1), (1, 0))  # [L, total + 1]
    at = to_device(torch.tensor(bounds, dtype=torch.int64), device)
    ends = prefix.index_select(1, at)
    counts = (ends[:, 1:] - ends[:, :-1]).to(torch.int32)  # [L, T]
    all_counts = comm.all_gather(counts).tolist()  # the call's one host read
    # This process's workers, in order (their rows of the gathered counts).
    own = [all_counts[comm.first_rank + w] for w in range(workers)]
    found = torch.nonzero_static(mask, size=sum(map(sum, own)))  # [N, 2], row-major
    cols = found[:, 1]
    picked = flat.reshape(-1).index_select(0, found[:, 0] * total + cols)
    # Each entry's position in its own tensor: its column minus its tensor's first column.
    firsts = torch.tensor([bounds[t] for row in own for t in range(len(row))], dtype=torch.int64)
    sizes = [c for row in own for c in row]
    local = cols - to_device(firsts, device).repeat_interleave(
        to_device(torch.tensor(sizes, dtype=torch.int64), device), output_size=cols.numel()
    )
    rest = flat.masked_fill(mask, 0.0)
    value_parts = torch.split(picked, sizes)
    index_parts = torch.split(local, sizes)
    count = len(jobs)
    selected: list[Selection] = []
    for t in range(count):
        values = [value_parts[w * count + t] for w in range(workers)]
        indices = [index_parts[w * count + t] for w in range(workers)]
        selected.append((values, indices, rest[:, bounds[t] : bounds[t + 1]]))
    return selected, all_counts
