"""DDP benchmark: seconds per training step with each communication hook, over gloo.

Every configuration is a separate DDP model in the *same* processes (same process group, same
data, same initial weights), and the configurations are timed in interleaved rounds: each round
times a block of steps of every configuration in turn (the order rotates between rounds). A
slowdown of the machine therefore hits every configuration alike, and ratios are taken per
round before the median over rounds.

Configurations (strings):

* ``nohook``: plain DDP (its built-in fp32 all-reduce, overlapped with the backward pass).
* ``gradzip:<spec>``: :func:`gradzip.ddp.register` with that compressor spec.
* ``builtin-powersgd:rank=<r>``: PyTorch's ``powerSGD_hook`` at matrix rank ``r``,
  ``start_powerSGD_iter=2`` (its minimum with error feedback and warm start). The model has to
  fit one DDP bucket: on gloo the built-in hook deadlocks with two or more.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from gradzip._validate import check_int, check_real
from gradzip.comm.launch import run_processes
from gradzip.ddp import register
from gradzip.spec import compressor_from_spec
from gradzip.train.models import build_model

__all__ = ["HOOK_CONFIGS", "HookRow", "run_hooks"]

log = logging.getLogger(__name__)

HOOK_CONFIGS = (
    "nohook",
    "gradzip:none",
    "gradzip:fp16",
    "gradzip:bf16",
    "gradzip:topk:ratio=0.01",
    "gradzip:randk:ratio=0.01",
    "gradzip:threshold:budget=0.01",
    "gradzip:powersgd:rank=4",
    "builtin-powersgd:rank=4",
    "gradzip:qsgd:levels=8",
    "gradzip:sign",
)

# Large enough that the benchmark models sit in one DDP bucket (see the module docstring).
_BUCKET_CAP_MB = 256


@dataclass
class HookRow:
    """One configuration at one world size; seconds are medians over rounds, ratios medians
    of per-round ratios. Wall time is the slowest rank's; CPU time the ranks' mean."""

    config: str
    workers: int
    seconds_per_step: float
    ratio_to_nohook: float | None
    cpu_seconds_per_step: float
    cpu_ratio_to_nohook: float | None
    model: str
    parameters: int
    batch_per_worker: int
    threads_per_worker: int
    steps_per_round: int
    rounds: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _paired_ratio(values: Sequence[float], base: Sequence[float]) -> float:
    """Median over rounds of ``values[r] / base[r]`` (both measured in the same round)."""
    return statistics.median(v / b for v, b in zip(values, base, strict=True))


def _check_config(config: str) -> None:
    if config == "nohook":
        return
    kind, sep, rest = config.partition(":")
    if kind == "gradzip" and sep:
        compressor_from_spec(rest)
        return
    if kind == "builtin-powersgd" and rest.startswith("rank=") and rest[5:].isdigit():
        return
    raise ValueError(
        "hook configurations must be 'nohook', 'gradzip:<spec>' or 'builtin-powersgd:rank=<r>', "
        f"got {config!r}"
    )


def _build(config: str, model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Wrap ``model`` in DDP with ``config``'s hook; returns the DDP model and its optimizer."""
    ddp = DistributedDataParallel(model, bucket_cap_mb=_BUCKET_CAP_MB)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    kind, _, rest = config.partition(":")
    if kind == "gradzip":
        register(ddp, rest, optimizer=optimizer)
    elif kind == "builtin-powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=int(rest.partition("=")[2]),
            start_powerSGD_iter=2, random_seed=0,
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return ddp, optimizer


def _worker(
    rank: int, world: int, configs: Sequence[str], model_name: str, width: int, batch: int,
    steps: int, rounds: int, warmup: int, threads: int,
) -> dict[str, Any]:
    """One rank: every configuration's seconds per step in each round."""
    torch.set_num_threads(threads)
    runs: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {}
    for config in configs:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # identical initial weights for every configuration
            model = build_model(model_name, 10, width=width)
        runs[config] = _build(config, model)
    parameters = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(1000 + rank)
    inputs = torch.randn(batch, 3, 32, 32, generator=gen)
    labels = torch.randint(0, 10, (batch,), generator=gen)
    loss_fn = nn.CrossEntropyLoss()

    def step(ddp: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(ddp(inputs), labels).backward()
        optimizer.step()

    for config in configs:
        for _ in range(warmup):
            step(*runs[config])
    times: dict[str, list[float]] = {c: [] for c in configs}
    cpu: dict[str, list[float]] = {c: [] for c in configs}
    for r in range(rounds):
        order = list(configs[r % len(configs):]) + list(configs[: r % len(configs)])
        for config in order:
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(steps):
                step(*runs[config])
            times[config].append((time.perf_counter() - start) / steps)
            cpu[config].append((time.process_time() - start_cpu) / steps)
    return {"times": times, "cpu": cpu, "parameters": parameters}


def run_hooks(
    workers: Sequence[int] = (2, 4),
    configs: Sequence[str] = HOOK_CONFIGS,
    *,
    model: str = "resnet8",
    width: int = 16,
    batch: int = 32,
    steps: int = 10,
    rounds: int = 5,
    warmup: int = 3,
    threads: int | None = None,
    timeout: float = 1800.0,
    on_row: Callable[[HookRow], None] | None = None,
) -> list[HookRow]:
    """Seconds per DDP training step for every configuration and world size.

    Args:
        workers: world sizes; each runs in fresh gloo processes on 127.0.0.1.
        configs: configuration strings (see the module docstring); ``nohook`` is added
            first when missing, since every ratio is taken against it.
        model, width: a CIFAR model of :func:`gradzip.train.models.build_model` (random
            32x32 inputs, 10 classes).
        batch: samples per worker per step.
        steps: steps per configuration per round.
        rounds: interleaved rounds; the median over rounds is reported.
        warmup: untimed steps per configuration first (>= 3: DDP rebuilds its buckets after
            the first step and the built-in PowerSGD starts compressing at the third).
        threads: torch threads per process (``None``: the cores divided by the workers).
        timeout: seconds for each world size's whole run.
        on_row: called with each row as soon as it is ready.

    Returns:
        One row per (world size, configuration).

    Raises:
        ValueError: invalid arguments.
        RuntimeError, TimeoutError: a worker failed or hung.
    """
    for config in configs:
        _check_config(config)
    configs = list(configs) if "nohook" in configs else ["nohook", *configs]
    sizes = [check_int("workers", w, minimum=2) for w in workers]
    steps = check_int("steps", steps, minimum=1)
    rounds = check_int("rounds", rounds, minimum=1)
    warmup = check_int("warmup", warmup, minimum=3)
    batch = check_int("batch", batch, minimum=1)
    timeout = check_real("timeout", timeout, low=0, low_open=True)
    rows = []
    for world in sizes:
        per_proc = threads if threads is not None else max(1, (os.cpu_count() or 1) // world)
        per_proc = check_int("threads", per_proc, minimum=1)
        results = run_processes(
            _worker, world, configs, model, width, batch, steps, rounds, warmup, per_proc,
            timeout=timeout,
        )
        # A step ends for everyone at its last collective: the slowest rank's time is the step.
        times = {
            c: [max(res["times"][c][r] for res in results) for r in range(rounds)] for c in configs
        }
        # CPU time of the processes (all their threads), averaged over ranks: the work a
        # configuration does, much less sensitive than wall time to other jobs on the machine.
        cpu = {
            c: [statistics.mean(res["cpu"][c][r] for res in results) for r in range(rounds)]
            for c in configs
        }
        for config in configs:
            row = HookRow(
                config=config, workers=world, seconds_per_step=statistics.median(times[config]),
                ratio_to_nohook=_paired_ratio(times[config], times["nohook"]),
                cpu_seconds_per_step=statistics.median(cpu[config]),
                cpu_ratio_to_nohook=_paired_ratio(cpu[config], cpu["nohook"]),
                model=f"{model} (width {width})",
                parameters=results[0]["parameters"], batch_per_worker=batch,
                threads_per_worker=per_proc, steps_per_round=steps, rounds=rounds,
            )
            rows.append(row)
            if on_row is not None:
                on_row(row)
    return rows
