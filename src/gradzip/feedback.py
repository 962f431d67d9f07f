"""Error feedback: what a worker did not send is added to its next gradient.

Invariant, per worker and per tensor: ``compensated == decoded + residual`` where ``decoded`` is
what that worker's own message decodes to. The residual is computed as
``compensated - decoded`` in fp32, so the identity holds to the last bit wherever the decoder
reproduces entries exactly (sparsifiers send entries unchanged) and to float rounding
otherwise (low rank, quantisation). A sparsifier may compute the residual directly
(:func:`residual_unsent`: the compensated tensor with the sent entries zeroed, which equals
``compensated - decoded`` bit for bit) and skip building the dense decoded message. Either
way the residual is recorded on the job by :meth:`~gradzip.compressors.base.Job.keep`.

References:
    Seide et al., "1-bit SGD", 2014; Stich et al., "Sparsified SGD with Memory", NeurIPS 2018;
    Karimireddy et al., "Error Feedback Fixes SignSGD", ICML 2019.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["as_fp32", "compensate", "residual_after", "residual_unsent"]


def as_fp32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32: itself when it is already (no dispatch at all: on a GPU even a no-op
    ``.to`` costs host time per tensor), else a converted copy."""
    return x if x.dtype == torch.float32 else x.to(torch.float32)


def compensate(grad: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """``grad + residual`` in fp32 (a new tensor; neither input is modified)."""
    grad32 = as_fp32(grad)
    if residual is None:
        return grad32.clone() if grad32 is grad else grad32
    return grad32 + residual


def residual_after(compensated: torch.Tensor, decoded: torch.Tensor) -> torch.Tensor:
    """What stays behind: ``compensated - decoded`` (fp32)."""
    return compensated - decoded


def residual_unsent(compensated: torch.Tensor, sent: Sequence[torch.Tensor]) -> torch.Tensor:
    """What a sparsifier's worker keeps: ``compensated`` ``[L, *shape]`` (fp32) with, for each
    local worker ``w``, the entries at the flat indices ``sent[w]`` zeroed (a new tensor).

    Sparsifiers send entries unchanged, so this is ``compensated - decoded`` bit for bit,
    without building ``decoded``.
    """
    workers = compensated.shape[0]
    rest = compensated.reshape(workers, -1).clone()
    for w in range(workers):
        rest[w].index_fill_(0, sent[w].to(rest.device), 0.0)
    return rest.reshape(compensated.shape)
