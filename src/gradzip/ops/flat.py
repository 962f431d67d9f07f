"""Flat buffers: many tensors, one collective.

Tensors carry a leading *worker axis* of length ``L`` (the workers held by this process: 1 in a
real process group, N in the simulator). Flattening keeps that axis, so ``[L, *shape]`` tensors
become one ``[L, total]`` buffer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["consecutive", "flatten_workers", "pack", "reinterpret", "split_flat", "to_device", "unpack"]


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


def consecutive(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether ``tensors`` lie one after another in one storage, each contiguous, all of one
    dtype and device."""
    first = tensors[0]
    dtype, device, size = first.dtype, first.device, first.element_size()
    address = first.data_ptr()
    # A tensor's address is its storage's plus its offset, so tensors one after another have
    # addresses in turn. (Addresses, not storages and offsets: one call per tensor on a path
    # every call takes.) Separate allocations may abut, so the first and last tensors must
    # share a storage as well: every address between them lies in that one allocation.
    for t in tensors:
        if t.data_ptr() != address or t.dtype != dtype or t.device != device or not t.is_contiguous():
            return False
        address += t.numel() * size
    return tensors[-1].untyped_storage().data_ptr() == first.untyped_storage().data_ptr()


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One 1-D tensor holding every entry of ``tensors``, one tensor after another.

    Why: on a GPU every op is a kernel launch, so an elementwise step over a call's tens of
    tensors (a rollback by ``where``, a mask) costs one launch over their concatenation
    instead of one per tensor. Where the tensors already lie so in one storage (the views
    :func:`unpack` made), the result is a view of it and no op runs; otherwise one
    concatenation copies them.

    Args:
        tensors: at least one tensor, all of one dtype and device.

    Returns:
        A contiguous 1-D tensor of ``sum(t.numel())`` entries (a view, or a new tensor).
    """
    assert tensors, "nothing to pack"
    if consecutive(tensors):
        first = tensors[0]
        return first.as_strided((sum(t.numel() for t in tensors),), (1,), first.storage_offset())
    return torch.cat([t.reshape(-1) for t in tensors])


def unpack(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """Views of the 1-D ``flat`` in ``shapes``, one after another (the inverse of
    :func:`pack`; no op)."""
    sizes = [math.prod(shape) for shape in shapes]
    assert sum(sizes) == flat.numel(), (sum(sizes), flat.numel())
    # One split (views, made in C++) rather than a Python slice per tensor: this runs for
    # every call on the hot path, once per gradient.
    return [part.view(shape) for part, shape in zip(flat.split(sizes), shapes, strict=True)]


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
