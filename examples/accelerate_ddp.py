"""gradzip under Hugging Face Accelerate: one call after ``accelerator.prepare``.

``gradzip.integrations.accelerate.register`` puts gradzip's hook on the prepared DDP model and
registers every rank's hook state for ``save_state``/``load_state``.

Run (2 CPU processes; with GPUs, one per GPU)::

    torchrun --standalone --nproc-per-node 2 examples/accelerate_ddp.py --compressor powersgd:rank=2 \\
        --steps 20 --checkpoint-dir /tmp/gradzip-accelerate
    # the same command again resumes from the checkpoint and trains 20 more steps
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradzip.comm
import gradzip.integrations.accelerate
from gradzip.train.data import load_digits
from gradzip.train.models import DigitsNet


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="gradzip under Accelerate DDP")
    parser.add_argument("--compressor", default="powersgd:rank=2")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--accumulation", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--checkpoint-dir", type=Path, default=None,
                        help="resume from it when it exists; saved at the end")
    args = parser.parse_args(argv)

    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),  # Accelerate needs it to run torchrun's ranks on CPU
        gradient_accumulation_steps=args.accumulation,
        kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=args.bucket_cap_mb)],
    )
    torch.manual_seed(0)
    task = load_digits()
    loader = DataLoader(TensorDataset(task.train.x, task.train.y), batch_size=args.batch_size,
                        shuffle=True, drop_last=True)
    model = DigitsNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    if accelerator.num_processes < 2:  # no DDP wrapper with one process: nothing to communicate
        raise SystemExit("run with 2 or more processes (torchrun or accelerate launch)")
    state = gradzip.integrations.accelerate.register(accelerator, model, args.compressor)

    done = 0
    if args.checkpoint_dir is not None and args.checkpoint_dir.exists():
        accelerator.load_state(str(args.checkpoint_dir))
        done = state.stats["steps"]
        accelerator.print(f"resumed from {args.checkpoint_dir} after {done} steps")

    loss = torch.zeros((), device=accelerator.device)
    model.train()
    while state.stats["steps"] < done + args.steps:
        for x, y in loader:
            with accelerator.accumulate(model):  # no_sync() on all but the last micro-batch
                loss = nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if state.stats["steps"] >= done + args.steps:
                break

    mean_loss = accelerator.reduce(loss.detach(), reduction="mean")
    if args.checkpoint_dir is not None:
        accelerator.save_state(str(args.checkpoint_dir))  # every rank calls it
    stats = state.stats
    accelerator.print(
        f"compressor {state.compressor.spec()} on {accelerator.num_processes} processes, "
        f"{stats['steps']} steps, final loss {mean_loss.item():.4f}"
    )
    accelerator.print(
        f"bytes sent per rank: payload {stats['payload_bytes']} vs dense "
        f"{stats['dense_payload_bytes']}"
    )
    # Leave the group together before exiting (see shutdown_process_group): with gloo, a rank
    # that exits right after its last collective can abort while tearing down.
    gradzip.comm.shutdown_process_group()
    accelerator.end_training()


if __name__ == "__main__":
    main()
