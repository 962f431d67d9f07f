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
        device: where collectives run. Tensors elsewhere travel through it and come back
            where they were: the engine builds small control messages (the non-finite flag,
            the configuration handshake, sparse sizes) on the CPU, and an NCCL group cannot
            reduce CPU tensors. Default: the current CUDA device for an NCCL group, else
            wherever each tensor already is.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
    """

    def __init__(
        self, group: dist.ProcessGroup | None = None, device: torch.device | str | None = None
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "a process group is needed: call torch.distributed.init_process_group first, "
                "or pass a SimulatedGroup"
            )
        self.group = group
        if device is None and dist.get_backend(group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = torch.device(device) if device is not None else None
        super().__init__(
            world_size=dist.get_world_size(group),
            local_workers=1,
            first_rank=dist.get_rank(group),
        )

    def _on_device(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.device is None or x.device == self.device else x.to(self.device)

    def _sum(self, x: torch.Tensor) -> torch.Tensor:
        out = self._on_device(x[0]).contiguous().clone()
        dist.all_reduce(out, group=self.group)
        return out.to(x.device)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        mine = self._on_device(x[0]).contiguous()
        out = torch.empty((self.world_size, *mine.shape), dtype=mine.dtype, device=mine.device)
        # all_gather into a list works on every backend (gloo has no into-tensor variant for
        # all dtypes); the list entries are views of ``out``.
        dist.all_gather(list(out.unbind(0)), mine, group=self.group)
        return out.to(x.device)

    def __repr__(self) -> str:
        backend = dist.get_backend(self.group)
        return f"ProcessGroupCollective(backend={backend!r}, world_size={self.world_size})"


def default_collective() -> Collective:
    """The world process group when one is initialised, else a group of one worker."""
    if dist.is_available() and dist.is_initialized():
        return ProcessGroupCollective()
    from gradzip.comm.simulated import SingleWorker

    return SingleWorker()
