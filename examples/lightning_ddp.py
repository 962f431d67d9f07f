"""gradzip under PyTorch Lightning: one strategy argument.

``GradzipDDPStrategy`` registers gradzip's DDP hook on CPU and GPU, keeps every rank's hook
state in Lightning checkpoints and logs the byte counters to the trainer's loggers.

Run (2 CPU processes; with GPUs, one per GPU)::

    torchrun --standalone --nproc-per-node 2 examples/lightning_ddp.py --compressor topk:ratio=0.05 \\
        --steps 20 --save /tmp/digits.ckpt
    torchrun --standalone --nproc-per-node 2 examples/lightning_ddp.py --compressor topk:ratio=0.05 \\
        --steps 40 --resume /tmp/digits.ckpt
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradzip.comm
from gradzip.integrations.lightning import GradzipDDPStrategy
from gradzip.train.data import load_digits
from gradzip.train.models import DigitsNet


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
    strategy = GradzipDDPStrategy(args.compressor)  # the one gradzip line
    trainer = L.Trainer(
        accelerator="auto", devices=devices, num_nodes=nodes, strategy=strategy,
        max_steps=args.steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, loader, ckpt_path=args.resume)
    if args.save:
        trainer.save_checkpoint(args.save)  # every rank calls it; rank 0 writes every rank's state
    stats = strategy.hook_state.stats
    if trainer.is_global_zero:
        print(f"compressor {strategy.compressor.spec()} on {trainer.world_size} processes, "
              f"{stats['steps']} steps, last loss {module.last_loss:.4f}")
        print(f"bytes sent per rank: payload {stats['payload_bytes']} vs dense "
              f"{stats['dense_payload_bytes']}")
    # Leave the group together before exiting: with gloo, a rank that exits right after its
    # last collective can abort while tearing down (see shutdown_process_group).
    gradzip.comm.shutdown_process_group()


if __name__ == "__main__":
    main()
