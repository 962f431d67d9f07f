"""Bin-mean quantisation: pure functions.

Each row of ``x[L, n]`` is cut into ``2**bits`` equal bins over ``[mean - spread * std,
mean + spread * std]`` (entries outside go to the first or last bin); an entry's code is its
bin, and the row's codebook holds, for every bin, the mean of the entries that fell in it (0
for an empty bin). Decoding looks each code up in the codebook. The codebook travels with the
codes, so a receiver decodes exactly what the sender decoded.

Every decoded entry is the mean of entries of its own bin, so its magnitude never exceeds the
row's largest magnitude: the error ``x - decoded`` is finite whenever ``x`` is (sums are taken
in float64, which cannot overflow on float32 input).

References:
    The quantiser of INTELLECT-1's 8-bit pseudo-gradient exchange (range mean +- 6 sigma) and
    of SparseLoCo's 2-bit values (Sarfi et al., 2025).
"""

from __future__ import annotations

import torch

__all__ = ["binmean_decode", "binmean_encode"]


def binmean_encode(x: torch.Tensor, bits: int, spread: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise every row of ``x[L, n]`` (``n >= 1``).

    Args:
        x: float values, one row per worker.
        bits: bits per code, 1 to 8 (``2**bits`` bins).
        spread: half-width of the binned range in standard deviations, > 0.

    Returns:
        ``(codebook, codes)``: float32 ``[L, 2**bits]`` and uint8 ``[L, n]``.
    """
    assert 1 <= bits <= 8, bits
    rows, numel = x.shape
    bins = 1 << bits
    x64 = x.to(torch.float64)
    mean = x64.mean(dim=1, keepdim=True)
    std = x64.std(dim=1, keepdim=True, correction=0)
    low = mean - spread * std
    width = (2 * spread * std) / bins
    # A constant row (std 0) has one value: everything lands in bin 0, whose mean it is.
    scaled = torch.where(width > 0, (x64 - low) / torch.where(width > 0, width, 1.0), 0.0)
    codes = scaled.floor().clamp_(0, bins - 1).to(torch.int64)
    sums = torch.zeros(rows, bins, dtype=torch.float64, device=x.device).scatter_add_(1, codes, x64)
    counts = torch.zeros(rows, bins, dtype=torch.float64, device=x.device).scatter_add_(
        1, codes, torch.ones_like(x64))
    codebook = torch.where(counts > 0, sums / counts.clamp(min=1), 0.0).to(torch.float32)
    return codebook, codes.to(torch.uint8)


def binmean_decode(codebook: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """``codebook[L, bins]``, ``codes[L, n]`` -> float32 ``[L, n]``: each code's bin mean.

    Raises:
        ValueError: a code names no bin of the codebook (a corrupt message).
    """
    codes64 = codes.to(torch.int64)
    if codes64.numel() and int(codes64.max()) >= codebook.shape[1]:
        raise ValueError(
            f"message codes must lie in [0, {codebook.shape[1] - 1}], got {int(codes64.max())}"
        )
    return torch.gather(codebook, 1, codes64)
