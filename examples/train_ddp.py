"""Compressed-gradient DistributedDataParallel training, launched with torchrun.

One process per device: CUDA with NCCL when GPUs are present, else CPU with gloo. The model is
a small conv net on the 8x8 digits embedded in gradzip (or synthetic images); gradzip's DDP hook
compresses every gradient bucket.

Run (one machine, 2 processes)::

    torchrun --standalone --nproc-per-node 2 examples/train_ddp.py --compressor powersgd:rank=2

Several machines: the same script, with torchrun's usual rendezvous arguments on each node::

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 4 \\
        --rdzv-backend c10d --rdzv-endpoint HOST:29400 examples/train_ddp.py --compressor topk:ratio=0.01

With ``--checkpoint-dir``, every rank saves its own file (gradzip's error-feedback residuals
differ per rank) at the end and resumes from it when it exists.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gradzip
import gradzip.comm
import gradzip.ddp
from gradzip.train.data import load_digits
from gradzip.train.models import DigitsNet

log = logging.getLogger("train_ddp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compressor", default="powersgd:rank=2",
                        help="compressor spec, e.g. none, fp16, topk:ratio=0.01, powersgd:rank=2 "
                             "(with --accordion: the aggressive level)")
    parser.add_argument("--accordion", default=None, metavar="SPEC",
                        help="Accordion's gentle level for critical regimes, e.g. powersgd:rank=4")
    parser.add_argument("--eta", type=float, default=0.5,
                        help="Accordion: relative change of the gradient norm that marks a "
                             "critical regime")
    parser.add_argument("--interval", type=int, default=10,
                        help="Accordion: optimizer steps between decisions")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--data", choices=("digits", "synthetic"), default="digits")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.bucket_cap_mb <= 0:
        parser.error(f"--bucket-cap-mb must be > 0, got {args.bucket_cap_mb}")
    return args


def build_compressor(args: argparse.Namespace) -> gradzip.Compressor | str:
    if args.accordion is None:
        return args.compressor
    # --compressor is the aggressive (steady) level, --accordion the gentle (critical) one.
    return gradzip.Accordion(
        args.compressor, args.accordion, eta=args.eta, interval=args.interval
    )


def load_data(kind: str, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Train and test images ``[n, 1, 8, 8]`` with labels in ``[0, 10)``."""
    if kind == "digits":
        task = load_digits(seed=seed)
        return task.train.x, task.train.y, task.test.x, task.test.y
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2000, 1, 8, 8, generator=gen)
    teacher = torch.randn(64, 10, generator=gen)
    y = (x.flatten(1) @ teacher).argmax(1)
    return x[:1600], y[:1600], x[1600:], y[1600:]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")  # env:// from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)

    x_train, y_train, x_test, y_test = load_data(args.data, args.seed)
    torch.manual_seed(args.seed)  # same initial weights everywhere (DDP also broadcasts rank 0's)
    model = DigitsNet().to(device)
    ddp = DistributedDataParallel(
        model, device_ids=[local_rank] if use_cuda else None, bucket_cap_mb=args.bucket_cap_mb
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    state = gradzip.ddp.register(ddp, build_compressor(args), optimizer=optimizer)

    start = 0
    ckpt_file = args.checkpoint_dir / f"rank{rank}.pt" if args.checkpoint_dir else None
    if ckpt_file is not None and ckpt_file.exists():
        ckpt = torch.load(ckpt_file, map_location=device, weights_only=True)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        state.load_state_dict(ckpt["gradzip"])
        start = int(ckpt["step"])
        if rank == 0:
            print(f"resumed from {args.checkpoint_dir} at step {start}")

    shard = torch.arange(rank, len(y_train), world)  # this rank's share of the data
    loss_fn = nn.CrossEntropyLoss()
    loss = torch.zeros(())
    for step in range(start, start + args.steps):
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1_009 + rank)
        idx = shard[torch.randint(len(shard), (args.batch_size,), generator=gen)]
        x, y = x_train[idx].to(device), y_train[idx].to(device)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(x), y)
        loss.backward()  # the hook compresses and averages every bucket here
        optimizer.step()
        if rank == 0 and (step == start or (step + 1) % 20 == 0):
            print(f"step {step + 1} loss {loss.item():.4f}")

    mean_loss = loss.detach().reshape(1).to(device)
    dist.all_reduce(mean_loss)
    mean_loss /= world
    model.eval()
    with torch.no_grad():
        accuracy = (model(x_test.to(device)).argmax(1).cpu() == y_test).float().mean().item()
    stats = state.stats
    if ckpt_file is not None:
        ckpt_file.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "gradzip": state.state_dict(), "step": start + args.steps}, ckpt_file)
    if rank == 0:
        print(f"compressor {state.compressor.spec()} on {world} processes ({device.type}), "
              f"{stats['steps']} steps")
        print(f"final loss {mean_loss.item():.4f}, test accuracy {accuracy:.3f}")
        ratio = stats["dense_payload_bytes"] / max(stats["payload_bytes"], 1)
        print(f"bytes sent per rank: payload {stats['payload_bytes']} vs dense "
              f"{stats['dense_payload_bytes']} ({ratio:.1f}x less); wire {stats['wire_bytes']} "
              f"vs dense {stats['dense_wire_bytes']}")
    gradzip.comm.shutdown_process_group()  # a barrier, a pause, then destroy_process_group


if __name__ == "__main__":
    main()
