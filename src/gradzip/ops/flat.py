"""Flat buffers: many tensors, one collective.

Tensors carry a leading *worker axis* of length ``L`` (the workers held by this process: 1 in a
real process group, N in the simulator). Flattening keeps that axis, so ``[L, *shape]`` tensors
become one ``[L, total]`` buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["flatten_workers", "reinterpret", "split_flat", "to_device"]


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


def to_device(x: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``x`` on ``device``, queued on the current stream without making the host wait.

    A plain ``.to("cuda")`` of ordinary (pageable) host memory copies and then synchronises
    the stream, so the host stops launching kernels until the GPU has caught up: one stall per
    call for a host-made tensor (random-k's indices, a fresh PowerSGD ``Q``). From page-locked
    memory with ``non_blocking=True`` the copy is only queued; PyTorch's page-locked allocator
    keeps the staging block alive until the copy has run, so ``x`` may be dropped at once.

    Args:
        x: any tensor.
        device: where it is needed.

    Returns:
        ``x`` itself when already there, else a copy on ``device`` (same values).
    """
    device = torch.device(device)
    if x.device == device:
        return x
    if x.device.type == "cpu" and device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)
