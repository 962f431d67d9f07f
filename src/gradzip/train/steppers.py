"""The two ways a training run averages gradients, behind one interface.

:class:`SimStepper` holds every worker in this process (an :class:`~gradzip.Engine` over a
:class:`~gradzip.SimulatedGroup`); :class:`DDPStepper` is one worker of a real process group
(``DistributedDataParallel`` with the gradzip comm hook). Both offer ``step`` (leave the
averaged gradient in ``.grad``), ``stats``, ``compressor_state``, ``state_dict`` /
``load_state_dict``, ``all_sum`` / ``all_max`` over workers and ``sync_buffers``, which is
all :class:`~gradzip.train.loop.TrainLoop` uses.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch
from torch import Tensor, nn

from gradzip import ddp as gradzip_ddp
from gradzip.comm.simulated import SimulatedGroup
from gradzip.comm.torch_dist import ProcessGroupCollective
from gradzip.compressors.base import Compressor
from gradzip.engine import Engine
from gradzip.outer.consensus import replicas_equal

__all__ = ["DDPStepper", "SimStepper", "to_device"]


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` (a tensor, or tuples, lists and dicts of them) moved to ``device``."""
    if isinstance(batch, Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


#: Whether this torch's DDP can be built without its broadcast (``init_sync``, torch >= 2.4).
_CAN_SKIP_INIT_SYNC = "init_sync" in inspect.signature(
    torch.nn.parallel.DistributedDataParallel.__init__).parameters


def _replicas_equal(model: nn.Module) -> bool:
    """Whether every process holds the same parameters and buffers as this one
    (:func:`~gradzip.outer.consensus.replicas_equal`: a 24-byte digest each, all-gathered)."""
    states = [t.detach().reshape(-1).to(torch.float64)
              for t in (*model.parameters(), *model.buffers())]
    if not states:
        return True
    return replicas_equal(torch.cat(states)[None], ProcessGroupCollective())


class SimStepper:
    """All workers in one process; one model replica receives the averaged gradient."""

    def __init__(self, model: nn.Module, task: Any, compressor: Compressor, cfg: Any,
                 optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.model, self.task, self.device = model, task, device
        self.world = cfg.workers
        self.local_ranks = list(range(self.world))
        self.engine = Engine(model, compressor, collective=SimulatedGroup(self.world),
                             options=cfg.engine_options(optimizer))
        self.params = dict(self.engine.params)
        self.buffers = list(model.buffers())
        self.averaged: dict[str, Tensor] = {}

    def step(self, batches: list[list[Any]], carries: list[Any]) -> float:
        """Compute every worker's gradient, average them, leave the average in ``.grad``.

        Args:
            batches: per worker, the micro-batches of this step (their gradients are averaged
                locally before the one communication round).
            carries: per worker, the task's carried state (updated in place).

        Returns:
            The sum over workers of their mean micro-batch losses.
        """
        saved = [b.clone() for b in self.buffers]
        grads: dict[str, list[Tensor]] = {n: [] for n in self.params}
        total = 0.0
        # Worker 0 runs last, from the pre-step buffers, so BatchNorm running statistics end
        # up as worker 0's, which is what DDP's buffer broadcast keeps.
        for w in reversed(range(self.world)):
            if w != self.world - 1:
                for b, s in zip(self.buffers, saved, strict=True):
                    b.copy_(s)
            for p in self.params.values():
                p.grad = None
            for micro in batches[w]:
                loss, carries[w] = self.task.loss(self.model, to_device(micro, self.device), carries[w])
                (loss / len(batches[w])).backward()
                total += float(loss.detach()) / len(batches[w])
            for n, p in self.params.items():
                grads[n].append(p.grad if p.grad is not None else torch.zeros_like(p))
        stacked = {n: torch.stack(g[::-1]) for n, g in grads.items()}
        # same_layout: every worker is in this process, so the layout is the same by
        # construction, and the messages (bytes included) are those of the procs launcher's
        # DDP hook, where the call header rides in the payload.
        self.averaged = self.engine.reduce(stacked, same_layout=True)
        for n, avg in self.averaged.items():
            self.params[n].grad = avg
        return total

    @property
    def stats(self) -> dict[str, Any]:
        return self.engine.stats

    @property
    def compressor_state(self) -> Any:
        return self.engine.compressor_state

    def state_dict(self) -> dict[str, Any]:
        """Every simulated worker's gradzip state (one engine holds them all)."""
        return self.engine.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Checkpoints are read onto the CPU; residuals and warm starts live with the model.
        self.engine.load_state_dict(to_device(state, self.device))

    def compression_error(self) -> dict[str, float | None]:
        """The relative compression error since the last call, over every simulated worker
        (see :mod:`gradzip.engine.error`)."""
        return self.engine.compression_error()

    def all_sum(self, x: Tensor) -> Tensor:
        return x

    def all_max(self, x: Tensor) -> Tensor:
        return x

    def sync_buffers(self) -> None:
        """Nothing to do: one replica."""


class DDPStepper:
    """One worker of a ``torch.distributed`` group: DDP with the gradzip comm hook."""

    def __init__(self, model: nn.Module, task: Any, compressor: Compressor, cfg: Any,
                 optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        self.dist = dist
        self.model, self.task, self.device = model, task, device
        self.world = dist.get_world_size()
        self.local_ranks = [dist.get_rank()]
        ids = [device.index] if device.type == "cuda" else None
        # DDP broadcasts rank 0's parameters and buffers when it is built: a whole model over
        # the link before the first step (4-5 s of a run at 10 Mbit/s in the outer-step
        # race). Every rank built its replica from the same seed, so they are nearly always
        # equal already: a 24-byte digest per rank says whether, and DDP's broadcast runs
        # only where they differ (its shape check with it).
        # (The constant first: where torch cannot skip the broadcast, no digest is sent.)
        self.synced_at_start = not _CAN_SKIP_INIT_SYNC or not _replicas_equal(model)
        skip = {} if self.synced_at_start else {"init_sync": False}
        # Buffers (BatchNorm statistics) follow rank 0 at every forward: DDP's default.
        self.ddp = DistributedDataParallel(model, device_ids=ids, **skip)
        self.hook = gradzip_ddp.register(self.ddp, compressor,
                                         options=cfg.engine_options(optimizer))

    def step(self, batches: list[list[Any]], carries: list[Any]) -> float:
        for p in self.model.parameters():
            p.grad = None
        micro, total = batches[0], 0.0
        for i, batch in enumerate(micro):
            # Local accumulation: only the last micro-batch's backward communicates.
            sync = contextlib.nullcontext() if i == len(micro) - 1 else self.ddp.no_sync()
            with sync:
                loss, carries[0] = self.task.loss(self.ddp, to_device(batch, self.device), carries[0])
                (loss / len(micro)).backward()  # the hook leaves the average in .grad
            total += float(loss.detach()) / len(micro)
        return total

    @property
    def averaged(self) -> dict[str, Tensor]:
        return {n: p.grad for n, p in self.model.named_parameters() if p.grad is not None}

    @property
    def stats(self) -> dict[str, Any]:
        # The hook reports this rank's counters as numbers; the loop expects per-worker lists.
        return {k: ([v] if k.endswith("_bytes") else v) for k, v in self.hook.stats.items()}

    @property
    def engine(self) -> Any:
        """The hook's engine (``None`` until it exists)."""
        return getattr(self.hook, "engine", None)

    @property
    def compressor_state(self) -> Any:
        return getattr(self.engine, "compressor_state", None)

    def state_dict(self) -> dict[str, Any]:
        """This rank's gradzip state (residuals are per rank)."""
        return self.hook.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.hook.load_state_dict(state)

    def compression_error(self) -> dict[str, float | None]:
        """The relative compression error since the last call, over every rank's worker
        (see :mod:`gradzip.engine.error`; a collective: every rank calls it)."""
        return self.hook.engine.compression_error(pool=self.all_sum)

    def _reduce(self, x: Tensor, op: Any) -> Tensor:
        y = x.to(self.device)
        self.dist.all_reduce(y, op=op)
        return y.cpu()

    def all_sum(self, x: Tensor) -> Tensor:
        return self._reduce(x, self.dist.ReduceOp.SUM)

    def all_max(self, x: Tensor) -> Tensor:
        return self._reduce(x, self.dist.ReduceOp.MAX)

    def sync_buffers(self) -> None:
        """Give every rank worker 0's BatchNorm statistics before evaluating."""
        for b in self.model.buffers():
            self.dist.broadcast(b, 0)
