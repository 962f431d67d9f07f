"""Flat buffers: many tensors, one collective.

Tensors carry a leading *worker axis* of length ``L`` (the workers held by this process: 1 in a
real process group, N in the simulator). Flattening keeps that axis, so ``[L, *shape]`` tensors
become one ``[L, total]`` buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["cat_flat", "cat_rows", "consecutive", "flatten_workers", "pack", "reinterpret",
           "split_flat", "to_device", "unpack", "unpack_like"]


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
    return cat_rows(tensors, workers)


def cat_flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.cat([t.reshape(-1) for t in tensors])``: a new 1-D tensor of every entry, one
    tensor after another (promoted to one dtype as ``torch.cat`` promotes).

    Why not that line: each ``reshape`` is a Python call into PyTorch (about a microsecond
    and a half), made for every tensor of every call on the hot path; PyTorch's own
    flattening (``torch._utils._flatten_dense_tensors``, what DDP and Apex use) makes the
    flat views and the concatenation in one call, with the same values.
    """
    if len(tensors) < 2:  # it returns a view of a single tensor; the contract is a copy
        return torch.cat([t.reshape(-1) for t in tensors])
    return torch._utils._flatten_dense_tensors(tensors)


def cat_rows(tensors: Sequence[torch.Tensor], workers: int) -> torch.Tensor:
    """``torch.cat([t.reshape(workers, -1) for t in tensors], dim=1)``: the ``[L, ...]``
    tensors side by side as one new ``[L, total]`` tensor (in one call where there is one
    row, as :func:`cat_flat`)."""
    if workers == 1 and len(tensors) > 1:
        return cat_flat(tensors).view(1, -1)
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
    return cat_flat(tensors)


def unpack(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """Views of the 1-D contiguous ``flat`` in ``shapes``, one after another (the inverse of
    :func:`pack`; no op).

    Why not a split and a ``view`` per part: this runs for every call on the hot path, once
    per gradient, and each ``view`` is a Python call into PyTorch (about three
    microseconds); :func:`unpack_like` makes them all in one call, given an empty tensor of
    each shape on the ``meta`` device (no memory; made once per shape).
    """
    likes = [_like(shape) for shape in shapes]
    return unpack_like(flat, likes)


#: Shape -> an empty tensor of that shape on the ``meta`` device (:func:`unpack`'s models).
_LIKES: dict[tuple[int, ...], torch.Tensor] = {}


def _like(shape: Sequence[int]) -> torch.Tensor:
    key = shape if isinstance(shape, tuple) else tuple(shape)
    like = _LIKES.get(key)
    if like is None:
        if len(_LIKES) >= 4096:  # a bound for programs that see ever new shapes
            _LIKES.clear()
        like = _LIKES[key] = torch.empty(key, device="meta")
    return like


def unpack_like(flat: torch.Tensor, likes: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`unpack` in the shapes of ``likes`` (tensors; only their shapes are read).

    PyTorch's unflattening (``torch._utils._unflatten_dense_tensors``, what DDP uses) makes
    the views in one call. It gives an empty tensor a fresh 1-D one instead of a view of the
    shape asked for, so ``likes`` with an empty tensor take a split and a ``view`` each.
    """
    sizes = [t.numel() for t in likes]
    assert sum(sizes) == flat.numel(), (sum(sizes), flat.numel())
    if len(likes) < 2 or not all(sizes):
        return [part.view(t.shape) for part, t in zip(flat.split(sizes), likes, strict=True)]
    return list(torch._utils._unflatten_dense_tensors(flat, likes))


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
