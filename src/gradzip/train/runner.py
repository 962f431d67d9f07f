"""The experiment runner: one training run, with simulated workers or real processes.

Launchers:

* ``sim``: N workers simulated in one process. Each worker's gradient is computed on its own
  shard with one shared model replica (replicas of synchronous data-parallel SGD are identical,
  so one suffices), the gradients are stacked on a leading worker axis and averaged through an
  :class:`~gradzip.Engine` over a :class:`~gradzip.SimulatedGroup`; the average updates the one
  replica. BatchNorm running statistics follow worker 0, as DDP's buffer broadcast does.
* ``procs``: N processes (gloo on CPU, NCCL on GPUs) with ``DistributedDataParallel`` and the
  gradzip comm hook. Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) each process is one worker
  and the group spans every machine; otherwise the runner spawns N local processes.
* ``auto`` (default): ``procs`` under ``torchrun``, else ``sim``.

Both launchers train the same shards in the same order and evaluate the same test shards, so
with a deterministic compressor they report the same numbers. What a run is (its options,
their resolution, its compressor) lives in :mod:`gradzip.train.config`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from gradzip._validate import check_bool
from gradzip.comm.base import allreduce_wire_bytes
from gradzip.comm.launch import run_processes
from gradzip.comm.torch_dist import shutdown_process_group
from gradzip.engine.routing import idle_rule
from gradzip.ops.random import stable_hash
from gradzip.outer.optim import OuterOptimizer
from gradzip.train.config import RunConfig, build_compressor, resolve_config, under_torchrun
from gradzip.train.loop import TrainLoop
from gradzip.train.metrics import format_bytes, versions
from gradzip.train.resume import Plan
from gradzip.train.run_directory import RunDirectory
from gradzip.train.tasks import get_task

__all__ = ["RunConfig", "build_compressor", "resolve_config", "run", "summarize", "under_torchrun"]

log = logging.getLogger(__name__)


def summarize(cfg: RunConfig, metric: str, history: list[dict[str, Any]],
              stats: dict[str, Any], wall: float, train_seconds: float) -> dict[str, Any]:
    """The ``summary.json`` object of a finished run."""
    last = history[-1] if history else {}
    values = [r[metric] for r in history if r.get(metric) is not None]
    best = (max(values) if metric == "accuracy" else min(values)) if values else None
    sent, dense = stats["wire_bytes"], stats["dense_wire_bytes"]
    return {
        "task": cfg.task,
        "launcher": cfg.launcher,
        "workers": cfg.workers,
        "compressor": cfg.compressor,
        "accordion": cfg.accordion,
        "accordion_batch": list(cfg.accordion_batch) if cfg.accordion_batch else None,
        "metric": metric,
        f"final_{metric}": last.get(metric),
        f"best_{metric}": best,
        "final_test_loss": last.get("test_loss"),
        "final_train_loss": last.get("train_loss"),
        "bytes_sent_per_worker": sent,
        "payload_bytes_per_worker": stats["payload_bytes"],
        "dense_bytes_per_worker": dense,
        "compression": (dense / sent) if sent else None,
        "bytes_accounting": "cumulative ring-collective wire bytes of the busiest worker "
                            "(max over workers); dense = an fp32 all-reduce of every gradient",
        "steps": stats["steps"],
        "rounds": stats["rounds"],
        "skipped_steps": stats["skipped_steps"],
        "epochs": cfg.epochs,
        "wall_seconds": wall,
        "train_seconds": train_seconds,
        "config": cfg.to_dict(),
        "versions": versions(),
    }


# -- launchers ---------------------------------------------------------------------------
def _run_local(cfg: RunConfig, rank: int, processes: int, progress: bool, started: float,
               directory: RunDirectory,
               announce: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Train as process ``rank`` of ``processes`` (sim: the one process of all workers).

    Everything that can refuse the run (data, batch size, model, compressor, this process's
    checkpoint, the directory's lock) happens before rank 0 first writes to ``cfg.out``.
    """
    task = get_task(cfg.task)
    data = task.load(cfg)
    loop = TrainLoop(cfg, task, data, rank=rank, progress=progress and rank == 0)
    _check_rules(cfg, loop.model)
    _check_outer_steps(cfg, loop.steps_per_epoch)
    loop.setup(build_compressor)
    error = None
    try:
        state = directory.load_rank(rank)
        if state is not None:
            loop.load_state_dict(state)
    except ValueError as exc:
        error = f"--resume: {exc}"
    directory.agree_to_start(loop.stepper, rank, error)
    _announce(announce, directory, cfg, loop.model)
    writer = directory.start() if rank == 0 else None
    history, stats, train_seconds = loop.run(
        writer, directory.checkpointer(rank, processes, writer))
    summary = summarize(cfg, task.metric, history, stats,
                        time.perf_counter() - started, train_seconds)
    summary.update(loop.summary_fields())
    if cfg.outer_steps:
        summary["dense_step_bytes_per_worker"] = dense_step_bytes(cfg, loop.model)
    directory.finish(loop.stepper, writer, summary, loop.extra_files())
    return summary


def _check_rules(cfg: RunConfig, model: torch.nn.Module) -> None:
    """Refuse a ``--rule`` that decides none of the model's parameters (as the engine would,
    but here also where the engine is built only at the first DDP bucket, after the output
    directory was opened)."""
    shapes = {n: p.shape for n, p in model.named_parameters() if p.requires_grad}
    idle = idle_rule(shapes, cfg.engine_options())
    if idle:
        raise ValueError(f"--rule: {idle}")


def _check_outer_steps(cfg: RunConfig, steps_per_epoch: int) -> None:
    """Refuse outer-step training whose first synchronisation would come after the run's
    last optimizer step (the workers would train apart, never averaged)."""
    if not cfg.outer_steps:
        return
    total = steps_per_epoch * cfg.epochs
    first = cfg.outer_steps // cfg.fragments + cfg.outer_delay
    if first > total:
        raise ValueError(f"`outer_steps` must let the workers synchronise within the run's "
                         f"{total} optimizer steps ({cfg.epochs} epochs of {steps_per_epoch}), "
                         f"got {cfg.outer_steps}: the first synchronisation would come after "
                         f"step {first}")


def dense_step_bytes(cfg: RunConfig, model: torch.nn.Module) -> int:
    """Bytes one worker sends per optimizer step when every step's gradient is averaged
    densely (a ring all-reduce of every trained parameter in fp32): what outer-step
    training is compared with."""
    numel = sum(t.numel() for t in model.parameters() if t.requires_grad)
    return allreduce_wire_bytes(4 * numel, cfg.workers)


def outer_header(cfg: RunConfig, model: torch.nn.Module) -> str | None:
    """The line announcing an outer-step run: H, and its predicted bytes per optimizer step
    against per-step dense averaging (None for a run averaging every step)."""
    if not cfg.outer_steps:
        return None
    h, p = cfg.outer_steps, cfg.fragments
    # Outer training exchanges each parameter's change once every H steps (a fragment every
    # H/P steps): before compression, 1/H of what per-step averaging sends.
    dense = dense_step_bytes(cfg, model)
    # The outer optimizer as Outer resolves it: unset lr/momentum come from the H rule.
    opt = OuterOptimizer.build(cfg.outer_optimizer, inner_steps=h, lr=cfg.outer_lr,
                               momentum=cfg.outer_momentum)
    shape = f"H={h}" + (f", {p} fragments" if p > 1 else "") + (
        f", delay {cfg.outer_delay}" if cfg.outer_delay else "") + (
        f", {opt.kind} outer lr {opt.lr:g}, momentum {opt.momentum:g}")
    then = "" if cfg.compressor == "none" else f" before {cfg.compressor} compresses it"
    return (f"outer-step training ({shape}): the workers synchronise every {h} optimizer steps, "
            f"about {format_bytes(dense / h)} per worker and optimizer step{then} vs "
            f"{format_bytes(dense)} for per-step dense averaging ({h}x less)")


def _preflight(cfg: RunConfig, directory: RunDirectory) -> torch.nn.Module:
    """Load the data, build the model and compressor, and read every process's checkpoint
    once in the parent, so configuration errors surface as one-line errors here rather than
    as tracebacks from every process.

    Returns:
        The model (for the run's header).
    """
    task = get_task(cfg.task)
    data = task.load(cfg)
    spe = task.steps_per_epoch(data, cfg, cfg.workers)
    model = task.build_model(cfg, data)
    _check_rules(cfg, model)
    _check_outer_steps(cfg, spe)
    build_compressor(cfg, spe)
    if cfg.hsdp or cfg.fsdp:
        # An HSDP run's rank files hold DTensors, which a weights-only load reads once this
        # module has registered them.
        import torch.distributed.tensor  # noqa: F401
    for rank in range(cfg.workers if directory.plan.manifest is not None else 0):
        state = directory.load_rank(rank)
        assert state is not None
        try:
            if cfg.hsdp or cfg.fsdp:  # sharded values: their global shapes are checked
                _check_shapes(model, state["model"])
            else:
                model.load_state_dict(state["model"])
        except (KeyError, RuntimeError) as exc:
            raise ValueError(f"--resume: rank {rank}'s checkpoint does not fit the model: "
                             f"{' '.join(str(exc).split())}") from None
    return model


def _check_shapes(model: torch.nn.Module, saved: dict[str, Any]) -> None:
    """That ``saved`` (a sharded model's state dict) has ``model``'s keys and global shapes.

    Raises:
        RuntimeError: a key missing or extra, or a shape that differs.
    """
    own = {n: tuple(v.shape) for n, v in model.state_dict().items()}
    got = {n: tuple(v.shape) for n, v in saved.items()}
    if own != got:
        differ = sorted(n for n in own.keys() | got.keys() if own.get(n) != got.get(n))
        raise RuntimeError(f"keys or shapes differ at {differ[:3]}")


def _proc_main(rank: int, world: int, cfg_dict: dict[str, Any], progress: bool,
               started: float, plan: Plan) -> dict[str, Any]:
    """Entry point of a spawned worker process (the process group already exists; the
    parent holds the directory's lock)."""
    torch.set_num_threads(cfg_dict.get("threads") or max(1, (os.cpu_count() or 1) // world))
    torch.manual_seed(stable_hash(cfg_dict["seed"], "process", rank))
    cfg = RunConfig.from_dict(cfg_dict)
    with RunDirectory.joined(cfg, plan) as directory:
        return _run_local(cfg, rank, world, progress, started, directory)


def _torchrun_directory(cfg: RunConfig, resume: bool, overwrite: bool) -> RunDirectory:
    """Rank 0 opens the directory (other machines may not share it) and tells every rank
    the plan."""
    import torch.distributed as dist

    box: list[Any] = [None]
    directory = None
    if dist.get_rank() == 0:
        try:
            directory = RunDirectory.open(cfg, resume=resume, overwrite=overwrite)
            box[0] = directory.shared_plan
        except (ValueError, TypeError, OSError) as exc:  # raised on every rank, not one
            box[0] = str(exc)
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise ValueError(box[0])
    return directory if directory is not None else RunDirectory.joined(cfg, box[0])


def _run_torchrun(cfg: RunConfig, progress: bool, started: float, resume: bool,
                  overwrite: bool, announce: Callable[[str], None] | None) -> dict[str, Any]:
    import torch.distributed as dist

    backend = "nccl" if cfg.device == "cuda" else "gloo"
    created = not dist.is_initialized()
    if created:
        dist.init_process_group(backend)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // local))
    try:
        rank = dist.get_rank()
        with _torchrun_directory(cfg, resume, overwrite) as directory:
            if directory.finished is not None:
                summary = directory.finished
            else:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(stable_hash(cfg.seed, "process", rank))
                    summary = _run_local(cfg, rank, cfg.workers, progress, started, directory,
                                         announce if rank == 0 else None)
    except BaseException:
        if created:
            dist.destroy_process_group()
        raise
    if created:
        shutdown_process_group()  # together, so no rank aborts while gloo tears down
    return summary


def run(cfg: RunConfig, *, progress: bool = False, resume: bool = False,
        overwrite: bool = False, announce: Callable[[str], None] | None = None
        ) -> dict[str, Any]:
    """Train one run and write ``metrics.jsonl`` and ``summary.json`` to ``cfg.out``.

    A run is checked whole (configuration, data, batch size against the data, model,
    compressor, the output directory, the checkpoint) before anything in ``cfg.out`` is
    written: a refused run changes nothing there.

    Args:
        cfg: the run (task defaults fill its ``None`` fields).
        progress: show a progress bar (rank 0 only).
        resume: continue the run in ``cfg.out`` from its last checkpoint (model, optimizer,
            every worker's gradzip state, controllers, random generators, records), possibly
            to more epochs; the records equal an uninterrupted run's. Without a checkpoint
            the run starts from the beginning.
        overwrite: start the run in ``cfg.out`` over although it holds results of this
            configuration (any number of epochs). The new run writes to a staging folder and
            replaces the old results only once it has finished, so an interrupted start over
            leaves the old run whole. Without ``resume`` or ``overwrite``, a directory
            holding this configuration's results (finished, checkpointed or recorded) is
            refused.
        announce: called (once checked, before training) with one-line messages saying
            what the run does: where it resumes from, and an outer-step run's header.

    Returns:
        The summary (as written to ``summary.json``; under torchrun, every rank returns its
        own copy and only rank 0 writes it).

    Raises:
        ValueError, TypeError: an invalid configuration, ``cfg.out`` holding another
            configuration's results (the first difference named) or this configuration's
            without ``resume``/``overwrite``, or ``cfg.out`` in use by another run (locked).
        RuntimeError: a worker process failed.
    """
    started = time.perf_counter()
    cfg = resolve_config(cfg)
    check_bool("resume", resume)
    check_bool("overwrite", overwrite)
    if under_torchrun():
        return _run_torchrun(cfg, progress, started, resume, overwrite, announce)
    with RunDirectory.open(cfg, resume=resume, overwrite=overwrite) as directory:
        if directory.finished is not None:
            line = directory.describe()
            if announce is not None and line is not None:
                announce(line)
            return directory.finished
        if cfg.launcher == "sim":
            return _run_sim(cfg, progress, started, directory, announce)
        if cfg.device == "cuda" and torch.cuda.device_count() < cfg.workers:
            raise ValueError(
                f"`workers` must be <= the {torch.cuda.device_count()} GPUs with device='cuda' "
                f"and launcher='procs', got {cfg.workers}"
            )
        model = _preflight(cfg, directory)
        # The parent holds the lock for its workers: they die with it (see run_processes),
        # and the kernel releases the lock when it dies, so a later run never races orphans.
        directory.claim()
        _announce(announce, directory, cfg, model)
        backend = "nccl" if cfg.device == "cuda" else "gloo"
        results = run_processes(_proc_main, cfg.workers, cfg.to_dict(), progress, started,
                                directory.plan, backend=backend, timeout=cfg.timeout)
        return results[0]


def _run_sim(cfg: RunConfig, progress: bool, started: float, directory: RunDirectory,
             announce: Callable[[str], None] | None) -> dict[str, Any]:
    threads = torch.get_num_threads()
    try:
        if cfg.threads is not None:
            torch.set_num_threads(cfg.threads)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(stable_hash(cfg.seed, "process", 0))
            return _run_local(cfg, 0, 1, progress, started, directory, announce)
    finally:
        torch.set_num_threads(threads)


def _announce(announce: Callable[[str], None] | None, directory: RunDirectory, cfg: RunConfig,
              model: torch.nn.Module) -> None:
    """Say what the run does, once every check has passed (the writer's process)."""
    if announce is None:
        return
    for line in (directory.describe(), outer_header(cfg, model)):
        if line is not None:
            announce(line)
