"""Selection of entries to send: exact top-k, hard threshold, shared random-k."""

from __future__ import annotations

import torch

from gradzip.ops.random import generator_for

__all__ = ["index_dtype", "randk_indices", "threshold_select", "topk_abs"]

_INT32_MAX = 2**31 - 1


def index_dtype(numel: int) -> torch.dtype:
    """The narrowest index type that addresses ``numel`` entries (int32 where it fits)."""
    return torch.int32 if numel - 1 <= _INT32_MAX else torch.int64


def topk_abs(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-``k`` by magnitude along the last dimension.

    Candidates are first narrowed with a threshold estimated from a strided sample, so the
    expensive ``torch.topk`` runs on a small set; if the sample misjudges and fewer than ``k``
    candidates survive in some row, that row falls back to a full ``torch.topk``. The result
    is the same set of entries ``torch.topk`` would return (ties may be broken differently).

    Args:
        x: ``[L, n]`` values.
        k: entries to keep per row, ``1 <= k <= n``.

    Returns:
        ``(values, indices)``, each ``[L, k]``; values are the signed entries of ``x``.
    """
    rows, n = x.shape
    assert 1 <= k <= n, (k, n)
    mag = x.abs()
    if n < 65536 or k * 8 > n:
        idx = torch.topk(mag, k, dim=1, sorted=False).indices
        return torch.gather(x, 1, idx), idx
    # Estimate the k-th largest magnitude from a strided sample and keep a safety margin of
    # twice as many candidates as needed; exactness is restored by the fallback below.
    stride = max(1, n // 32768)
    sample = mag[:, ::stride]
    keep = min(sample.shape[1], max(1, (2 * k * sample.shape[1]) // n + 1))
    cut = torch.topk(sample, keep, dim=1, sorted=False).values.min(dim=1).values
    values_out = torch.empty(rows, k, dtype=x.dtype, device=x.device)
    index_out = torch.empty(rows, k, dtype=torch.int64, device=x.device)
    for row in range(rows):
        cand = torch.nonzero(mag[row] >= cut[row]).squeeze(1)
        if cand.numel() < k:
            idx = torch.topk(mag[row], k, sorted=False).indices
        else:
            sub = torch.topk(mag[row].index_select(0, cand), k, sorted=False).indices
            idx = cand.index_select(0, sub)
        index_out[row] = idx
        values_out[row] = x[row].index_select(0, idx)
    return values_out, index_out


def threshold_select(x: torch.Tensor, lam: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every entry with ``|x| >= lam``, per row; O(n), no sort.

    Args:
        x: ``[L, n]`` values.
        lam: the threshold (>= 0).

    Returns:
        ``(values, indices)``: lists of length ``L`` of 1-D tensors whose lengths vary by row.
    """
    values, indices = [], []
    for row in x:
        idx = torch.nonzero(row.abs() >= lam).squeeze(1)
        indices.append(idx)
        values.append(row.index_select(0, idx))
    return values, indices


def randk_indices(numel: int, k: int, *keys: object, device: torch.device | str = "cpu") -> torch.Tensor:
    """``k`` distinct indices in ``[0, numel)`` drawn from a generator seeded by ``keys``.

    Every worker that passes the same keys gets the same indices, which is what lets a random-k
    payload be summed by all-reduce.
    """
    assert 1 <= k <= numel, (k, numel)
    gen = generator_for(*keys)
    idx = torch.randperm(numel, generator=gen)[:k]
    return idx.sort().values.to(device)
