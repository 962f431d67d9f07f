"""Error feedback: what a worker did not send is added to its next gradient.

Invariant, per worker and per tensor: ``compensated == decoded + residual`` where ``decoded`` is
what that worker's own message decodes to. The residual is computed as
``compensated - decoded`` in fp32, so the identity holds to the last bit wherever the decoder
reproduces entries exactly (sparsifiers send entries unchanged) and to float rounding
otherwise (low rank, quantisation). A sparsifier may hand the residual over directly
(``Job.residual``: the compensated tensor with the sent entries zeroed, which equals
``compensated - decoded`` bit for bit) and skip building the dense decoded message.

References:
    Seide et al., "1-bit SGD", 2014; Stich et al., "Sparsified SGD with Memory", NeurIPS 2018;
    Karimireddy et al., "Error Feedback Fixes SignSGD", ICML 2019.
"""

from __future__ import annotations

import torch

__all__ = ["compensate", "residual_after"]


def compensate(grad: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """``grad + residual`` in fp32 (a new tensor; neither input is modified)."""
    grad32 = grad.to(torch.float32)
    if residual is None:
        return grad32.clone() if grad32 is grad else grad32
    return grad32 + residual


def residual_after(compensated: torch.Tensor, decoded: torch.Tensor) -> torch.Tensor:
    """What stays behind: ``compensated - decoded`` (fp32)."""
    return compensated - decoded
