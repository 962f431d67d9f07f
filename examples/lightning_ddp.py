"""gradzip's DDP hook under PyTorch Lightning.

Lightning's ``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)`` registers a comm hook only
when the device is CUDA; on CPU it is silently ignored. :class:`GradzipCallback` works on every
device: once Lightning has wrapped the model in DistributedDataParallel (``on_fit_start``) it
registers the hook itself. Its checkpoint state holds every rank's gradzip state (Lightning
writes the checkpoint from rank 0 only), and each rank takes its own entry back on resume.

Run (2 CPU processes; with GPUs, one per GPU)::

    torchrun --standalone --nproc-per-node 2 examples/lightning_ddp.py --compressor topk:ratio=0.05 \
        --steps 20 --save /tmp/digits.ckpt
    torchrun --standalone --nproc-per-node 2 examples/lightning_ddp.py --compressor topk:ratio=0.05 \
        --steps 40 --resume /tmp/digits.ckpt

On CUDA, Lightning's own route works too (``--strategy-hook``)::

    state, hook = gradzip.ddp.make_hook(lightning_module, "powersgd:rank=2")
    trainer = L.Trainer(strategy=DDPStrategy(ddp_comm_state=state, ddp_comm_hook=hook), ...)
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import gradzip.comm
import gradzip.ddp
from gradzip.train.data import load_digits
from gradzip.train.models import DigitsNet


class GradzipCallback(L.Callback):
    """Register gradzip's DDP comm hook on the model Lightning wrapped in DDP.

    Args:
        compressor: a compressor spec (``"topk:ratio=0.01"``) or :class:`~gradzip.Compressor`.
        **kwargs: passed to :func:`gradzip.ddp.register` (``error_feedback``, ``nonfinite``).

    Attributes:
        state: the :class:`~gradzip.ddp.GradzipHookState` once fitting started (``stats``).
    """

    def __init__(self, compressor: Any, **kwargs: Any) -> None:
        self.compressor = compressor
        self.kwargs = kwargs
        self.state: gradzip.ddp.GradzipHookState | None = None
        self._pending: dict[str, Any] | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        model = trainer.strategy.model
        if not isinstance(model, DistributedDataParallel):
            raise RuntimeError(
                f"GradzipCallback needs a DDP strategy, got a {type(model).__name__} model "
                f"under {type(trainer.strategy).__name__}"
            )
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        self.state = gradzip.ddp.register(model, self.compressor, optimizer=optimizer, **self.kwargs)
        if self._pending is not None:
            self.state.load_state_dict(self._pending)
            self._pending = None

    def state_dict(self) -> dict[str, Any]:
        # Called on every rank while Lightning builds a checkpoint: gathering is safe here.
        return self.state.gathered().state_dict() if self.state is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if self.state is None:
            self._pending = state_dict  # restored before fit starts: applied on registration
        else:
            self.state.load_state_dict(state_dict)


class DigitsClassifier(L.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.net = DigitsNet()
        self.lr = lr
        self.last_loss = float("nan")

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.last_loss = float(loss.detach())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="gradzip under PyTorch Lightning DDP")
    parser.add_argument("--compressor", default="topk:ratio=0.05")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--devices", type=int, default=None,
                        help="processes on this node (default: torchrun's LOCAL_WORLD_SIZE)")
    parser.add_argument("--strategy-hook", action="store_true",
                        help="CUDA only: pass the hook through DDPStrategy instead of the callback")
    parser.add_argument("--save", default=None, metavar="PATH", help="checkpoint written at the end")
    parser.add_argument("--resume", default=None, metavar="PATH", help="checkpoint to resume from")
    args = parser.parse_args(argv)
    devices = args.devices or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    nodes = max(1, int(os.environ.get("WORLD_SIZE", devices)) // devices)

    torch.manual_seed(0)
    task = load_digits()
    loader = DataLoader(TensorDataset(task.train.x, task.train.y), batch_size=args.batch_size,
                        shuffle=True)  # Lightning adds a DistributedSampler
    module = DigitsClassifier(args.lr)
    callback: GradzipCallback | None = None
    if args.strategy_hook:
        if not torch.cuda.is_available():
            raise SystemExit("--strategy-hook needs CUDA: Lightning ignores comm hooks on CPU")
        state, hook = gradzip.ddp.make_hook(module, args.compressor)
        strategy = DDPStrategy(ddp_comm_state=state, ddp_comm_hook=hook)
    else:
        callback = GradzipCallback(args.compressor)
        strategy = DDPStrategy()
    trainer = L.Trainer(
        accelerator="auto", devices=devices, num_nodes=nodes, strategy=strategy,
        max_steps=args.steps, callbacks=[callback] if callback else [], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, loader, ckpt_path=args.resume)
    if args.save:
        trainer.save_checkpoint(args.save)  # every rank calls it; rank 0 writes
    hook_state = callback.state if callback else state
    stats = hook_state.stats
    if trainer.is_global_zero:
        print(f"compressor {hook_state.compressor.spec()} on {trainer.world_size} processes, "
              f"{stats['steps']} steps, last loss {module.last_loss:.4f}")
        print(f"bytes sent per rank: payload {stats['payload_bytes']} vs dense "
              f"{stats['dense_payload_bytes']}")
    # Leave the group together before exiting: with gloo, a rank that exits right after its
    # last collective can abort while tearing down (see shutdown_process_group).
    gradzip.comm.shutdown_process_group()


if __name__ == "__main__":
    main()
