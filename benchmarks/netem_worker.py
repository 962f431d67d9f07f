"""One worker of the emulated-network benchmark (started by ``benchmarks/netem.py``).

Two modes:

* ``train``: one rank of a gloo process group. Trains a small CNN on the embedded digits
  through ``DistributedDataParallel`` with the gradzip comm hook, times every optimizer step,
  evaluates the test set after every step (outside the timed region, sharded over the ranks)
  and, on rank 0, writes a JSON record. Before training, every rank times a few
  forward/backward/update steps of a private copy of the model with no communication at all:
  the compute time of one step under the same CPU sharing as the real run.
* ``goodput-recv`` / ``goodput-send``: a bulk TCP transfer between two namespaces, to check
  what the shaped link really delivers.

The launcher sets ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` and
``GLOO_SOCKET_IFNAME`` (the namespace's only link); this file never creates namespaces.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from . import _netlab_launch as launch
from .netem_delay import connect_retrying

log = logging.getLogger("netem_worker")

#: Training options the launcher takes and passes on to ``train``, in the order it passes them.
TRAINING_OPTIONS: tuple[launch.Option, ...] = (
    ("--epochs", int, 16, None),
    ("--drop-epoch", float, 10.0, None),
    ("--lr", float, 0.05, None),
    ("--batch-size", int, 32, None),
    ("--width", int, 64, None),
    ("--seed", int, 0, None),
    ("--target", float, 0.98, None),
    ("--window", int, 5, "the target counts as reached when the mean of this many consecutive "
                         "evaluations (one per step) reaches it"),
)
#: DDP's bucket cap (the launcher passes it after ``--collective-timeout``).
BUCKET_OPTIONS: tuple[launch.Option, ...] = (
    ("--bucket-cap-mb", float, 25.0,
     "DDP's bucket size; below the model's size the hook can overlap buckets"),
)
#: Accordion's levels and rule (passed for ``--spec accordion`` only).
ACCORDION_OPTIONS: tuple[launch.Option, ...] = (
    ("--steady", str, "powersgd:rank=1", None),
    ("--critical", str, "powersgd:rank=4", None),
    ("--eta", float, 0.5, None),
    ("--interval", int, 22, None),
)


# --------------------------------------------------------------------------- goodput


def goodput_recv(bind: str, expected: int, timeout: float) -> dict[str, float]:
    """Accept one connection and read ``expected`` bytes; time from first to last byte."""
    host, port = bind.rsplit(":", 1)
    with socket.create_server((host, int(port))) as server:
        server.settimeout(timeout)
        print("listening", flush=True)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(timeout)
            got, first = 0, None
            while got < expected:
                chunk = conn.recv(1 << 20)
                if not chunk:
                    break
                if first is None:
                    first = time.perf_counter()
                got += len(chunk)
            last = time.perf_counter()
    seconds = last - first if first is not None else float("nan")
    return {"bytes": got, "seconds": seconds, "mbit_per_s": got * 8 / seconds / 1e6}


def goodput_send(to: str, count: int, timeout: float) -> None:
    """Connect (retrying while the receiver starts) and send ``count`` bytes."""
    sock, _ = connect_retrying(to, timeout)
    block = b"\0" * (1 << 20)
    with sock:
        left = count
        while left > 0:
            sock.sendall(block[: min(left, len(block))])
            left -= min(left, len(block))
        sock.shutdown(socket.SHUT_WR)
        sock.recv(1)  # wait for the receiver to close


# --------------------------------------------------------------------------- training


def build_model(width: int, seed: int) -> Any:
    """A VGG-style CNN for 1x8x8 digits: convolutions of ``width``, ``2 width``, ``4 width``
    channels and a 512-unit hidden layer (0.9M parameters, 3.6 MB of fp32, at width 64)."""
    import torch
    from torch import nn

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        c = width
        return nn.Sequential(
            nn.Conv2d(1, c, 3, padding=1), nn.ReLU(),
            nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(2 * c, 4 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(4 * c * 4, 512), nn.ReLU(), nn.Linear(512, 10),
        )


#: ``--spec`` values that run PyTorch alone: plain DDP, and DDP with its ``fp16_compress_hook``.
BASELINES = ("native", "torch-fp16")


class BaselineStats:
    """The byte counters of a PyTorch baseline, in the shape of the gradzip hook's ``stats``:
    one ring all-reduce of every gradient per step (fp32, or fp16 for ``half``)."""

    def __init__(self, n_params: int, world: int, *, half: bool) -> None:
        # Imported here: the goodput modes of this script run without torch.
        from gradzip.comm.base import allreduce_wire_bytes

        self.dense = allreduce_wire_bytes(4 * n_params, world)
        self.sent = allreduce_wire_bytes((2 if half else 4) * n_params, world)
        self.steps = 0

    def stats(self) -> dict[str, Any]:
        return {"steps": self.steps, "wire_bytes": self.sent * self.steps,
                "dense_wire_bytes": self.dense * self.steps}


def build_compressor(args: argparse.Namespace) -> Any:
    """The compressor of this run: a spec string, or Accordion between two levels."""
    if args.spec != "accordion":
        return args.spec
    from gradzip import Accordion

    return Accordion(args.steady, args.critical, eta=args.eta, interval=args.interval)


def _median_compute(model: Any, batches: list[Any], lr: float, steps: int) -> float:
    """Median seconds of forward + backward + SGD update of a private copy, no communication."""
    import torch
    import torch.nn.functional as F

    local = copy.deepcopy(model)
    opt = torch.optim.SGD(local.parameters(), lr=lr, momentum=0.9)
    times = []
    for i in range(steps + 2):
        x, y = batches[i % len(batches)]
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(local(x), y).backward()
        opt.step()
        if i >= 2:  # the first steps allocate
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def train(args: argparse.Namespace) -> None:
    """Run one rank of the benchmark (see the module docstring)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    import gradzip.ddp
    from gradzip.train.data import iter_batches, load_digits, shard_indices
    from gradzip.train.schedules import lr_at

    torch.set_num_threads(args.threads)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    t_start = time.perf_counter()
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=args.collective_timeout))
    data = load_digits(seed=0)
    model = build_model(args.width, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    steps_per_epoch = len(data.train) // world // args.batch_size

    def shard(epoch: int) -> list[Any]:
        idx = shard_indices(len(data.train), world, rank, epoch, args.seed)
        return list(iter_batches(data.train, idx, args.batch_size))

    # Compute alone, every rank at once (the same CPU sharing as in training).
    dist.barrier()
    compute = _median_compute(model, shard(0), args.lr, args.compute_steps)
    computes: list[Any] = [None] * world
    dist.all_gather_object(computes, compute)

    # Latency of one small all-reduce (what every control message and each round of a
    # multi-round compressor pays), all ranks at once.
    tiny = torch.zeros(1)
    dist.barrier()
    lat = []
    for _ in range(args.latency_probes):
        start = time.perf_counter()
        dist.all_reduce(tiny)
        lat.append(time.perf_counter() - start)
    latency = statistics.median(lat)

    # One bucket for the whole model (3.6 MB): every method runs its collectives once per
    # step. (DDP's default puts the last layers in a first 1 MiB bucket, doubling the rounds.)
    ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9,
                                weight_decay=args.weight_decay)
    hook = baseline = None
    if args.spec in BASELINES:  # PyTorch alone: no hook, or its fp16 hook
        baseline = BaselineStats(n_params, world, half=args.spec == "torch-fp16")
        if args.spec == "torch-fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    else:
        hook = gradzip.ddp.register(ddp, build_compressor(args), optimizer=optimizer,
                                    overlap=not args.sync)
    dist.barrier()
    setup_seconds = time.perf_counter() - t_start

    test_per = -(-len(data.test) // world)
    x_test = data.test.x[rank * test_per:(rank + 1) * test_per]
    y_test = data.test.y[rank * test_per:(rank + 1) * test_per]
    tx_start = launch.tx_bytes()
    step_seconds: list[float] = []
    accuracy: list[float] = []
    lrs: list[float] = []
    critical: list[float] = []
    total_steps = args.epochs * steps_per_epoch
    reached, smoothed = None, False
    for epoch in range(args.epochs):
        batches = shard(epoch)
        for i in range(steps_per_epoch):
            lr = lr_at(epoch + i / steps_per_epoch, base_lr=args.lr / world,
                       warmup_epochs=args.warmup_epochs, milestones=[args.drop_epoch],
                       gamma=0.1, workers=world)
            x, y = batches[i]
            start = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(x), y).backward()  # the hook averages through gradzip
            optimizer.step()
            step_seconds.append(time.perf_counter() - start)
            lrs.append(lr)
            if baseline is not None:
                baseline.steps += 1
            levels = hook.stats["levels"] if hook is not None else None
            if levels:
                critical.append(sum(v == "critical" for v in levels.values()) / len(levels))
            with torch.no_grad():
                model.eval()
                correct = (model(x_test).argmax(1) == y_test).sum()
                model.train()
            sums = torch.tensor([float(correct), float(len(y_test))], dtype=torch.float64)
            dist.all_reduce(sums)  # identical on every rank, so every rank stops together
            accuracy.append(float(sums[0] / sums[1]))
            if reached is None and accuracy[-1] >= args.target:
                reached = len(accuracy)
            recent = accuracy[-args.window:]
            smoothed = len(recent) == args.window and sum(recent) / args.window >= args.target
            if args.stop_at_target and smoothed:
                break
        if rank == 0:
            print(f"epoch {epoch + 1}: step {len(accuracy)}, accuracy {accuracy[-1]:.4f}, "
                  f"{sum(step_seconds):.1f} s of steps", flush=True)
        if args.stop_at_target and smoothed:
            break

    tx_train = launch.tx_bytes() - tx_start
    stats: list[Any] = [None] * world
    mine = baseline.stats() if hook is None else {
        k: v for k, v in hook.stats.items() if k != "levels"}
    mine["kernel_tx_bytes"] = tx_train
    dist.all_gather_object(stats, mine)
    extra: dict[str, Any] = {}
    if args.spec == "accordion":
        from gradzip import Accordion

        extra["accordion_counts"] = Accordion.counts(hook.engine.compressor_state)
    if rank == 0:
        record = {
            "spec": args.spec if hook is None else hook.compressor.spec(),
            "overlap": None if hook is None else hook.overlap,
            "world": world,
            "params": n_params,
            "param_bytes": 4 * n_params,
            "steps_per_epoch": steps_per_epoch,
            "scheduled_steps": total_steps,
            "target": args.target,
            "steps_to_target": reached,
            "compute_seconds": computes,
            "setup_seconds": setup_seconds,
            "allreduce_latency_seconds": latency,
            "step_seconds": step_seconds,
            "accuracy": accuracy,
            "lr": lrs,
            "critical_fraction": critical or None,
            "hook_stats": stats,
            **extra,
        }
        tmp = Path(args.result + ".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(args.result)
    # Nobody leaves while another rank may still be communicating; the caller then exits
    # without tearing the process group down (see main).
    dist.barrier()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    t = sub.add_parser("train")
    t.add_argument("--spec", required=True,
                   help="compressor spec, 'accordion', or 'native' / 'torch-fp16' (PyTorch alone)")
    t.add_argument("--sync", action="store_true",
                   help="the synchronous gradzip hook (overlap=False) instead of the default")
    for options in (ACCORDION_OPTIONS, TRAINING_OPTIONS, BUCKET_OPTIONS):
        launch.add_options(t, options)
    t.add_argument("--warmup-epochs", type=float, default=1.0)
    t.add_argument("--weight-decay", type=float, default=1e-4)
    t.add_argument("--stop-at-target", action="store_true",
                   help="stop once the mean of the last --window accuracies reaches --target")
    t.add_argument("--compute-steps", type=int, default=12)
    t.add_argument("--threads", type=int, default=1)
    t.add_argument("--latency-probes", type=int, default=20)
    t.add_argument("--collective-timeout", type=float, default=120.0)
    t.add_argument("--result", required=True)
    r = sub.add_parser("goodput-recv")
    r.add_argument("--bind", required=True)
    r.add_argument("--bytes", type=int, required=True)
    r.add_argument("--timeout", type=float, default=60.0)
    s = sub.add_parser("goodput-send")
    s.add_argument("--to", required=True)
    s.add_argument("--bytes", type=int, required=True)
    s.add_argument("--timeout", type=float, default=60.0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    if args.mode == "train":
        train(args)
        launch.exit_skipping_teardown()
    elif args.mode == "goodput-recv":
        print(json.dumps(goodput_recv(args.bind, args.bytes, args.timeout)), flush=True)
    else:
        goodput_send(args.to, args.bytes, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
