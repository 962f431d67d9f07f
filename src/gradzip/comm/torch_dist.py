"""A real ``torch.distributed`` process group (gloo or NCCL): one worker per process."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from gradzip._validate import check_real
from gradzip.comm.base import Collective, allreduce_wire_bytes

__all__ = ["ProcessGroupCollective", "default_collective", "shutdown_process_group"]


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

    def all_reduce_(self, flat: torch.Tensor) -> None:
        """:meth:`Collective.all_reduce_`, without the copies of :meth:`all_reduce` where
        ``flat`` is contiguous and already where collectives run."""
        if not (flat.dim() == 1 and flat.is_contiguous() and self._on_device(flat) is flat):
            super().all_reduce_(flat)
            return
        nbytes = flat.numel() * flat.element_size()
        self.meter.add([nbytes], [allreduce_wire_bytes(nbytes, self.world_size)])
        if self.world_size > 1:
            dist.all_reduce(flat, group=self.group)

    def _exchange(self, x: torch.Tensor) -> torch.Tensor:
        mine = self._on_device(x[0]).contiguous()
        out = torch.empty_like(mine)
        dist.all_to_all_single(out, mine, group=self.group)  # part j to rank j, row i from rank i
        return out.to(x.device)[None]

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


def shutdown_process_group(*, settle_s: float = 0.1) -> None:
    """Leave the default process group together and destroy it, for the end of a script.

    Every rank must call it. Ranks meet at a barrier, then release the interpreter lock for
    ``settle_s`` seconds before ``destroy_process_group``. The pause is for gloo: its worker
    threads drop the tensors of a finished collective a moment after the caller's ``wait``
    returns, and dropping a tensor that Python also knew needs the interpreter lock. A script
    that exits within that moment (a last ``all_reduce``, a checkpoint gather, then ``exit``)
    can abort one rank with ``terminate called without an active exception`` after all its
    work is done; ``destroy_process_group`` alone does not stop those threads while the
    model or the hook still hold the group. Does nothing when no group is initialised.

    Args:
        settle_s: seconds to pause between the barrier and the teardown, ``>= 0``.
    """
    settle_s = check_real("settle_s", settle_s, low=0.0)
    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.barrier()
    time.sleep(settle_s)  # releases the interpreter lock to the worker threads
    dist.destroy_process_group()
