"""Low-rank helpers for PowerSGD."""

from __future__ import annotations

import torch

__all__ = ["orthogonalize"]


def orthogonalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning the columns of ``p`` (batched over leading dims).

    Uses a reduced QR decomposition (a normalisation for one column). A zero ``p`` (a zero
    gradient) comes back as unit vectors rather than NaN or zero, so a warm-started power
    iteration recovers as soon as the gradient is non-zero again.

    Args:
        p: ``[..., n, r]`` with ``r <= n``.

    Returns:
        ``[..., n, r]`` with orthonormal columns.
    """
    if p.shape[-1] == 1:
        norm = p.norm(dim=-2, keepdim=True)
        unit = torch.zeros_like(p)
        unit[..., 0, :] = 1.0
        return torch.where(norm > 0, p / torch.where(norm > 0, norm, 1.0), unit)
    q, _ = torch.linalg.qr(p, mode="reduced")
    return q
