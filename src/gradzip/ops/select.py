"""Selection of entries to send: exact top-k, hard threshold, shared random-k."""

from __future__ import annotations

import math

import numpy as np
import torch

from gradzip.ops import jit
from gradzip.ops.branches import cpu_form
from gradzip.ops.flat import to_device
from gradzip.ops.random import generator_for

__all__ = ["index_dtype", "randk_indices", "threshold_select", "threshold_split", "topk_abs"]

_INT32_MAX = 2**31 - 1


def index_dtype(numel: int) -> torch.dtype:
    """The narrowest index type that addresses ``numel`` entries (int32 where it fits)."""
    return torch.int32 if numel - 1 <= _INT32_MAX else torch.int64


# Large rows are scanned in chunks of this many entries: the magnitudes of one chunk (4 MiB)
# stay in cache, so a scan reads the row from memory once and allocates nothing of its size.
_CHUNK = 1 << 20
# On other devices than the CPU, each chunk is viewed as [_FOLD, m / _FOLD]; a column is
# searched only when its largest magnitude reaches the cut. At a density of 1%, about 8% of the columns are, so the slow
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
    # amax propagates NaN: a column holding one is searched too (the exact test is below).
    flagged = torch.nonzero(_reaches(grid.amax(dim=0), cut, True)).squeeze(1)
    if flagged.numel() * 4 > cols:  # dense: folding does not pay
        return torch.nonzero(_reaches(mag, cut, nan_too)).squeeze(1)
    # nonzero of a 2-D tensor is row-major, so r * cols + flagged[j] comes out ascending.
    pos = torch.nonzero(_reaches(grid.index_select(1, flagged), cut, nan_too))
    idx = pos[:, 0] * cols + flagged.index_select(0, pos[:, 1])
    if main < m:
        tail = torch.nonzero(_reaches(mag[main:], cut, nan_too)).squeeze(1) + main
        idx = torch.cat([idx, tail])
    return idx


def _true_positions(mask: np.ndarray) -> np.ndarray:
    """Ascending int64 positions of the true entries of a 1-D bool array.

    A sparse mask is read eight entries at a time (as 64-bit words): only the words that
    hold a true entry are expanded, so the per-entry search sees about a tenth of the mask at
    a density of 1%.
    """
    m = mask.shape[0]
    whole = m // 8 * 8
    if whole < 8192:
        return np.flatnonzero(mask)
    words = mask[:whole].view(np.uint64)
    hit = np.flatnonzero(words != 0)  # (NumPy's fast nonzero is the one for bool arrays)
    if hit.size * 4 > words.size:  # dense: reading by words does not pay
        return np.flatnonzero(mask)
    # The hit words' bytes are their 8 mask entries in order: byte f of the taken words is
    # entry hit[f // 8] * 8 + f % 8, ascending in f.
    found = np.flatnonzero(np.take(words, hit).view(np.bool_))
    idx = hit[found >> 3] * 8 + (found & 7)
    if whole < m:
        idx = np.concatenate([idx, np.flatnonzero(mask[whole:]) + whole])
    return idx


def _at_least_numpy(row: np.ndarray, cut: float, nan_too: bool) -> np.ndarray:
    """:func:`_at_least` for a CPU float row, through NumPy: its comparison and ``nonzero``
    kernels are several times faster than ATen's on CPU (one pass per chunk each)."""
    n = row.shape[0]
    size = min(n, _CHUNK)
    cut = row.dtype.type(cut)  # compare in the row's precision, as torch does
    mag = np.empty(size, dtype=row.dtype)
    mask = np.empty(size, dtype=np.bool_)
    found = []
    for start in range(0, n, size):
        part = row[start : start + size]
        m = part.shape[0]
        np.abs(part, out=mag[:m])
        if nan_too:
            np.less(mag[:m], cut, out=mask[:m])
            np.logical_not(mask[:m], out=mask[:m])
        else:
            np.greater_equal(mag[:m], cut, out=mask[:m])
        idx = _true_positions(mask[:m])
        found.append(idx + start if start else idx)
    return found[0] if len(found) == 1 else np.concatenate(found)


def _at_least(row: torch.Tensor, cut: float, nan_too: bool = False) -> torch.Tensor:
    """Indices (int64, ascending) of the entries of 1-D ``row`` with ``|row| >= cut`` (and NaN
    entries too with ``nan_too``); see :func:`_scan`."""
    return _scan(row, cut, nan_too)[0]


def _scan(
    row: torch.Tensor, cut: float, nan_too: bool = False, rest: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices, values)`` of the entries of 1-D ``row`` with ``|row| >= cut`` (and NaN
    entries too with ``nan_too``); indices int64 and ascending.

    With ``rest`` (a tensor like ``row``), also writes what is *not* selected into it: ``0``
    where selected, ``row`` elsewhere.
    """
    n = row.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.int64, device=row.device), row[:0]
    fast = cpu_form(row.device) and row.dtype in (torch.float32, torch.float64)
    if fast and cut > 0 and math.isfinite(cut):
        return _shrink_scan(row, cut, nan_too, rest)
    if fast:
        found = _at_least_numpy(row.detach().numpy(), cut, nan_too)
        idx = torch.from_numpy(found.astype(np.int64, copy=False))
    else:
        idx = _at_least_torch(row, cut, nan_too)
    values = row.index_select(0, idx)
    if rest is not None:
        rest.copy_(row).index_fill_(0, idx, 0.0)
    return idx, values


def _shrink_scan(
    row: torch.Tensor, cut: float, nan_too: bool, rest: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_scan` on the CPU for a positive cut, one chunk at a time.

    Both ways compare against ``below``, the largest float under the cut, so that
    ``|x| > below`` is exactly ``|x| >= cut``; NumPy finds the selected positions (its bool
    kernels beat ATen's several times on CPU), and values are read while the chunk is in cache.

    * Without ``rest``: ``hardshrink`` writes ``x`` where selected and 0 elsewhere into a
      scratch chunk that stays in cache; its nonzero entries are the selection.
    * With ``rest``: ``clamp`` to ``[-below, below]`` writes the chunk of ``rest`` itself,
      equal to ``x`` exactly where ``x`` is not selected, so the entries where it differs from
      ``x`` are the selection, and zeroing them finishes ``rest``. Main memory sees one read
      of ``x`` and one write of ``rest``, as a copy would.

    NaN counts as selected by both tests; it stays selected only with ``nan_too`` (otherwise
    it stays in ``rest``).
    """
    n = row.numel()
    size = min(n, _CHUNK)
    kind = np.float32 if row.dtype == torch.float32 else np.float64
    below = float(np.nextafter(kind(cut), kind(0)))
    if rest is not None and not nan_too and jit.enabled() and row.is_contiguous() and rest.is_contiguous():
        return _split_compiled(row.detach().numpy(), below, rest.numpy())
    scratch = torch.empty(size, dtype=row.dtype) if rest is None else None
    mask = np.empty(size, dtype=np.bool_)
    found, taken = [], []
    for start in range(0, n, size):
        part = row[start : start + size].detach()
        m = part.numel()
        if rest is None:
            out = scratch[:m]  # type: ignore[index]
            torch.ops.aten.hardshrink.out(part, below, out=out)
            source = out.numpy()
            np.not_equal(source, 0, out=mask[:m])
        else:
            out = rest[start : start + m]
            torch.clamp(part, -below, below, out=out)
            source = part.numpy()
            np.not_equal(out.numpy(), source, out=mask[:m])
        idx = _true_positions(mask[:m])
        values = source[idx]
        if not nan_too:
            bad = np.isnan(values)
            if bad.any():
                idx, values = idx[~bad], values[~bad]
        if rest is not None:
            out.numpy()[idx] = 0
        found.append(idx + start if start else idx)
        taken.append(values)
    if len(found) > 1:
        found, taken = [np.concatenate(found)], [np.concatenate(taken)]
    return torch.from_numpy(found[0].astype(np.int64, copy=False)), torch.from_numpy(taken[0])


def _split_compiled(row: np.ndarray, below: float, rest: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_shrink_scan` with ``rest`` and without ``nan_too``, through the compiled kernel:
    one pass per chunk writes the residual and collects the selection (same results)."""
    n = row.shape[0]
    size = min(n, _CHUNK)
    idx = np.empty(size, dtype=np.int64)
    val = np.empty(size, dtype=row.dtype)
    found, taken = [], []
    for start in range(0, n, size):
        stop = min(n, start + size)
        count = jit.threshold_split_chunk(row[start:stop], below, rest[start:stop], idx, val, start)
        found.append(idx[:count].copy())
        taken.append(val[:count].copy())
    if len(found) > 1:
        found, taken = [np.concatenate(found)], [np.concatenate(taken)]
    return torch.from_numpy(found[0]), torch.from_numpy(taken[0])


def _at_least_torch(row: torch.Tensor, cut: float, nan_too: bool) -> torch.Tensor:
    """:func:`_at_least` in torch operations (any device), folding chunks (see ``_FOLD``)."""
    n = row.numel()
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

    For large rows on the CPU, a threshold estimated from a strided sample of 32K magnitudes narrows the
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
    # On a GPU, torch.topk's radix selection is fast at any size and never makes the host
    # wait, while the narrowing pass below needs the cut and the candidates' count on the host
    # (two syncs per chunk, one per call for the cuts): small rows and GPUs go straight to it.
    if n < 65536 or k * 8 > n or not cpu_form(x.device):
        idx = torch.topk(x.abs(), k, dim=1, sorted=False).indices
        return torch.gather(x, 1, idx), idx
    return _topk_narrowed(x, k)


def _topk_narrowed(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`topk_abs` through a sampled cut and a chunked pass (any device; the CPU's way)."""
    rows, n = x.shape
    stride = max(1, n // 32768)
    sample = x[:, ::stride].abs()
    s = sample.shape[1]
    # The sample's j-th largest magnitude, with j the expected count of top-k entries in the
    # sample plus 10% plus four standard deviations: fewer than k candidates survive with
    # negligible probability when the sample is representative (about 1.3 k survive at 1%).
    expect = k * s / n
    keep = min(s, int(1.1 * expect + 4.0 * expect**0.5) + 1)
    if cpu_form(sample.device):  # NumPy's selection is several times faster here
        part = np.partition(sample.detach().numpy(), s - keep, axis=1)
        cuts = part[:, s - keep].tolist()
    else:
        cuts = torch.topk(sample, keep, dim=1, sorted=False).values.min(dim=1).values.tolist()
    values_out = torch.empty(rows, k, dtype=x.dtype, device=x.device)
    index_out = torch.empty(rows, k, dtype=torch.int64, device=x.device)
    for row in range(rows):
        cand, cand_values = _scan(x[row], cuts[row], nan_too=True)
        if cand.numel() < k:
            idx = torch.topk(x[row].abs(), k, sorted=False).indices
            torch.index_select(x[row], 0, idx, out=values_out[row])
        else:
            sub = torch.topk(cand_values.abs(), k, sorted=False).indices
            idx = cand.index_select(0, sub)
            torch.index_select(cand_values, 0, sub, out=values_out[row])
        index_out[row] = idx
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
        idx, val = _scan(row, lam)
        indices.append(idx)
        values.append(val)
    return values, indices


def threshold_split(
    x: torch.Tensor, lam: float
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """:func:`threshold_select`, plus, in the same pass, what each row leaves behind.

    Args:
        x: ``[L, n]`` values.
        lam: the threshold (>= 0).

    Returns:
        ``(values, indices, rest)``: as :func:`threshold_select`, and ``rest[L, n]`` holding
        ``0`` where ``|x| >= lam`` and ``x`` elsewhere: exactly ``x`` minus what the row's
        message decodes to, the error-feedback residual.
    """
    rest = torch.empty_like(x)
    values, indices = [], []
    for row, out in zip(x, rest, strict=True):
        idx, val = _scan(row, lam, rest=out)
        indices.append(idx)
        values.append(val)
    return values, indices, rest


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
        return to_device(idx.sort().values, device)
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
    return to_device(found, device)
