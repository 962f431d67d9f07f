"""Sending (value, index) pairs with one all-gather, shared by Top-k and hard threshold."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gradzip.comm.base import Collective
from gradzip.compressors.base import Job
from gradzip.ops.flat import reinterpret
from gradzip.ops.select import index_dtype

__all__ = ["gather_sparse", "index_bytes", "scatter_decode"]


def index_bytes(numel: int) -> int:
    """Bytes per index on the wire: 4 (int32) where it fits, else 8."""
    return 4 if index_dtype(numel) == torch.int32 else 8


def _as_words(indices: torch.Tensor, numel: int) -> torch.Tensor:
    """Indices ``[L, m]`` reinterpreted as float32 words so values and indices share a buffer."""
    return indices.to(index_dtype(numel)).contiguous().view(torch.float32)


def _from_words(words: torch.Tensor, numel: int) -> torch.Tensor:
    return reinterpret(words, index_dtype(numel)).to(torch.int64)


def scatter_decode(values: torch.Tensor, indices: torch.Tensor, numel: int) -> torch.Tensor:
    """Sum ``values[R, m]`` at ``indices[R, m]`` into one dense vector of length ``numel``.

    Raises:
        ValueError: an index lies outside ``[0, numel)`` (a corrupt message).
    """
    flat_idx = indices.reshape(-1)
    if flat_idx.numel() and (int(flat_idx.min()) < 0 or int(flat_idx.max()) >= numel):
        raise ValueError(
            f"message indices must lie in [0, {numel}), got range "
            f"[{int(flat_idx.min())}, {int(flat_idx.max())}]"
        )
    out = torch.zeros(numel, dtype=values.dtype, device=values.device)
    return out.index_add_(0, flat_idx, values.reshape(-1))


def gather_sparse(
    jobs: Sequence[Job],
    values: Sequence[Sequence[torch.Tensor]],
    indices: Sequence[Sequence[torch.Tensor]],
    widths: Sequence[int],
    comm: Collective,
    extra_payload: int = 0,
    decoded: Sequence[torch.Tensor | None] | None = None,
) -> None:
    """All-gather every job's sparse message in one buffer and decode the average.

    Args:
        jobs: the tensors, in an order identical on every worker.
        values, indices: per job, per local worker, 1-D tensors of at most ``widths[j]``
            entries (they may be shorter: they are padded with index 0 and value 0, which
            decode to nothing).
        widths: per job, the padded length, identical on every worker.
        comm: the collective.
        extra_payload: bytes of metadata per worker counted on top of values and indices
            (e.g. sizes sent beforehand are counted by that exchange, not here).
        decoded: per job, what each local worker's message decodes to (``[L, *shape]``),
            when the caller already has it; otherwise it is rebuilt from the values.
    """
    workers = comm.local_workers
    parts: list[torch.Tensor] = []
    payload = [extra_payload] * workers
    for j, job in enumerate(jobs):
        width = widths[j]
        val = torch.zeros(workers, width, dtype=torch.float32, device=job.tensor.device)
        idx = torch.zeros(workers, width, dtype=torch.int64, device=job.tensor.device)
        for w in range(workers):
            count = values[j][w].numel()
            val[w, :count] = values[j][w]
            idx[w, :count] = indices[j][w]
            payload[w] += count * (4 + index_bytes(job.numel))
        parts.append(val)
        parts.append(_as_words(idx, job.numel))
        if decoded is not None and decoded[j] is not None:
            job.decoded = decoded[j].reshape(job.tensor.shape)
        else:
            local = torch.zeros(workers, job.numel, dtype=torch.float32, device=job.tensor.device)
            # scatter_add, not scatter: padding entries point at index 0 and must add nothing.
            job.decoded = local.scatter_add_(1, idx, val).reshape(job.tensor.shape)
    if not jobs:
        return
    gathered = comm.all_gather(torch.cat(parts, dim=1), payload=payload)
    offset = 0
    for j, job in enumerate(jobs):
        width, words = widths[j], widths[j] * index_bytes(job.numel) // 4
        val = gathered[:, offset : offset + width]
        idx = _from_words(gathered[:, offset + width : offset + width + words], job.numel)
        offset += width + words
        total = scatter_decode(val, idx, job.numel)
        job.averaged = total.div_(comm.world_size).reshape(job.shape)
