"""Per-matrix reductions over a flat buffer of many matrices, in one op each.

A call's messages hold groups of equal-size matrices one after another (PowerSGD's factors of
every shape group in one buffer). Reducing each matrix by a loop of per-group ops costs one
launch per group on a GPU; an index that maps each entry to its matrix turns the reduction
into one scatter and the broadcast of per-matrix values back into one gather, whatever the
number of groups. The index depends only on the layout, so it is built once per layout and
device and reused.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from itertools import accumulate

import torch

from gradzip.ops.flat import to_device

__all__ = ["matrix_index", "per_matrix_absmax"]


@lru_cache(maxsize=64)
def _index(sizes: tuple[int, ...], counts: tuple[int, ...], device: str) -> torch.Tensor:
    # Offsets summed in Python: no tensor is read back (an op counter would see each read).
    offsets = [0, *accumulate(counts[:-1])]
    parts = [torch.arange(o, o + c, dtype=torch.int64).repeat_interleave(s // c)
             for s, c, o in zip(sizes, counts, offsets, strict=True)]
    # Queued from page-locked memory: a plain copy to a GPU would make the host wait, and a
    # call whose shapes are new (a level switch, another bucket) comes here mid-step.
    return to_device(torch.cat(parts), device)


def matrix_index(sizes: Sequence[int], counts: Sequence[int], device: torch.device) -> torch.Tensor:
    """``[sum(sizes)]`` int64 on ``device``: the matrix each entry of a flat region belongs
    to, the region made of groups of ``sizes[i]`` entries, each ``counts[i]`` equal-size
    matrices one after another (matrices numbered in order). Cached per layout and device:
    treat it as read-only.

    Raises:
        ValueError: if a group's size is not a multiple of its count, or a count is < 1.
    """
    sizes, counts = tuple(int(s) for s in sizes), tuple(int(c) for c in counts)
    if len(sizes) != len(counts) or not sizes:
        raise ValueError(f"`sizes` and `counts` must be non-empty and of equal length, got "
                         f"{len(sizes)} and {len(counts)}")
    for s, c in zip(sizes, counts, strict=True):
        if c < 1 or s % c:
            raise ValueError(f"each group's size must be a positive multiple of its count, "
                             f"got size {s} for count {c}")
    return _index(sizes, counts, str(torch.device(device)))


def per_matrix_absmax(region: torch.Tensor, index: torch.Tensor, matrices: int) -> torch.Tensor:
    """``[matrices]``: the largest absolute entry of each matrix of the 1-D ``region``
    (``index`` from :func:`matrix_index`); NaN where a matrix holds NaN. Exact, as a maximum
    is whatever order it is taken in: the same values as one ``amax`` per matrix.
    """
    out = torch.zeros(matrices, dtype=region.dtype, device=region.device)
    return out.scatter_reduce_(0, index, region.abs(), "amax", include_self=False)
