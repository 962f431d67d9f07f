"""One rank of the emulated-network step-time benchmark (started by ``benchmarks/netem_steps.py``).

Every configuration is its own model in the *same* processes (same gloo process group, same
initial weights, same synthetic batch per rank), timed in interleaved rounds: each round runs a
block of ``--steps`` optimizer steps of every configuration in turn, the order rotating from
round to round, so that anything slowing the machine hits every configuration alike.

Configurations:

* ``floor``: the model's forward + backward + SGD step with no DDP at all (a plain copy): the
  step time no communication scheme can beat.
* ``ddp``: ``DistributedDataParallel`` with no hook (its fp32 all-reduce overlaps the backward).
* ``torch-fp16``: PyTorch's ``fp16_compress_hook``.
* ``torch-powersgd-r4``: PyTorch's ``powerSGD_hook``, matrix rank 4, ``start_powerSGD_iter=2``;
  its DDP model gets its own bucket cap (``--torch-powersgd-bucket-cap-mb``, one bucket by
  default): the hook chains its all-reduces in ``Future.then`` callbacks and deadlocks on gloo
  with two or more buckets.
* ``gradzip-none``, ``gradzip-fp16``, ``gradzip-powersgd-r4``: ``gradzip.ddp.register`` with
  that spec, in the hook's default mode; ``<name>-sync`` runs it in synchronous mode where
  ``register`` has a keyword for that (see :func:`sync_keyword`).

Rank 0 writes a JSON record with every rank's per-round seconds per step. The launcher sets
``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` and ``GLOO_SOCKET_IFNAME``; this file
never creates namespaces.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from . import _netlab_launch as launch

#: Configuration name -> gradzip spec (``None``: not a gradzip hook).
GRADZIP_SPECS = {"gradzip-none": "none", "gradzip-fp16": "fp16",
                 "gradzip-powersgd-r4": "powersgd:rank=4",
                 # The all-gathered and the sharded exchange of one compressor, side by side.
                 "gradzip-topk1-allgather": "topk:ratio=0.01,exchange=allgather",
                 "gradzip-topk1-sharded": "topk:ratio=0.01,exchange=sharded",
                 "gradzip-qsgd-allgather": "qsgd:exchange=allgather",
                 "gradzip-qsgd-sharded": "qsgd:exchange=sharded"}
CONFIGS = ("floor", "ddp", "torch-fp16", "torch-powersgd-r4", *GRADZIP_SPECS)
SYNC_SUFFIX = "-sync"
#: Options the launcher (``netem_steps.py``) takes and passes on, in the order it passes them.
STEP_OPTIONS: tuple[launch.Option, ...] = (
    ("--rounds", int, 40, None),
    ("--steps", int, 3, "steps per configuration per round"),
    ("--warmup", int, 3, None),
    ("--width", int, 64, None),
    ("--batch-size", int, 32, None),
    ("--bucket-cap-mb", float, 1.0, None),
    ("--torch-powersgd-bucket-cap-mb", float, 1000.0,
     "the built-in powerSGD_hook's own cap (one bucket by default: with several it fails on "
     "gloo)"),
    ("--comm-probes", int, 5, None),
    ("--collective-timeout", float, 300.0, None),
)
#: Keywords of ``gradzip.ddp.register`` that could choose synchronous mode, and the value
#: that does: a boolean ``synchronous``-like flag, or an ``asynchronous``-like one set False.
SYNC_KEYWORDS = (("synchronous", True), ("sync", True), ("blocking", True),
                 ("asynchronous", False), ("async_", False), ("async_hook", False),
                 ("overlap", False))


def sync_keyword(register: Callable[..., Any]) -> dict[str, Any] | None:
    """The keyword arguments that make ``register`` run its hook synchronously.

    Args:
        register: ``gradzip.ddp.register`` (any callable; its signature is inspected).

    Returns:
        e.g. ``{"synchronous": True}``, or ``None`` when the signature has no such keyword
        (then the hook has only its default mode).
    """
    params = inspect.signature(register).parameters
    for name, value in SYNC_KEYWORDS:
        if name in params:
            return {name: value}
    mode = params.get("mode")
    if mode is not None and isinstance(mode.default, str):
        return {"mode": "sync"}
    return None


def expand_configs(names: list[str], sync: dict[str, Any] | None,
                   modes: list[str]) -> list[str]:
    """The configurations to time: gradzip names become one per hook mode that exists.

    Args:
        names: entries of :data:`CONFIGS`.
        sync: what :func:`sync_keyword` found.
        modes: among ``default`` and ``sync``; ``sync`` is dropped when ``sync`` is ``None``.

    Returns:
        Configuration names; a synchronous one carries :data:`SYNC_SUFFIX`.
    """
    out = []
    for name in names:
        if name not in GRADZIP_SPECS:
            out.append(name)
            continue
        if "default" in modes:
            out.append(name)
        if "sync" in modes and sync is not None:
            out.append(name + SYNC_SUFFIX)
    return out


def build_model(width: int, seed: int) -> Any:
    """A VGG-style CNN for 3x32x32 inputs: five 3x3 convolutions of ``width``, 2, 4, 8 and 8
    times ``width`` channels (the first four each followed by 2x2 max-pooling), global average
    pooling, a linear classifier. 3.9M parameters at width 64, spread so that the gradient
    fills several DDP buckets of 1 MB (the last convolution alone is 9.4 MB)."""
    import torch
    from torch import nn

    c = width
    chans = [3, c, 2 * c, 4 * c, 8 * c, 8 * c]
    layers: list[nn.Module] = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for i in range(5):
            layers += [nn.Conv2d(chans[i], chans[i + 1], 3, padding=1), nn.ReLU()]
            if i < 4:
                layers.append(nn.MaxPool2d(2))
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(chans[-1], 10)]
        return nn.Sequential(*layers)


def _bucket_count(ddp: Any) -> int | None:
    """How many buckets DDP uses now (after its rebuild following the first backward)."""
    try:
        return len(ddp.reducer._get_zeros_like_grad_buckets())
    except Exception:  # a private API: report nothing rather than fail the run
        return None


def _hook_stats(state: Any) -> dict[str, Any]:
    """A copy of gradzip's cumulative byte counts (empty for other hooks)."""
    return dict(getattr(state, "stats", None) or {})


def build_config(name: str, model: Any, args: argparse.Namespace,
                 sync: dict[str, Any] | None) -> tuple[Any, Any, Any]:
    """Wrap ``model`` for configuration ``name``.

    Returns:
        ``(module, optimizer, hook_state)``; ``hook_state`` is gradzip's (for its byte
        counts) or ``None``.
    """
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import gradzip.ddp

    base = name.removesuffix(SYNC_SUFFIX)
    if base == "floor":
        return model, torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9), None
    cap = args.torch_powersgd_bucket_cap_mb if base == "torch-powersgd-r4" else args.bucket_cap_mb
    ddp = DistributedDataParallel(model, bucket_cap_mb=cap)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    state = None
    if base in GRADZIP_SPECS:
        kwargs = dict(sync or {}) if name.endswith(SYNC_SUFFIX) else {}
        state = gradzip.ddp.register(ddp, GRADZIP_SPECS[base], optimizer=optimizer, **kwargs)
    elif base == "torch-fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif base == "torch-powersgd-r4":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        ps = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                         start_powerSGD_iter=2, random_seed=0)
        ddp.register_comm_hook(ps, powerSGD_hook.powerSGD_hook)
    elif base != "ddp":
        raise ValueError(f"`--configs` entries must be among {', '.join(CONFIGS)}, got {name!r}")
    return ddp, optimizer, state


def rotated(items: list[str], r: int) -> list[str]:
    """``items`` rotated left by ``r`` (round ``r``'s order)."""
    k = r % len(items) if items else 0
    return items[k:] + items[:k]


def run(args: argparse.Namespace) -> None:
    """One rank: build every configuration, warm each up, time the interleaved rounds."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import gradzip.ddp

    torch.set_num_threads(args.threads)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=args.collective_timeout))
    sync = sync_keyword(gradzip.ddp.register)
    configs = expand_configs(args.configs, sync, args.gradzip_modes)
    runs = {}
    for name in configs:
        model = build_model(args.width, args.seed)  # identical weights for every configuration
        runs[name] = build_config(name, model, args, sync)
    params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(args.batch_size, 3, 32, 32, generator=gen)
    y = torch.randint(0, 10, (args.batch_size,), generator=gen)

    def step(module: Any, optimizer: Any) -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(module(x), y).backward()
        optimizer.step()

    # Untimed steps first: DDP rebuilds its buckets after the first backward and the built-in
    # PowerSGD compresses from its third step (start_powerSGD_iter=2).
    for name in configs:
        dist.barrier()
        for _ in range(args.warmup):
            step(*runs[name][:2])
    # A dense all-reduce of the whole gradient alone (one message, no compute): what the
    # link makes a dense step's communication cost, for the comm : compute ratio.
    flat = torch.zeros(params)
    allreduce = []
    for _ in range(args.comm_probes):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(flat)
        allreduce.append(time.perf_counter() - t0)
    zero = {n: _hook_stats(runs[n][2]) for n in configs}
    seconds: dict[str, list[float]] = {n: [] for n in configs}
    cpu: dict[str, list[float]] = {n: [] for n in configs}
    tx: dict[str, int] = dict.fromkeys(configs, 0)
    for r in range(args.rounds):
        for name in rotated(configs, r):
            # Every rank starts the block together (the floor too: the same CPU sharing).
            dist.barrier()
            tx0, t0, c0 = launch.tx_bytes(), time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                step(*runs[name][:2])
            seconds[name].append((time.perf_counter() - t0) / args.steps)
            cpu[name].append((time.process_time() - c0) / args.steps)
            tx[name] += launch.tx_bytes() - tx0
        if rank == 0 and args.progress:
            print(f"round {r + 1}/{args.rounds}", flush=True)
    timed = args.rounds * args.steps
    mine = {"seconds": seconds, "cpu_seconds": cpu, "allreduce_seconds": allreduce,
            "kernel_tx_bytes_per_step": {n: tx[n] / timed for n in configs},
            "hook_bytes_per_step": {
                n: {k: (_hook_stats(runs[n][2]).get(k, 0) - zero[n].get(k, 0)) / timed
                    for k in ("wire_bytes", "dense_wire_bytes", "payload_bytes")}
                for n in configs if runs[n][2] is not None},
            "buckets": {n: _bucket_count(runs[n][0]) for n in configs if n != "floor"}}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        record = {"configs": configs, "world": world, "params": params,
                  "grad_bytes": 4 * params, "sync_keyword": sync,
                  "steps": args.steps, "rounds": args.rounds, "ranks": gathered}
        tmp = Path(args.result + ".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(args.result)
    dist.barrier()  # nobody leaves while another rank may still be communicating


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    p.add_argument("--gradzip-modes", nargs="+", default=["default", "sync"],
                   choices=["default", "sync"])
    launch.add_options(p, STEP_OPTIONS)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--progress", action="store_true")
    p.add_argument("--result", required=True)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run(args)
    launch.exit_skipping_teardown()


if __name__ == "__main__":
    sys.exit(main())
