"""The workers' mean parameters, checked cheaply first.

Two uses: per-step training switching to outer steps (the anchor must be the same on every
worker, and per-step training nearly always left the replicas equal already), and an
outer-step run evaluated or kept between synchronisations (each worker has trained its own
replica since the last one; the model the workers agree on is their mean, not worker 0's).

Both exchange a 24-byte :func:`parameter_digest` per worker first and send the dense fp32
parameters only where two digests differ (:func:`agree_on_parameters`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from gradzip.comm import Collective

__all__ = ["agree_on_parameters", "parameter_digest", "replicas_equal"]


def parameter_digest(rows: Tensor) -> Tensor:
    """``[L, n]`` -> ``[L, 3]`` float64: each row's sum, sum of squares and sum weighted by
    position (1, 2, ..., n). Equal rows give equal digests bit for bit (the same ops on the
    same values); a row that differs in any entry almost surely changes one of the three."""
    x = rows.to(torch.float64)
    weights = torch.arange(1, x.shape[1] + 1, dtype=torch.float64, device=x.device)
    return torch.stack([x.sum(dim=1), (x * x).sum(dim=1), (x * weights).sum(dim=1)], dim=1)


def replicas_equal(rows: Tensor, comm: Collective) -> bool:
    """Whether every worker holds the same ``rows`` (``[L, n]``, each local worker's
    flattened values), from one all-gathered 24-byte :func:`parameter_digest` per worker.
    Every worker receives the same digests, so all return the same answer."""
    digests = comm.all_gather(parameter_digest(rows))
    return bool((digests == digests[0]).all())


def agree_on_parameters(rows: Tensor, comm: Collective) -> Tensor | None:
    """Whether every worker holds the same parameters, and their mean where they do not.

    Each worker's :func:`parameter_digest` (24 bytes) is all-gathered; only where two workers'
    digests differ is the dense fp32 mean all-reduced. Every worker receives the same
    digests, so all take the same branch.

    Args:
        rows: ``[L, n]``, the flattened fp32 parameters of each local worker.
        comm: the workers' collective (its meter counts both messages).

    Returns:
        The mean ``[n]`` where the replicas differed, else ``None`` (nothing to change).
    """
    if replicas_equal(rows, comm):
        return None
    # Added in rank order on every backend (gloo's ring adds in another order from three
    # workers on), so the simulator and a process group agree on the mean bit for bit.
    return comm.all_reduce_ordered(rows) / comm.world_size
