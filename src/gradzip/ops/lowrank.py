"""Low-rank helpers for PowerSGD."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["orthogonalize", "orthonormal", "rescale_exponents", "stack_matrices"]


# Columns whose largest entry lies outside [_LOW, _HIGH] are rescaled by a power of two before
# their norm is taken: squares of entries above 2**32 can overflow fp32 once summed (1e20 squared
# is inf), and squares below 2**-32 can underflow to zero.
_HIGH = 2.0**32
_LOW = 2.0**-32


def rescale_exponents(top: torch.Tensor) -> torch.Tensor:
    """The power of two (as an exponent, fp32) that :func:`orthogonalize` multiplies a matrix
    by, from its largest absolute entry ``top`` (>= 0 or NaN; any shape, elementwise): 0 when
    ``top`` lies in ``[_LOW, _HIGH]``, is zero or is not finite; otherwise the exponent that
    brings it into ``(0.5, 1]``. Computed on the device, without a host synchronisation.

    A power-of-two scale changes no mantissa, and the normalised result does not depend on a
    positive scale, so this only removes the overflow (or underflow) of the norm. Without it,
    one huge but finite gradient gave a norm of ``inf`` and a factor of zeros: finite, so no
    non-finite policy fired, while the average was silently zero.
    """
    # ``top < inf``: finite for a largest absolute entry, which is never negative (one op,
    # where ``isfinite`` takes several).
    odd = ((top > _HIGH) | ((top < _LOW) & (top > 0))) & (top < torch.inf)
    # The exponent is clamped so that the scale itself stays a normal fp32 number (a subnormal
    # largest entry would otherwise ask for 2**149, which is inf); the clamped result is still
    # far enough from both limits for the norm.
    return torch.clamp(-torch.ceil(torch.log2(torch.where(odd, top, 1.0))), -126.0, 126.0)


def _orthonormal(p: torch.Tensor) -> torch.Tensor:
    """:func:`orthogonalize` of an already rescaled, non-empty ``p``."""
    if p.shape[-1] == 1:
        norm = p.norm(dim=-2, keepdim=True)
        unit = torch.zeros_like(p)
        unit[..., 0, :] = 1.0
        return torch.where(norm > 0, p / torch.where(norm > 0, norm, 1.0), unit)
    q, _ = torch.linalg.qr(p, mode="reduced")
    return q


def orthonormal(p: torch.Tensor) -> torch.Tensor:
    """:func:`orthogonalize` of a ``p`` already rescaled by its power of two
    (:func:`rescale_exponents`; for callers that rescale many matrices at once, as PowerSGD
    does over a call's whole message); an empty ``p`` comes back as a copy."""
    return _orthonormal(p) if p.numel() else p.clone()


def orthogonalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning the columns of ``p`` (batched over leading dims).

    Uses a reduced QR decomposition (a normalisation for one column). A zero ``p`` (a zero
    gradient) comes back as unit vectors rather than NaN or zero, so a warm-started power
    iteration recovers as soon as the gradient is non-zero again. Finite inputs of any
    magnitude give orthonormal columns: huge or tiny ones are rescaled by a power of two first
    (per matrix, see :func:`rescale_exponents`), so the norm neither overflows (which would
    give zeros) nor underflows.

    Args:
        p: ``[..., n, r]`` with ``r <= n``.

    Returns:
        ``[..., n, r]`` with orthonormal columns (NaN where ``p`` holds NaN or infinity).
    """
    if p.numel() == 0:
        return p.clone()
    top = p.abs().amax(dim=(-2, -1), keepdim=True)
    return _orthonormal(p * torch.exp2(rescale_exponents(top)))


def stack_matrices(tensors: Sequence[torch.Tensor], rows: int, cols: int) -> torch.Tensor:
    """``[L, B, rows, cols]``: the ``B`` tensors (each ``[L, *shape]`` holding ``rows * cols``
    entries per worker) as one batch of matrices.

    Tensors that already lie one after another in one storage (views of one flat buffer, in
    order) are viewed in place; otherwise they are copied once into a new contiguous tensor.
    Either way every matrix is row-major with unit column stride, so a batched product rounds
    the same whichever way the batch was made.

    Args:
        tensors: at least one tensor, each ``[L, ...]`` with ``rows * cols`` entries per worker.
        rows: the rows of each matrix.
        cols: the columns of each matrix.

    Returns:
        A tensor ``[L, B, rows, cols]``.

    Raises:
        ValueError: if ``tensors`` is empty or a tensor does not hold ``L * rows * cols`` entries.
    """
    if not tensors:
        raise ValueError("`tensors` must hold at least one tensor, got none")
    workers = tensors[0].shape[0]
    for t in tensors:
        if t.numel() != workers * rows * cols:
            raise ValueError(
                f"`tensors` must each hold {workers} x {rows} x {cols} entries, got shape "
                f"{tuple(t.shape)}")
    view = _consecutive_view(tensors, workers, rows, cols)
    if view is not None:
        return view
    mats = [t.reshape(workers, rows, cols) for t in tensors]
    if len(mats) == 1:
        return mats[0].contiguous().unsqueeze(1)
    return torch.stack(mats, dim=1)


def _consecutive_view(
    tensors: Sequence[torch.Tensor], workers: int, rows: int, cols: int
) -> torch.Tensor | None:
    """The ``[L, B, rows, cols]`` view of ``tensors`` when each worker's part of each is
    contiguous and they follow one another in one storage (same worker stride); else ``None``."""
    first = tensors[0]
    size = rows * cols
    if len(tensors) == 1:
        return None
    base = first.untyped_storage().data_ptr()
    stride = first.stride(0) if workers > 1 else size * len(tensors)
    for i, t in enumerate(tensors):
        if (
            t.dtype != first.dtype
            or t.untyped_storage().data_ptr() != base
            or t.storage_offset() != first.storage_offset() + i * size
            or not t[0].is_contiguous()
            or (workers > 1 and t.stride(0) != stride)
        ):
            return None
    return first.as_strided((workers, len(tensors), rows, cols), (stride, size, cols, 1),
                            first.storage_offset())
