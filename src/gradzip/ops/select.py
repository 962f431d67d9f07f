"""Selection of entries to send: exact top-k, hard threshold, shared random-k."""

from __future__ import annotations

import math

import torch

from gradzip.ops.random import generator_for

__all__ = ["index_dtype", "randk_indices", "threshold_select", "threshold_split", "topk_abs"]

_INT32_MAX = 2**31 - 1


def index_dtype(numel: int) -> torch.dtype:
    """The narrowest index type that addresses ``numel`` entries (int32 where it fits)."""
    return torch.int32 if numel - 1 <= _INT32_MAX else torch.int64


# Large rows are scanned in chunks of this many entries: the magnitudes of one chunk (4 MiB)
# stay in cache, so a scan reads the row from memory once and allocates nothing of its size.
_CHUNK = 1 << 20
# Each chunk is viewed as [_FOLD, m / _FOLD]; a column is searched only when its largest
# magnitude reaches the cut. At a density of 1%, about 8% of the columns are, so the slow
# per-entry search (``nonzero``) sees about a fifth of the entries.
_FOLD = 8


def _reaches(mag: torch.Tensor, cut: float, nan_too: bool) -> torch.Tensor:
    """``mag >= cut``; with ``nan_too``, NaN counts as reaching every cut (as in ``torch.topk``,
    which ranks NaN above everything)."""
    return torch.lt(mag, cut).logical_not_() if nan_too else torch.ge(mag, cut)


def _hits(mag: torch.Tensor, cut: float, nan_too: bool) -> torch.Tensor:
    """Ascending int64 positions of ``mag >= cut`` in a 1-D tensor of magnitudes."""
    m = mag.numel()
    cols = m // _FOLD
    if cols < 1024:
        return torch.nonzero(_reaches(mag, cut, nan_too)).squeeze(1)
    main = cols * _FOLD
    grid = mag[:main].view(_FOLD, cols)
    flagged = torch.nonzero(_reaches(grid.amax(dim=0), cut, nan_too)).squeeze(1)
    if flagged.numel() * 4 > cols:  # dense: folding does not pay
        return torch.nonzero(_reaches(mag, cut, nan_too)).squeeze(1)
    # nonzero of a 2-D tensor is row-major, so r * cols + flagged[j] comes out ascending.
    pos = torch.nonzero(_reaches(grid.index_select(1, flagged), cut, nan_too))
    idx = pos[:, 0] * cols + flagged.index_select(0, pos[:, 1])
    if main < m:
        tail = torch.nonzero(_reaches(mag[main:], cut, nan_too)).squeeze(1) + main
        idx = torch.cat([idx, tail])
    return idx


def _at_least(row: torch.Tensor, cut: float, nan_too: bool = False) -> torch.Tensor:
    """Indices (int64, ascending) of the entries of 1-D ``row`` with ``|row| >= cut`` (and NaN
    entries too with ``nan_too``)."""
    n = row.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.int64, device=row.device)
    size = min(n, _CHUNK)
    mag = torch.empty(size, dtype=row.dtype, device=row.device)
    found = []
    for start in range(0, n, size):
        part = row[start : start + size]
        m = part.numel()
        idx = _hits(torch.abs(part, out=mag[:m]), cut, nan_too)
        found.append(idx + start if start else idx)
    return found[0] if len(found) == 1 else torch.cat(found)


def topk_abs(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-``k`` by magnitude along the last dimension.

    For large rows, a threshold estimated from a strided sample of 32K magnitudes narrows the
    row to about ``1.3 k`` candidates in one chunked pass (no sort, nothing of the row's size
    allocated), and ``torch.topk`` runs on the candidates only. Every entry left out is smaller
    than every candidate, so when at least ``k`` candidates survive the result is exact; in the
    rare row where fewer survive (the sample misjudged), that row falls back to a full
    ``torch.topk``. The result is the same set of entries ``torch.topk`` would return (ties may
    be broken differently).

    Args:
        x: ``[L, n]`` values.
        k: entries to keep per row, ``1 <= k <= n``.

    Returns:
        ``(values, indices)``, each ``[L, k]``; values are the signed entries of ``x``, indices
        int64.
    """
    rows, n = x.shape
    assert 1 <= k <= n, (k, n)
    if n < 65536 or k * 8 > n:
        idx = torch.topk(x.abs(), k, dim=1, sorted=False).indices
        return torch.gather(x, 1, idx), idx
    stride = max(1, n // 32768)
    sample = x[:, ::stride].abs()
    s = sample.shape[1]
    # The sample's j-th largest magnitude, with j the expected count of top-k entries in the
    # sample plus 10% plus four standard deviations: fewer than k candidates survive with
    # negligible probability when the sample is representative (about 1.3 k survive at 1%).
    expect = k * s / n
    keep = min(s, int(1.1 * expect + 4.0 * expect**0.5) + 1)
    cuts = torch.topk(sample, keep, dim=1, sorted=False).values.min(dim=1).values.tolist()
    values_out = torch.empty(rows, k, dtype=x.dtype, device=x.device)
    index_out = torch.empty(rows, k, dtype=torch.int64, device=x.device)
    for row in range(rows):
        cand = _at_least(x[row], cuts[row], nan_too=True)
        if cand.numel() < k:
            idx = torch.topk(x[row].abs(), k, sorted=False).indices
        else:
            sub = torch.topk(x[row].index_select(0, cand).abs_(), k, sorted=False).indices
            idx = cand.index_select(0, sub)
        index_out[row] = idx
        torch.index_select(x[row], 0, idx, out=values_out[row])
    return values_out, index_out


def threshold_select(x: torch.Tensor, lam: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every entry with ``|x| >= lam``, per row; O(n), no sort.

    Args:
        x: ``[L, n]`` values.
        lam: the threshold (>= 0).

    Returns:
        ``(values, indices)``: lists of length ``L`` of 1-D tensors whose lengths vary by row;
        indices are int64 and ascending.
    """
    values, indices = [], []
    for row in x:
        idx = _at_least(row, lam)
        indices.append(idx)
        values.append(row.index_select(0, idx))
    return values, indices


def threshold_split(
    x: torch.Tensor, lam: float
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """:func:`threshold_select`, plus the dense tensor of what is kept.

    Args:
        x: ``[L, n]`` values.
        lam: the threshold (> 0).

    Returns:
        ``(values, indices, kept)``: as :func:`threshold_select`, and ``kept[L, n]`` holding
        ``x`` where ``|x| >= lam`` and ``0`` elsewhere (what the row's message decodes to).
    """
    values, indices = threshold_select(x, lam)
    kept = torch.zeros_like(x)
    for out, idx, val in zip(kept, indices, values, strict=True):
        out.index_copy_(0, idx, val)
    return values, indices, kept


def randk_indices(numel: int, k: int, *keys: object, device: torch.device | str = "cpu") -> torch.Tensor:
    """``k`` distinct indices in ``[0, numel)``, ascending, drawn from a generator seeded by
    ``keys``: a uniformly random ``k``-subset.

    Every worker that passes the same keys gets the same indices, which is what lets a random-k
    payload be summed by all-reduce.

    For ``k`` up to a quarter of ``numel`` it costs ``O(k log k)``, not ``O(numel)``: a little
    more than ``k`` positions are drawn with replacement and deduplicated (given their number,
    the distinct positions are a uniform subset), then ``k`` of them are kept at random (a
    uniform subset of a uniform subset is uniform). A draw with fewer than ``k`` distinct
    positions is discarded and made again, larger. Denser draws take a random permutation.
    """
    assert 1 <= k <= numel, (k, numel)
    gen = generator_for(*keys)
    if k * 4 > numel or numel < 4096:
        idx = torch.randperm(numel, generator=gen)[:k]
        return idx.sort().values.to(device)
    # Draws whose expected number of distinct values is k, plus a margin of several standard
    # deviations, so a redraw is rare.
    draws = int(-numel * math.log1p(-k / numel)) + 8 * math.isqrt(k) + 64
    while True:
        found = torch.unique(torch.randint(numel, (draws,), generator=gen))  # sorted
        if found.numel() >= k:
            break
        draws *= 2
    if found.numel() > k:
        keep = torch.randperm(found.numel(), generator=gen)[:k].sort().values
        found = found.index_select(0, keep)
    return found.to(device)
