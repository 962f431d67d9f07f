"""Finiteness tests of tensors: which workers' rows hold NaN or Inf.

Pure functions shared by compressors (PowerSGD's leftover test) and the engine (the
non-finite policy); one ``aminmax`` pass per tensor, never an elementwise mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gradzip.ops.branches import cpu_form
from gradzip.ops.flat import cat_flat

__all__ = ["all_finite", "bad_workers", "extremes_test", "finite_rows"]


def extremes_test(x: torch.Tensor) -> torch.Tensor:
    """0-d float on ``x``'s device: ``0`` where every entry of ``x`` (not empty) is finite,
    NaN otherwise; one pass over ``x`` and a few ops on numbers, no host read.

    NaN and Inf propagate into the minimum or the maximum; ``v - v`` is 0 for a finite ``v``
    and NaN for NaN or an infinity, never an overflow, so the sum of the two differences is
    NaN exactly when an extreme is not finite.
    """
    if not cpu_form(x.device):
        # Off the CPU: the largest magnitude (one fused reduction that propagates NaN, and
        # an infinity is its own largest magnitude) times zero, two ops. On the CPU that
        # reduction is not vectorised (about 20 times slower than ``aminmax``).
        return torch.linalg.vector_norm(x, float("inf")).mul(0)
    low, high = torch.aminmax(x)
    return low.sub(low).add_(high.sub(high))


def finite_rows(tensors: Sequence[torch.Tensor], workers: int) -> torch.Tensor:
    """``[L]`` bool, on the tensors' device: whether every entry of worker ``w``'s part of
    every tensor (each ``[L, ...]``) is finite. No host synchronisation.

    One ``aminmax`` pass per tensor: NaN and Inf propagate into the minimum or the maximum,
    and, unlike a sum, they never overflow, so a huge but finite tensor is never mistaken for
    a non-finite one and no second, elementwise pass is needed.

    Args:
        tensors: tensors of shape ``[workers, ...]``.
        workers: the number of rows (local workers).

    Returns:
        A ``[workers]`` bool tensor.
    """
    device = tensors[0].device if tensors else torch.device("cpu")
    filled = [t for t in tensors if t.numel()]
    if workers == 1 and len(filled) == 1:
        # One row (a real process group): one test of the whole tensor, five ops.
        return extremes_test(filled[0]).eq(0).reshape(1)
    ok = torch.ones(workers, dtype=torch.bool, device=device)
    if cpu_form(device):
        # On the CPU a reduction along ``dim=1`` takes a slow, unvectorised path (an order of
        # magnitude behind a whole-tensor reduction of the same row); reduce each row whole
        # and test every extreme at once.
        extremes = [e for t in tensors if t.numel() for row in t.reshape(workers, -1)
                    for e in torch.aminmax(row)]
        if extremes:
            ok &= torch.isfinite(torch.stack(extremes)).reshape(-1, workers, 2).all(dim=2).all(dim=0)
        return ok
    for t in tensors:
        rows = t.reshape(workers, -1)
        if rows.shape[1] == 0:
            continue
        low, high = torch.aminmax(rows, dim=1)
        ok &= torch.isfinite(low) & torch.isfinite(high)
    return ok


def bad_workers(tensors: Sequence[torch.Tensor], workers: int) -> list[bool]:
    """Per local worker, whether any of ``tensors`` (each ``[L, ...]``) holds NaN or Inf
    (one host read for all of them)."""
    if not tensors:
        return [False] * workers
    return [not ok for ok in finite_rows(tensors, workers).tolist()]


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every entry of every tensor is finite (one host read for all of them; one
    test over their concatenation, a few ops whatever the number of tensors)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_device.setdefault(t.device, []).append(t)
    for group in by_device.values():  # one device but where state was moved off it
        whole = group[0] if len(group) == 1 else cat_flat(group)
        if not bool(extremes_test(whole).eq(0)):
            return False
    return True
