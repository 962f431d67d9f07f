"""The collective an overlapped exchange runs on: its own copy of the user's process group.

Why a copy: the order of collectives is per process group, across every thread of a
process. With ``overlap`` the exchange runs on a background thread while the user's inner
steps go on, and those may issue collectives of their own (a loss all-reduce for logging, a
barrier, ``SyncBatchNorm``). Were both threads to share one group, ranks could interleave
the two threads' calls differently and pair mismatched collectives: gloo aborts on a size
mismatch, or a barrier waits for a partner that is inside another collective until the
timeout. On its own group (same ranks in the same order, same backend and timeout) the
exchange's collectives pair only with each other.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gradzip.comm import Collective, ProcessGroupCollective

__all__ = ["exchange_collective"]


def _timeout(group: Any) -> Any:
    """The group's collective timeout (``None``: the backend's default)."""
    for device_type in ("cuda", "cpu"):
        try:
            return group._get_backend(torch.device(device_type)).options._timeout
        except Exception:  # noqa: BLE001 - no such backend, or a torch without it
            continue
    return None


def exchange_collective(comm: Collective) -> Collective:
    """The collective the background exchange uses: ``comm`` itself where every worker is
    in this process, else a :class:`~gradzip.comm.ProcessGroupCollective` over a new copy of
    its group.

    Every rank must call this at the same point (the copy is made by every member of the
    group): :class:`~gradzip.Outer` does at its first exchange, after the ranks' configuration
    check has confirmed that every rank overlaps.

    Raises:
        ValueError: ``comm`` is a collective of several processes that is not a
            :class:`~gradzip.comm.ProcessGroupCollective` (its group cannot be copied).
    """
    if comm.simulated or comm.world_size == 1:
        return comm
    if not isinstance(comm, ProcessGroupCollective):
        raise ValueError("`overlap` needs a SimulatedGroup or a ProcessGroupCollective (the "
                         "exchange runs on its own copy of the process group), got "
                         f"{type(comm).__name__}")
    parent = dist.group.WORLD if comm.group is None else comm.group
    ranks = dist.get_process_group_ranks(parent)
    kwargs: dict[str, Any] = {"timeout": _timeout(parent), "backend": dist.get_backend(parent),
                              # A subset's copy is made by its members alone.
                              "use_local_synchronization": len(ranks) != dist.get_world_size()}
    if ranks != sorted(ranks):
        kwargs["sort_ranks"] = False  # each rank keeps its position (its residuals' owner)
    group = dist.new_group(ranks, **kwargs)
    return ProcessGroupCollective(group, device=comm.device)
