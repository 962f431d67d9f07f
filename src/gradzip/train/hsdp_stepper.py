"""The runner's steppers under ``--hsdp REPLICAS``: the model ``fully_shard``-ed inside islands
of ``workers / REPLICAS`` processes, the exchange across islands through gradzip; and under
``--fsdp``: the model sharded over every worker, FSDP2's reduce-scatter through gradzip.

:class:`HSDPStepper` averages every step's gradient (:func:`gradzip.fsdp.register`: FSDP2's
reduce-scatter inside the island, the compressed exchange across replicas; under ``--fsdp``
:func:`gradzip.fsdp.register_reduce_scatter`: the compressed reduce-scatter);
:class:`ShardedOuterStepper` runs outer-step training (:class:`~gradzip.ShardedOuter`: inner
steps inside the island, pseudo-gradient shards exchanged across replicas). Both offer the
interface of :class:`~gradzip.train.steppers.DDPStepper`, plus :meth:`eval_model`.

The runner shards each model as one FSDP2 parameter group (``fully_shard`` on the root): its
tasks' models are small, and one group works for every one of them. Evaluation runs on an
unsharded copy (:meth:`HSDPStepper.eval_model`): a sharded model's forward is a collective
of its island, and the ranks' test shards may need different numbers of batches.

Imported by the training loop only when ``hsdp`` is set (torch's FSDP2 is slow to import).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from gradzip import fsdp as gradzip_fsdp
from gradzip.compressors.base import Compressor
from gradzip.outer.sharded import ShardedOuter
from gradzip.train.outer_stepper import OuterStepper, _like
from gradzip.train.steppers import DDPStepper, to_device

__all__ = ["HSDPStepper", "ShardedOuterStepper", "shard_model"]


def shard_model(model: nn.Module, cfg: Any, device: torch.device,
                optimizer: torch.optim.Optimizer | None = None) -> tuple[DeviceMesh, nn.Module]:
    """Build the ``(hsdp, workers / hsdp)`` mesh and ``fully_shard`` the model on its shard
    dimension, or under ``fsdp`` the 1-D mesh of every worker and the model sharded on it
    (every rank calls this at the same point: the mesh's groups are collectives).

    Args:
        model: the loop's model (sharded in place).
        cfg: the run's configuration (``hsdp``, ``fsdp``, ``workers``).
        device: where the model lives.
        optimizer: the loop's optimizer, re-pointed at the sharded parameters (FSDP2 replaces
            every parameter with a DTensor one), or ``None``.

    Returns:
        ``(mesh, unsharded copy of the model)``: the copy is what evaluation runs on.
    """
    if cfg.fsdp:
        mesh = init_device_mesh(device.type, (cfg.workers,))
        shard_mesh = mesh
    else:
        replicas = cfg.hsdp
        mesh = init_device_mesh(device.type, (replicas, cfg.workers // replicas),
                                mesh_dim_names=("replicate", "shard"))
        shard_mesh = mesh["shard"]
    copy_ = copy.deepcopy(model)
    names = {id(p): n for n, p in model.named_parameters()}
    fully_shard(model, mesh=shard_mesh)
    if optimizer is not None:
        sharded = dict(model.named_parameters())
        for group in optimizer.param_groups:
            group["params"] = [sharded[names[id(p)]] for p in group["params"]]
    return mesh, copy_


class _Sharded:
    """What both HSDP steppers share: the world's reductions, buffers and evaluation."""

    model: nn.Module
    device: torch.device
    plain: nn.Module

    def _reduce(self, x: Tensor, op: Any) -> Tensor:
        y = x.to(self.device)
        dist.all_reduce(y, op=op)
        return y.cpu()

    def all_sum(self, x: Tensor) -> Tensor:
        return self._reduce(x, dist.ReduceOp.SUM)

    def all_max(self, x: Tensor) -> Tensor:
        return self._reduce(x, dist.ReduceOp.MAX)

    def sync_buffers(self) -> None:
        """Give every rank worker 0's buffers (BatchNorm statistics; FSDP2 leaves buffers
        unsharded) before evaluating."""
        for b in self.model.buffers():
            dist.broadcast(b, 0)

    @torch.no_grad()
    def eval_model(self) -> nn.Module:
        """The unsharded copy, holding this rank's island's current parameters and buffers.

        Every rank calls it at the same point (each sharded tensor is gathered over the
        island, in the same order on every rank: ``state_dict``'s)."""
        full = {n: (v.full_tensor() if isinstance(v, DTensor) else v)
                for n, v in self.model.state_dict().items()}
        self.plain.load_state_dict(full)
        self.plain.train(self.model.training)
        return self.plain


class HSDPStepper(_Sharded, DDPStepper):
    """One rank of an HSDP run averaging every step's gradient: a
    :class:`~gradzip.train.steppers.DDPStepper` whose model is sharded and whose hook is
    FSDP2's, so only building and stepping differ (the reductions are :class:`_Sharded`'s)."""

    def __init__(self, model: nn.Module, task: Any, compressor: Compressor, cfg: Any,
                 optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.model, self.task, self.device = model, task, device
        self.world = dist.get_world_size()
        self.local_ranks = [dist.get_rank()]
        mesh, self.plain = shard_model(model, cfg, device, optimizer)
        register = gradzip_fsdp.register_reduce_scatter if cfg.fsdp else gradzip_fsdp.register
        self.hook = register(model, compressor, mesh=mesh, options=cfg.engine_options(optimizer))

    def step(self, batches: list[list[Any]], carries: list[Any]) -> float:
        for p in self.model.parameters():
            p.grad = None
        micro, total = batches[0], 0.0
        for i, batch in enumerate(micro):
            # Local accumulation: only the last micro-batch's backward reduce-scatters (and
            # so runs the hook); the others keep unsharded gradients, as DDP's no_sync.
            self.model.set_requires_gradient_sync(i == len(micro) - 1)  # type: ignore[operator]
            loss, carries[0] = self.task.loss(self.model, to_device(batch, self.device), carries[0])
            (loss / len(micro)).backward()
            total += float(loss.detach()) / len(micro)
        return total


class ShardedOuterStepper(_Sharded, OuterStepper):
    """One rank of an HSDP run under outer-step training (interface of
    :class:`~gradzip.train.outer_stepper.OuterStepper`): the island's inner steps are FSDP2's,
    the outer loop a :class:`~gradzip.ShardedOuter`."""

    def __init__(self, model: nn.Module, task: Any, compressor: Compressor, cfg: Any,
                 optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.model, self.task, self.device, self.cfg = model, task, device, cfg
        # The loop's optimizer keeps the unsharded parameters: they never get a gradient, so
        # its step changes nothing (the inner optimizer below does the inner steps).
        self.loop_optimizer = optimizer
        self.dist = dist
        self.world = dist.get_world_size()
        self.local_ranks = [dist.get_rank()]
        mesh, self.plain = shard_model(model, cfg, device)
        self.replicas = [model]
        self.inner = [_like(optimizer, model)]
        self.outer = ShardedOuter(
            model, compressor, mesh=mesh, inner_steps=cfg.outer_steps,
            outer_optimizer=cfg.outer_optimizer, outer_lr=cfg.outer_lr,
            outer_momentum=cfg.outer_momentum, fragments=cfg.fragments,
            inner_optimizers=self.inner, options=cfg.engine_options(),
        )

    @torch.no_grad()
    def eval_model(self) -> nn.Module:
        """The unsharded copy of the islands' mean: each rank's shards averaged over its
        replica group (:meth:`Outer.consensus`), then gathered over the island.

        The mean is written into this rank's shards only for the gather and the shards are
        restored bit for bit after it, so training is untouched (see
        :meth:`OuterStepper.eval_model`). Every rank calls it at the same point.
        """
        mean = self.outer.consensus()
        shards = self.outer.params  # name -> [this rank's shard, a view of the parameter]
        kept = {n: shards[n][0].detach().clone() for n in mean}
        try:
            for name, value in mean.items():
                shards[name][0].copy_(value)
            return _Sharded.eval_model(self)
        finally:
            for name, value in kept.items():
                shards[name][0].copy_(value)
