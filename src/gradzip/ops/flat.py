"""Flat buffers: many tensors, one collective.

Tensors carry a leading *worker axis* of length ``L`` (the workers held by this process: 1 in a
real process group, N in the simulator). Flattening keeps that axis, so ``[L, *shape]`` tensors
become one ``[L, total]`` buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["flatten_workers", "reinterpret", "split_flat"]


def flatten_workers(tensors: Sequence[torch.Tensor], workers: int) -> torch.Tensor:
    """Concatenate ``[L, ...]`` tensors into one ``[L, total]`` buffer.

    Args:
        tensors: tensors whose first dimension is the worker axis of length ``workers``.
        workers: the length ``L`` of the worker axis (needed when ``tensors`` is empty).

    Returns:
        A new contiguous tensor ``[L, sum(numel / L)]``.
    """
    if not tensors:
        return torch.zeros(workers, 0)
    return torch.cat([t.reshape(workers, -1) for t in tensors], dim=1)


def split_flat(flat: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    """Split the last dimension of ``flat`` into consecutive chunks of ``sizes``."""
    assert flat.shape[-1] == sum(sizes), (flat.shape, sum(sizes))
    return list(torch.split(flat, list(sizes), dim=-1))


def reinterpret(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret the bytes of each row of ``rows[R, n]`` as ``dtype`` (``[R, m]``).

    Slices of a gathered byte buffer are not aligned for a direct ``view``; this copies each
    row into fresh storage first.
    """
    count = rows.shape[0]
    return rows.reshape(-1).clone().view(dtype).reshape(count, -1)
