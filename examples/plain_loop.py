"""gradzip in a hand-written training loop: four simulated workers in one process.

Each worker computes the gradient of its own shard; the engine compresses, exchanges and
averages them exactly as real processes would, and counts every byte. The same engine in a
real process group (``torch.distributed`` initialised, one worker per process) takes each
worker's plain gradients and writes the averages into ``.grad`` with ``engine.reduce_()``.

Run::

    python examples/plain_loop.py --compressor topk:ratio=0.01 --accordion topk:ratio=0.1
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import gradzip
from gradzip.train.data import load_digits, shard_indices
from gradzip.train.models import DigitsNet


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compressor", default="powersgd:rank=1")
    parser.add_argument("--accordion", default=None, help="gentle level for critical regimes")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=16, help="per worker")
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    data = load_digits(seed=0)
    model = DigitsNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    compressor: gradzip.Compressor | str = args.compressor
    steps_per_epoch = len(data.train) // (args.workers * args.batch_size)
    if args.accordion:
        compressor = gradzip.Accordion(
            args.compressor, args.accordion, interval=steps_per_epoch
        )
    engine = gradzip.Engine(model, compressor, collective=gradzip.SimulatedGroup(args.workers),
                            optimizer=optimizer)
    params = dict(model.named_parameters())
    loss_fn = nn.CrossEntropyLoss()

    for epoch in range(args.epochs):
        if epoch == args.epochs - 2:  # a learning-rate drop: Accordion turns gentle again
            for group in optimizer.param_groups:
                group["lr"] *= 0.1
        shards = [shard_indices(len(data.train), args.workers, w, epoch, seed=0)
                  for w in range(args.workers)]
        for step in range(steps_per_epoch):
            per_worker = []
            for shard in shards:  # each worker's gradient of its own batch
                idx = shard[step * args.batch_size:(step + 1) * args.batch_size]
                model.zero_grad()
                loss_fn(model(data.train.x[idx]), data.train.y[idx]).backward()
                per_worker.append({n: p.grad.clone() for n, p in params.items()})
            grads = {n: torch.stack([g[n] for g in per_worker]) for n in params}  # [W, *shape]
            for name, avg in engine.reduce(grads).items():
                params[name].grad = avg
            optimizer.step()
        with torch.no_grad():
            accuracy = float((model(data.test.x).argmax(1) == data.test.y).float().mean())
        stats = engine.stats
        rate = stats["dense_wire_bytes"][0] / max(1, stats["wire_bytes"][0])
        print(f"epoch {epoch + 1}: test accuracy {accuracy:.3f}, "
              f"{stats['wire_bytes'][0] / 2**20:.2f} MiB sent per worker ({rate:.1f}x less than dense)")
    return {"accuracy": accuracy, "compression": rate}


if __name__ == "__main__":
    main()
