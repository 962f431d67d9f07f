"""Outer-step training in the runner: every worker its own replica and inner optimizer,
synchronised by :class:`~gradzip.Outer` (simulated workers, or one per process)."""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
from torch import Tensor, nn

from gradzip.comm import Collective, ProcessGroupCollective, SimulatedGroup
from gradzip.compressors.base import Compressor
from gradzip.outer import Outer
from gradzip.train.steppers import to_device

__all__ = ["OuterStepper"]


def _like(optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s class and settings over ``model``'s parameters (the
    settings its constructor takes: ``defaults`` may hold more)."""
    accepted = inspect.signature(type(optimizer)).parameters
    settings = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return type(optimizer)(model.parameters(), **settings)


class OuterStepper:
    """The stepper of a run with ``outer_steps > 0`` (the interface of
    :class:`~gradzip.train.steppers.SimStepper`).

    Worker 0's replica is the loop's model (what it checkpoints); the others are copies.
    Evaluations see the workers' mean (:meth:`eval_model`). Each replica has an inner
    optimizer of the loop optimizer's kind and settings,
    following its learning rate; :meth:`step` runs it and leaves no gradient behind, so the
    loop's own optimizer step changes nothing.
    """

    def __init__(self, model: nn.Module, task: Any, compressor: Compressor, cfg: Any,
                 optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.model, self.task, self.device, self.cfg = model, task, device, cfg
        self.loop_optimizer = optimizer
        collective: Collective
        if cfg.launcher == "sim":
            self.dist = None
            collective = SimulatedGroup(cfg.workers)
            self.replicas = [model] + [copy.deepcopy(model) for _ in range(cfg.workers - 1)]
        else:
            import torch.distributed as dist

            self.dist = dist
            collective = ProcessGroupCollective()
            self.replicas = [model]
        self.world = collective.world_size
        self.local_ranks = collective.local_ranks
        self.inner = [_like(optimizer, r) for r in self.replicas]
        self._mean_model: nn.Module | None = None  # eval_model's copy, made at first use
        #: Whether the last :meth:`step` applied an exchange (the replicas are then equal).
        self.synced = False
        self.outer = Outer(
            self.replicas, compressor, inner_steps=cfg.outer_steps,
            outer_optimizer=cfg.outer_optimizer, outer_lr=cfg.outer_lr,
            outer_momentum=cfg.outer_momentum, fragments=cfg.fragments, delay=cfg.outer_delay,
            overlap=cfg.outer_delay > 0, collective=collective, inner_optimizers=self.inner,
            options=cfg.engine_options(),
        )

    def step(self, batches: list[list[Any]], carries: list[Any]) -> float:
        """One inner step of every local worker, then the outer loop's turn.

        Returns:
            The sum over local workers of their mean micro-batch losses.
        """
        lr = self.loop_optimizer.param_groups[0]["lr"]
        total = 0.0
        for w, (replica, opt) in enumerate(zip(self.replicas, self.inner, strict=True)):
            for group in opt.param_groups:
                group["lr"] = lr
            opt.zero_grad(set_to_none=True)
            for micro in batches[w]:
                loss, carries[w] = self.task.loss(replica, to_device(micro, self.device), carries[w])
                (loss / len(batches[w])).backward()
                total += float(loss.detach()) / len(batches[w])
            if self.cfg.clip:
                nn.utils.clip_grad_norm_(replica.parameters(), self.cfg.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
        self.synced = self.outer.step()
        return total

    @torch.no_grad()
    def eval_model(self) -> nn.Module:
        """What the loop evaluates: the workers' mean parameters (:meth:`Outer.consensus`)
        with worker 0's buffers, after :meth:`sync_buffers`.

        An evaluation between synchronisations (an epoch that ends mid-interval, the run's
        last one above all) would otherwise judge worker 0's own replica, a model no worker
        ends with. Right after a synchronisation the replicas are equal and this is the loop's
        model itself (24 bytes per worker checked it). Training is untouched: a checkpoint
        holds the replicas as they are, and a resumed run continues exactly. Every rank calls
        it at the same point (a collective in a process group).
        """
        mean = self.outer.consensus()
        params = dict(self.model.named_parameters())
        if all(torch.equal(params[n].detach(), v) for n, v in mean.items()):
            return self.model
        if self._mean_model is None:
            self._mean_model = copy.deepcopy(self.model)
        copy_model = self._mean_model
        copy_model.load_state_dict(self.model.state_dict())
        for name, p in copy_model.named_parameters():
            if name in mean:
                p.copy_(mean[name])
        copy_model.train(self.model.training)
        return copy_model

    @property
    def averaged(self) -> dict[str, Tensor]:
        return {}

    @property
    def stats(self) -> dict[str, Any]:
        return self.outer.stats

    @property
    def compressor_state(self) -> Any:
        return self.outer.engine.compressor_state

    def state_dict(self) -> dict[str, Any]:
        """The outer loop's state (with the inner optimizers') and the replicas other than
        the loop's model."""
        return {"outer": self.outer.state_dict(),
                "replicas": [r.state_dict() for r in self.replicas[1:]]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for replica, saved in zip(self.replicas[1:], state["replicas"], strict=True):
            replica.load_state_dict(saved)
        self.outer.load_state_dict(to_device(state["outer"], self.device))

    def compression_error(self) -> dict[str, float | None]:
        if self.dist is None:
            return self.outer.engine.compression_error()
        return self.outer.engine.compression_error(pool=self.all_sum)

    def _reduce(self, x: Tensor, op: Any) -> Tensor:
        if self.dist is None:
            return x
        y = x.to(self.device)
        self.dist.all_reduce(y, op=op)
        return y.cpu()

    def all_sum(self, x: Tensor) -> Tensor:
        return self._reduce(x, None if self.dist is None else self.dist.ReduceOp.SUM)

    def all_max(self, x: Tensor) -> Tensor:
        return self._reduce(x, None if self.dist is None else self.dist.ReduceOp.MAX)

    def sync_buffers(self) -> None:
        """Give every rank worker 0's buffers (BatchNorm statistics) before evaluating."""
        if self.dist is not None:
            for b in self.model.buffers():
                self.dist.broadcast(b, 0)
