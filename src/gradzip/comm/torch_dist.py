"""A real ``torch.distributed`` process group (gloo or NCCL): one worker per process."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gradzip.comm.base import Collective

__all__ = ["ProcessGroupCollective", "default_collective"]


class ProcessGroupCollective(Collective):
    """Collectives over a ``torch.distributed`` process group.

    Every call is issued synchronously, in the same order on every rank. That ordering is what
    keeps multi-round algorithms (PowerSGD's two all-reduces, a size exchange before a padded
    all-gather) from deadlocking: nothing waits inside a ``Future.then()`` callback.

    Args:
        group: the process group; ``None`` means the default (world) group, which must be
            initialised.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "a process group is needed: call torch.distributed.init_process_group first, "
                "or pass a SimulatedGroup"
            )
        self.group = group
        super().__init__(
            world_size=dist.get_world_size(group),
            local_workers=1,
            first_rank=dist.get_rank(group),
        )

    def _sum(self, x: torch.Tensor) -> torch.Tensor:
        out = x[0].contiguous().clone()
        dist.all_reduce(out, group=self.group)
        return out

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        mine = x[0].contiguous()
        out = torch.empty((self.world_size, *mine.shape), dtype=mine.dtype, device=mine.device)
        # all_gather into a list works on every backend (gloo has no into-tensor variant for
        # all dtypes); the list entries are views of ``out``.
        dist.all_gather(list(out.unbind(0)), mine, group=self.group)
        return out

    def __repr__(self) -> str:
        backend = dist.get_backend(self.group)
        return f"ProcessGroupCollective(backend={backend!r}, world_size={self.world_size})"


def default_collective() -> Collective:
    """The world process group when one is initialised, else a group of one worker."""
    if dist.is_available() and dist.is_initialized():
        return ProcessGroupCollective()
    from gradzip.comm.simulated import SingleWorker

    return SingleWorker()
