"""Low-rank helpers for PowerSGD."""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import torch

from gradzip.ops.multi import copy_many

__all__ = ["ALIGN_BYTES", "aligned_copy", "aligned_matrices", "orthogonalize", "orthonormal",
           "orthonormal_many", "rescale_exponents", "stack_matrices", "stack_region"]


# Columns whose largest entry lies outside [_LOW, _HIGH] are rescaled by a power of two before
# their norm is taken: squares of entries above 2**32 can overflow fp32 once summed (1e20 squared
# is inf), and squares below 2**-32 can underflow to zero.
_HIGH = 2.0**32
_LOW = 2.0**-32

#: Every matrix that PowerSGD's products read or write, and every matrix it factorises,
#: starts at a multiple of this many bytes (a cache line, and the widest vector load of the
#: CPU's and GPU's kernels), whichever others share its batch: see :func:`aligned_matrices`.
ALIGN_BYTES = 64


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


def _quantum(dtype: torch.dtype) -> int:
    """Entries of ``dtype`` in :data:`ALIGN_BYTES` (from the dtype's size: no tensor made,
    as this runs several times per group and call)."""
    return max(1, ALIGN_BYTES // dtype.itemsize)


def _padded(numel: int, dtype: torch.dtype) -> int:
    """``numel`` rounded up to a whole number of :data:`ALIGN_BYTES`."""
    q = _quantum(dtype)
    return -(-numel // q) * q


def aligned_matrices(
    lead: Sequence[int], shapes: Sequence[tuple[int, int, int]], *, dtype: torch.dtype,
    device: torch.device | str, zero: bool = False,
) -> list[torch.Tensor]:
    """New ``[*lead, B, a, b]`` batches, one per ``(B, a, b)`` of ``shapes``, in one
    allocation, each matrix contiguous and starting at a multiple of :data:`ALIGN_BYTES`
    (whatever its size and its neighbours: the padding between matrices is never read).

    Why: the BLAS and LAPACK round a product or a factorisation differently with the
    alignment of its operands and its output (on the CPU, a matrix 4 bytes further along gives
    other bits). A matrix placed by a batch of others would then change its bits with them:
    placed here, every matrix of a given shape is computed alike however it is batched.

    Args:
        lead: leading dimensions (the local workers), or ``()``.
        shapes: ``(B, a, b)`` of each batch.
        dtype: of the buffer.
        device: of the buffer.
        zero: fill the buffer with zeros (padding included), for buffers that are stored.

    Returns:
        One view per batch.
    """
    q, width, places = _placement(tuple(shapes), dtype)
    lead = tuple(lead)
    count = math.prod(lead) * width
    make = torch.zeros if zero else torch.empty
    buf = make(count + q, dtype=dtype, device=device)
    shift = (-buf.data_ptr() % ALIGN_BYTES) // buf.element_size()  # 0 from torch's allocators
    # Each batch made by one ``as_strided`` of the buffer (the strides and offset that
    # slicing the rows and viewing them would give, in one call instead of four: this runs
    # several times per group and call, and each view costs the host about a microsecond).
    lead_strides = _lead_strides(lead, width)
    return [buf.as_strided((*lead, b, a, c), (*lead_strides, padded, c, 1), shift + start)
            for start, _, b, padded, a, c in places]


@lru_cache(maxsize=64)
def _lead_strides(lead: tuple[int, ...], width: int) -> tuple[int, ...]:
    """The strides of contiguous leading dimensions ``lead`` over rows of ``width`` entries."""
    strides, step = [], width
    for size in reversed(lead):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


@lru_cache(maxsize=1024)
def _placement(shapes: tuple[tuple[int, int, int], ...], dtype: torch.dtype
               ) -> tuple[int, int, tuple[tuple[int, int, int, int, int, int], ...]]:
    """:func:`aligned_matrices`' layout of ``shapes`` per worker: the quantum, the width and
    each batch's ``(start, stop, B, padded, a, b)``. Cached: a call's shapes recur every step,
    and this runs several times per call."""
    q, places, start = _quantum(dtype), [], 0
    for b, a, c in shapes:
        padded = _padded(a * c, dtype)
        places.append((start, start + b * padded, b, padded, a, c))
        start += b * padded
    return q, start, tuple(places)


def aligned_copy(x: torch.Tensor) -> torch.Tensor:
    """A copy of the batch ``x`` (``[..., B, a, b]``) laid out as :func:`aligned_matrices`
    lays it out (a copy even when ``x`` already is)."""
    *lead, b, rows, cols = x.shape
    return aligned_matrices(lead, [(b, rows, cols)], dtype=x.dtype, device=x.device)[0].copy_(x)


def orthonormal(pt: torch.Tensor) -> torch.Tensor:
    """:func:`orthogonalize` of ``P`` given as ``P^T`` (``[..., r, n]``) already rescaled by its
    power of two (:func:`rescale_exponents`; for callers that rescale many matrices at once,
    as PowerSGD does over a call's whole message).

    Each matrix is factorised on its own, as one with ``n`` rounded up to a whole number of
    :data:`ALIGN_BYTES` by zero rows (which stay zero in the result, and which put every
    matrix of a batch at an aligned place in LAPACK's working copy), so its bits do not
    depend on the batch it is in.

    Returns:
        ``P``'s orthonormal columns, ``[..., n, r]``: a view of an aligned buffer (each matrix's
        columns ``n_padded`` entries apart). An empty ``pt`` gives an empty result.
    """
    return orthonormal_many([pt])[0]


def orthonormal_many(pts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`orthonormal` of each of ``pts`` (of one dtype and device), bit for bit: the
    padded copies the factorisations read made in one allocation, by one multi-tensor copy
    where the device takes them in one launch (see :mod:`gradzip.ops.multi`), instead of an
    allocation and a copy per batch (PowerSGD factorises one batch per group of same-shape
    matrices, a dozen per call under Accordion)."""
    out: list[torch.Tensor | None] = [None] * len(pts)
    todo = []
    for i, pt in enumerate(pts):
        if pt.numel() == 0:
            out[i] = pt.transpose(-1, -2).clone()
        else:
            todo.append(i)
    if todo:
        first = pts[todo[0]]
        batches = [pts[i].reshape(-1, *pts[i].shape[-2:]) for i in todo]
        widths = [_padded(b.shape[-1], first.dtype) for b in batches]
        # The padding rows must be zero; where no ``n`` needs any, the copies fill every entry
        # the factorisations read, and zeroing the buffer first would be one more op.
        padded = aligned_matrices(
            (), [(b.shape[0], b.shape[1], w) for b, w in zip(batches, widths, strict=True)],
            dtype=first.dtype, device=first.device,
            zero=any(w != b.shape[-1] for b, w in zip(batches, widths, strict=True)))
        copy_many([p[..., :b.shape[-1]] for p, b in zip(padded, batches, strict=True)], batches)
        for i, p, b in zip(todo, padded, batches, strict=True):
            out[i] = _factorise(p, b.shape[-1]).reshape(*pts[i].shape[:-2], b.shape[-1],
                                                        b.shape[-2])
    return [o for o in out if o is not None]


def _factorise(padded: torch.Tensor, n: int) -> torch.Tensor:
    """The orthonormal columns of the batch ``padded`` (``[B, r, n_pad]``, each matrix ``P^T``
    at an aligned place, zero past column ``n``): ``[B, n, r]``, a view of an aligned buffer."""
    count, r, n_pad = padded.shape
    p = padded.transpose(-1, -2)  # [B, n_pad, r], column-major per matrix: LAPACK's layout
    if r == 1:
        (out,) = aligned_matrices((), [(count, 1, n_pad)], dtype=padded.dtype,
                                  device=padded.device)
        out = out.transpose(-1, -2)
        norm = p.norm(dim=-2, keepdim=True)
        positive = norm > 0
        # A zero P (a zero gradient) gives a unit vector rather than NaN or zero, so a
        # warm-started power iteration recovers as soon as the gradient is non-zero again.
        torch.where(positive, p / torch.where(positive, norm, 1.0),
                    _unit(count, n_pad, padded.dtype, padded.device), out=out)
    else:
        out, _ = torch.linalg.qr(p, mode="reduced")  # column-major per matrix, a new buffer
        if out.data_ptr() % ALIGN_BYTES or (out.stride(0) * out.element_size()) % ALIGN_BYTES:
            (placed,) = aligned_matrices((), [(count, r, n_pad)], dtype=padded.dtype,
                                         device=padded.device)
            out = placed.transpose(-1, -2).copy_(out)  # never on torch's own allocators
    return out[:, :n, :]


@lru_cache(maxsize=64)
def _unit(count: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[count, n, 1]``, each column the first unit vector: what a zero ``P`` of rank 1
    becomes. Made once per shape (two ops fewer per batch and call) and only ever read."""
    unit = torch.zeros(count, n, 1, dtype=dtype, device=device)
    unit[:, 0, :] = 1.0
    return unit


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
    return orthonormal((p * torch.exp2(rescale_exponents(top))).transpose(-1, -2))


def stack_matrices(tensors: Sequence[torch.Tensor], rows: int, cols: int) -> torch.Tensor:
    """``[L, B, rows, cols]``: the ``B`` tensors (each ``[L, *shape]`` holding ``rows * cols``
    entries per worker) as one batch of matrices, each matrix contiguous and starting at a
    multiple of :data:`ALIGN_BYTES` (see :func:`aligned_matrices`).

    Tensors already placed so (views of one buffer at a uniform aligned step, as a bucket's
    gradients or the warm starts PowerSGD stores often are) are viewed in place; otherwise
    they are copied once into :func:`aligned_matrices`' layout. Either way a matrix's products
    round the same whichever tensors it was batched with and wherever it came from.

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
    view = _aligned_view(tensors, workers, rows, cols)
    if view is not None:
        return view
    first = tensors[0]
    (out,) = aligned_matrices((workers,), [(len(tensors), rows, cols)], dtype=first.dtype,
                              device=first.device)
    mats = [t.reshape(workers, rows, cols) for t in tensors]
    if len(mats) == 1:
        out[:, 0].copy_(mats[0])
    else:
        torch.stack(mats, dim=1, out=out)
    return out


def _aligned_view(
    tensors: Sequence[torch.Tensor], workers: int, rows: int, cols: int
) -> torch.Tensor | None:
    """The ``[L, B, rows, cols]`` view of ``tensors`` when each worker's part of each is
    contiguous, they follow one another in one storage at a uniform step (same worker stride),
    and every matrix starts at a multiple of :data:`ALIGN_BYTES`; else ``None``."""
    first, size = tensors[0], rows * cols
    item = first.element_size()
    step = tensors[1].storage_offset() - first.storage_offset() if len(tensors) > 1 else size
    stride = first.stride(0) if workers > 1 else step * len(tensors)
    if (first.data_ptr() % ALIGN_BYTES or step < size or (step * item) % ALIGN_BYTES
            or (stride * item) % ALIGN_BYTES):
        return None
    base = first.untyped_storage().data_ptr()
    for i, t in enumerate(tensors):
        if (
            t.dtype != first.dtype
            or t.untyped_storage().data_ptr() != base
            or t.storage_offset() != first.storage_offset() + i * step
            or not t[0].is_contiguous()
            or (workers > 1 and t.stride(0) != stride)
        ):
            return None
    return first.as_strided((workers, len(tensors), rows, cols), (stride, step, cols, 1),
                            first.storage_offset())


def stack_region(region: torch.Tensor, count: int, rows: int, cols: int) -> torch.Tensor:
    """``[L, B, rows, cols]``: :func:`stack_matrices` of ``count`` matrices lying end to end
    in each row of ``region`` (``[L, count * rows * cols]``, each row contiguous), without a
    view per matrix: the region itself, viewed, where every matrix starts at a multiple of
    :data:`ALIGN_BYTES`; else one copy into :func:`aligned_matrices`' layout. The same
    matrices, at aligned places either way, as :func:`stack_matrices` of their views gives.
    """
    workers, size = region.shape[0], rows * cols
    item = region.element_size()
    if (not region.data_ptr() % ALIGN_BYTES and not (size * item) % ALIGN_BYTES
            and (workers == 1 or not (region.stride(0) * item) % ALIGN_BYTES)
            and region.stride(-1) == 1):
        return region.view(workers, count, rows, cols)
    (out,) = aligned_matrices((workers,), [(count, rows, cols)], dtype=region.dtype,
                              device=region.device)
    return out.copy_(region.view(workers, count, rows, cols))
