"""Outer-step training (DiLoCo family) with gradzip: each worker takes H local AdamW steps,
then the workers exchange the compressed change of their parameters.

Under torchrun every process is one worker (gloo on CPU)::

    torchrun --nproc-per-node 4 examples/outer_torchrun.py --compressor binmean:bits=8

Without torchrun the same loop runs ``--workers`` simulated workers in one process::

    python examples/outer_torchrun.py --workers 4 \\
        --compressor chunktopk:chunk=4096,k=64,bits=2,average=senders --outer ef-momentum
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist
from torch import nn

import gradzip
from gradzip.train.data import load_digits, shard_indices
from gradzip.train.models import DigitsNet


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compressor", default="none")
    parser.add_argument("--outer", default="nesterov", choices=gradzip.outer.OUTER_KINDS)
    parser.add_argument("--inner-steps", type=int, default=10, help="H")
    parser.add_argument("--workers", type=int, default=4, help="simulated workers (no torchrun)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16, help="per worker")
    args = parser.parse_args(argv)

    real = "RANK" in os.environ  # started by torchrun
    if real:
        dist.init_process_group("gloo")
    workers = dist.get_world_size() if real else args.workers
    ranks = [dist.get_rank()] if real else list(range(workers))
    data = load_digits(seed=0)
    torch.manual_seed(0)  # every worker starts from the same parameters
    first = DigitsNet()
    models = [first] + [copy.deepcopy(first) for _ in ranks[1:]]
    inner = [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
             for m in models]
    outer = gradzip.Outer(models if not real else first, args.compressor,
                          inner_steps=args.inner_steps, outer_optimizer=args.outer,
                          collective=None if real else gradzip.SimulatedGroup(workers))
    loss_fn = nn.CrossEntropyLoss()
    steps = len(data.train) // (workers * args.batch_size)
    for epoch in range(args.epochs):
        shards = [shard_indices(len(data.train), workers, rank, epoch, seed=0) for rank in ranks]
        for step in range(steps):
            for model, opt, shard in zip(models, inner, shards, strict=True):  # one inner step each
                idx = shard[step * args.batch_size:(step + 1) * args.batch_size]
                opt.zero_grad()
                loss_fn(model(data.train.x[idx]), data.train.y[idx]).backward()
                opt.step()
            outer.step()  # every H calls: compress, exchange, outer step
    with torch.no_grad():
        accuracy = float((first(data.test.x).argmax(1) == data.test.y).float().mean())
    stats = outer.stats
    result = {"accuracy": accuracy, "syncs": stats["syncs"],
              "compression": stats["dense_wire_bytes"][0] / max(stats["wire_bytes"][0], 1)}
    if ranks[0] == 0:
        print(f"accuracy {accuracy:.3f}; {stats['syncs']} synchronisations, "
              f"{stats['wire_bytes'][0] / 2**20:.2f} MiB sent per worker")
    if real:
        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
