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
with a deterministic compressor they report the same numbers.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from gradzip._validate import check_bool, check_choice, check_int, check_real
from gradzip.comm.torch_dist import shutdown_process_group
from gradzip.compressors.base import Compressor
from gradzip.control import Accordion, BatchSizeController, Schedule
from gradzip.ops.random import stable_hash
from gradzip.options import EngineOptions, Rule
from gradzip.spec import compressor_from_spec, parse_level_schedule
from gradzip.train.events import require_tensorboard
from gradzip.train.loop import TrainLoop
from gradzip.train.metrics import versions
from gradzip.train.resume import Checkpointer, Plan, agree, open_out_dir, plan_out_dir
from gradzip.train.rundir import Manifest, check_out_dir, load_rank_file
from gradzip.train.schedules import milestone_epochs
from gradzip.train.tasks import get_task, parse_model_spec

__all__ = ["LAUNCHERS", "RunConfig", "build_compressor", "resolve_config", "run", "under_torchrun"]

log = logging.getLogger(__name__)

LAUNCHERS = ("auto", "sim", "procs")
DEVICES = ("cpu", "cuda")
#: Accordion's rule: the paper's code (default) or gradzip's first rule.
ACCORDION_RULES = ("reference", "first")
#: Fields that do not change what is computed (ignored when deciding whether a run is done).
NON_RESULT_FIELDS = ("out", "cache_dir", "timeout", "threads", "checkpoint_every", "tensorboard")


@dataclasses.dataclass
class RunConfig:
    """Everything that defines one run; ``None`` fields take the task's defaults.

    Attributes:
        task: ``digits``, ``cifar10``, ``lm`` or ``logreg``.
        out: output directory (``metrics.jsonl``, ``summary.json``).
        workers: number of data-parallel workers (under ``torchrun``: the world size).
        compressor: compressor spec, e.g. ``"topk:ratio=0.01"``.
        accordion: Accordion's gentle (critical-regime) level, e.g. ``"powersgd:rank=4"``;
            ``compressor`` is then the aggressive level.
        accordion_batch: ``(small, large)`` global batch sizes: Accordion's rule applied to
            the batch size (small in critical regimes), realised by accumulating
            ``batch_size``-example micro-batches per worker, LR scaled linearly.
        eta: Accordion's threshold on the relative change of gradient norms.
        interval_epochs: Accordion's decision interval, in epochs (rounded to steps); each
            decision compares the last epoch (or the whole interval, when shorter) with the
            epoch one interval earlier.
        accordion_rule: ``reference`` (the paper's code: an epoch's window, the raw gradient,
            a drop held one interval) or ``first`` (gradzip's first rule: whole intervals of
            the averaged gradient that was sent, a drop held to the interval's end); see
            :class:`~gradzip.Accordion`.
        level_schedule: a fixed level schedule instead of Accordion, e.g.
            ``"gentle:0-5,aggressive:5-30"`` (epochs): ``gentle`` in the gentle ranges,
            ``compressor`` elsewhere (see :class:`~gradzip.Schedule`).
        warmup_steps: ``gentle`` for the first N optimizer steps, then ``compressor``.
        gentle: the gentle level of ``level_schedule``/``warmup_steps`` (default ``none``).
        epochs: training epochs.
        launcher: ``auto``, ``sim`` or ``procs``.
        seed: seed of model initialisation, shuffling, augmentation and compressor randomness.
        data: data path (CIFAR-10 tree or archive, text file, LIBSVM file).
        model: model spec, e.g. ``"resnet20:width=8"``.
        lr: single-worker learning rate; the peak is ``lr * workers`` unless ``scale_lr`` is off.
        batch_size: examples (LM: columns) per worker per step.
        momentum, weight_decay, nesterov: SGD settings.
        warmup_epochs: linear warm-up length.
        milestones: LR decay points (values < 1: fractions of training; others: epochs).
        gamma: LR factor at each milestone.
        clip: max norm of the averaged gradient (0: no clipping).
        scale_lr: linear scaling of the LR with the number of workers.
        error_feedback: force error feedback on or off (default: the compressor's).
        dense_1d: send tensors of fewer than two dimensions (biases, normalisation weights)
            uncompressed (see :class:`~gradzip.EngineOptions`).
        rules: per-parameter rules, ``"PATTERN=SPEC"`` each, first match wins (see
            :class:`~gradzip.EngineOptions`), e.g. ``("*.bias=dense", "fc*=topk:ratio=0.1")``.
        min_numel: tensors with fewer entries are all-reduced exactly (0: off).
        bptt: LM truncated-BPTT window.
        text_level: LM tokens: ``word`` or ``char``.
        limit_train: keep only this many training examples (LM: tokens), for quick runs.
        log_every: also write a ``"step"`` record every N optimizer steps (0: epochs only).
        cache_dir: cache of decoded CIFAR arrays (default ``~/.cache/gradzip``).
        device: ``cpu`` or ``cuda``.
        timeout: seconds before a spawned multi-process run is abandoned.
        threads: torch threads of a simulated run (default: the task's; spawned processes
            share the cores).
        checkpoint_every: save a checkpoint every N epochs and after the last (0: never);
            ``run(..., resume=True)`` continues from it.
        tensorboard: also write TensorBoard event files under ``out/tensorboard``.
    """

    task: str = "digits"
    out: str = "gradzip-run"
    workers: int = 4
    compressor: str = "none"
    accordion: str | None = None
    accordion_batch: tuple[int, int] | None = None
    eta: float = 0.5
    interval_epochs: float | None = None
    accordion_rule: str = "reference"
    level_schedule: str | None = None
    warmup_steps: int = 0
    gentle: str | None = None
    epochs: int | None = None
    launcher: str = "auto"
    seed: int = 0
    data: str | None = None
    model: str | None = None
    lr: float | None = None
    batch_size: int | None = None
    momentum: float | None = None
    weight_decay: float | None = None
    nesterov: bool | None = None
    warmup_epochs: float | None = None
    milestones: tuple[float, ...] | None = None
    gamma: float | None = None
    clip: float | None = None
    scale_lr: bool = True
    error_feedback: bool | None = None
    dense_1d: bool = False
    rules: tuple[str, ...] = ()
    min_numel: int = 0
    bptt: int = 35
    text_level: str = "word"
    limit_train: int | None = None
    log_every: int = 0
    cache_dir: str | None = None
    device: str = "cpu"
    timeout: float = 7 * 24 * 3600.0
    threads: int | None = None
    checkpoint_every: int = 1
    tensorboard: bool = False

    def to_dict(self) -> dict[str, Any]:
        """Plain-data view (tuples as lists)."""
        out = dataclasses.asdict(self)
        for key in ("milestones", "accordion_batch", "rules"):
            if out[key] is not None:
                out[key] = list(out[key])
        return out

    def engine_options(self, optimizer: torch.optim.Optimizer | None = None) -> EngineOptions:
        """The options record of this run's engine (or DDP hook).

        Args:
            optimizer: read by the engine for the learning rate.
        """
        return EngineOptions(
            error_feedback=self.error_feedback, optimizer=optimizer, dense_1d=self.dense_1d,
            rules=tuple(Rule.parse(text) for text in self.rules), min_numel=self.min_numel,
        )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> RunConfig:
        """Build from plain data, refusing unknown keys.

        Raises:
            ValueError: a key that is not a field.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"run options must be among {', '.join(sorted(known))}, got {unknown}")
        values = dict(values)
        if values.get("milestones") is not None:
            values["milestones"] = _milestones(values["milestones"])
        if values.get("accordion_batch") is not None:
            values["accordion_batch"] = _batch_pair(values["accordion_batch"])
        if "rules" in values:
            values["rules"] = _rule_texts(values["rules"])
        return cls(**values)

    @classmethod
    def from_stored(cls, values: dict[str, Any]) -> RunConfig:
        """:meth:`from_dict` for the ``config`` of a finished run's ``summary.json``: options
        added since it was written take the value that run actually used (an Accordion run
        stored without ``accordion_rule`` ran the first rule)."""
        values = dict(values)
        if values.get("accordion") is not None and "accordion_rule" not in values:
            values["accordion_rule"] = "first"
        return cls.from_dict(values)

    def result_key(self) -> dict[str, Any]:
        """The fields that determine the results (what a re-run must match to be skipped)."""
        key = {k: v for k, v in self.to_dict().items() if k not in NON_RESULT_FIELDS}
        if self.accordion is None:
            key.pop("accordion_rule")  # no effect without Accordion
        return key

    def first_difference(self, stored: dict[str, Any], *, epochs: bool = True) -> str | None:
        """The first result-determining field where ``stored`` (another run's configuration,
        as plain data) differs from this one, as ``"name X there, Y here"``; None if none.

        Args:
            stored: ``to_dict()`` of the other run (fields it lacks take their defaults).
            epochs: compare the number of epochs too (a resumed run may change it).
        """
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        mine = self.result_key()
        for key in stored:
            if key not in defaults:
                return f"option {key!r} there, unknown here"
        for key, value in mine.items():
            if key == "epochs" and not epochs:
                continue
            theirs = stored.get(key, defaults[key])
            if isinstance(theirs, tuple):
                theirs = list(theirs)
            if theirs != value:
                return f"{key} {theirs!r} there, {value!r} here"
        return None

    def schedule_change(self, before: RunConfig, epochs_done: int) -> str | None:
        """How the learning-rate milestones of the first ``epochs_done`` epochs differ between
        ``before`` and this configuration (fractional milestones move with ``epochs``); None
        when they agree."""
        old = [m for m in milestone_epochs(before) if m < epochs_done]
        new = [m for m in milestone_epochs(self) if m < epochs_done]
        return None if old == new else f"milestones at epochs {old} become {new}"


def _milestones(value: Any) -> tuple[float, ...]:
    if isinstance(value, str):
        parts = [p for p in value.replace(" ", "").split(",") if p]
        try:
            value = [float(p) for p in parts]
        except ValueError:
            raise ValueError(f"`milestones` must be comma-separated numbers, got {value!r}") from None
    if isinstance(value, (int, float)):
        value = [value]
    marks = tuple(check_real("milestones", v, low=0) for v in value)
    if list(marks) != sorted(marks):
        raise ValueError(f"`milestones` must be non-decreasing, got {list(marks)}")
    return marks


def _rule_texts(value: Any) -> tuple[str, ...]:
    """``rules`` as a tuple of ``"PATTERN=SPEC"`` strings (None: no rules)."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"`rules` must be a list of 'PATTERN=SPEC' strings, got {value!r}")
    return tuple(v.strip() for v in value)


def under_torchrun() -> bool:
    """Whether this process was started by ``torchrun`` (or another env:// launcher)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _batch_pair(value: Any) -> tuple[int, int]:
    if isinstance(value, str):
        try:
            value = [int(v) for v in value.replace(" ", "").split(",")]
        except ValueError:
            raise ValueError(f"`accordion_batch` must be SMALL,LARGE (integers), got {value!r}") from None
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(f"`accordion_batch` must be SMALL,LARGE, got {value!r}")
    small = check_int("accordion_batch", value[0], minimum=1)
    large = check_int("accordion_batch", value[1], minimum=small)
    return small, large


def resolve_config(cfg: RunConfig) -> RunConfig:
    """Fill task defaults and validate every field.

    Raises:
        ValueError, TypeError: the first invalid field, named.
    """
    if not isinstance(cfg, RunConfig):
        raise TypeError(f"`cfg` must be a RunConfig, got {type(cfg).__name__}")
    task = get_task(cfg.task)
    d = task.defaults
    fill = {
        f.name: getattr(d, f.name)
        for f in dataclasses.fields(d)
        if getattr(cfg, f.name) is None
    }
    cfg = dataclasses.replace(cfg, **fill)
    check_int("workers", cfg.workers, minimum=1)
    check_int("epochs", cfg.epochs, minimum=1)
    check_int("batch_size", cfg.batch_size, minimum=1)
    check_int("seed", cfg.seed, minimum=0)
    check_int("bptt", cfg.bptt, minimum=1)
    check_int("log_every", cfg.log_every, minimum=0)
    check_int("checkpoint_every", cfg.checkpoint_every, minimum=0)
    check_bool("tensorboard", cfg.tensorboard)
    if cfg.tensorboard:
        require_tensorboard()
    check_out_dir(cfg.out)
    if cfg.threads is not None:
        check_int("threads", cfg.threads, minimum=1)
    if cfg.limit_train is not None:
        check_int("limit_train", cfg.limit_train, minimum=2)
    check_real("lr", cfg.lr, low=0, low_open=True)
    check_real("momentum", cfg.momentum, low=0, high=1, high_open=True)
    check_real("weight_decay", cfg.weight_decay, low=0)
    check_real("warmup_epochs", cfg.warmup_epochs, low=0)
    check_real("gamma", cfg.gamma, low=0, low_open=True)
    check_real("interval_epochs", cfg.interval_epochs, low=0, low_open=True)
    check_real("eta", cfg.eta, low=0, low_open=True)
    check_choice("accordion_rule", cfg.accordion_rule, ACCORDION_RULES)
    check_real("timeout", cfg.timeout, low=0, low_open=True)
    if cfg.clip is not None:
        check_real("clip", cfg.clip, low=0)  # 0 turns the task's clipping off
    check_bool("nesterov", cfg.nesterov)
    check_bool("scale_lr", cfg.scale_lr)
    if cfg.error_feedback is not None:
        check_bool("error_feedback", cfg.error_feedback)
    check_bool("dense_1d", cfg.dense_1d)
    check_int("min_numel", cfg.min_numel, minimum=0)
    cfg = dataclasses.replace(cfg, rules=_rule_texts(cfg.rules))
    for text in cfg.rules:
        _prefixed("rule", Rule.parse, text)
    if cfg.nesterov and cfg.momentum == 0:
        raise ValueError("`nesterov` must be off when `momentum` is 0, got nesterov=True")
    check_choice("launcher", cfg.launcher, LAUNCHERS)
    check_choice("device", cfg.device, DEVICES)
    check_choice("text_level", cfg.text_level, ("word", "char"))
    cfg = dataclasses.replace(cfg, milestones=_milestones(cfg.milestones))
    parse_model_spec(cfg.model)
    _prefixed("compressor", compressor_from_spec, cfg.compressor)
    if cfg.accordion is not None:
        _prefixed("accordion", compressor_from_spec, cfg.accordion)
        _prefixed("accordion", Accordion, cfg.compressor, cfg.accordion, eta=cfg.eta, interval=1)
    _check_schedule(cfg)
    if cfg.accordion_batch is not None:
        small, large = _batch_pair(cfg.accordion_batch)
        cfg = dataclasses.replace(cfg, accordion_batch=(small, large))
        _prefixed("accordion_batch", BatchSizeController, small, large,
                  micro_batch=cfg.batch_size, workers=cfg.workers, interval_samples=1)
    if cfg.data is None and task.needs_data:
        raise ValueError(f"`data` must be given for task {task.name!r} ({task.description})")
    if cfg.data is not None:
        path = Path(cfg.data).expanduser()
        if not path.exists():
            raise ValueError(f"`data` must be an existing path, got {cfg.data!r}")
        cfg = dataclasses.replace(cfg, data=str(path))
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("`device` must be 'cpu' on a machine without CUDA, got 'cuda'")
    launcher = cfg.launcher
    if launcher == "auto":
        launcher = "procs" if under_torchrun() else "sim"
    if launcher == "sim" and under_torchrun():
        raise ValueError("`launcher` must be 'procs' (or 'auto') under torchrun, got 'sim'")
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != cfg.workers:
            log.info("torchrun world size %d replaces workers=%d", world, cfg.workers)
        cfg = dataclasses.replace(cfg, workers=world)
    return dataclasses.replace(cfg, launcher=launcher, out=str(cfg.out))


def _check_schedule(cfg: RunConfig) -> None:
    """Validate the level-schedule options (``level_schedule``, ``warmup_steps``, ``gentle``)."""
    check_int("warmup_steps", cfg.warmup_steps, minimum=0)
    scheduled = cfg.level_schedule is not None or cfg.warmup_steps > 0
    if cfg.level_schedule is not None and cfg.warmup_steps > 0:
        raise ValueError("`warmup_steps` must be 0 with `level_schedule` (put the warm-up in "
                         f"the schedule), got {cfg.warmup_steps}")
    if scheduled and cfg.accordion is not None:
        raise ValueError("`accordion` must be unset with a level schedule or warm-up, got "
                         f"{cfg.accordion!r}")
    if cfg.gentle is not None and not scheduled:
        raise ValueError("`gentle` needs `level_schedule` or `warmup_steps`, got "
                         f"gentle={cfg.gentle!r}")
    if cfg.level_schedule is not None:
        _prefixed("level_schedule", parse_level_schedule, cfg.level_schedule)
    if scheduled:
        _prefixed("gentle", Schedule, cfg.gentle or "none", cfg.compressor, gentle_steps=[(0, 1)])


def _prefixed(option: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call ``fn``; a ValueError/TypeError names the option it came from."""
    try:
        return fn(*args, **kwargs)
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"--{option.replace('_', '-')}: {exc}") from None


def build_compressor(cfg: RunConfig, steps_per_epoch: int) -> Compressor:
    """The run's compressor; with ``accordion`` an Accordion switching between the two specs,
    deciding every ``interval_epochs`` epochs (converted to optimizer steps)."""
    if cfg.level_schedule is not None:
        return Schedule.from_text(cfg.level_schedule, cfg.compressor, gentle=cfg.gentle or "none",
                                  steps_per_epoch=steps_per_epoch)
    if cfg.warmup_steps > 0:
        return Schedule.warmup(cfg.compressor, steps=cfg.warmup_steps, gentle=cfg.gentle or "none")
    if cfg.accordion is None:
        return compressor_from_spec(cfg.compressor)
    assert cfg.interval_epochs is not None
    interval = max(1, round(cfg.interval_epochs * steps_per_epoch))
    if cfg.accordion_rule == "first":
        return Accordion(cfg.compressor, cfg.accordion, eta=cfg.eta, interval=interval,
                         window=interval, signal="sent", lr_hold="boundary")
    # The paper's code sums one epoch before each decision (its intervals are ten epochs).
    return Accordion(cfg.compressor, cfg.accordion, eta=cfg.eta, interval=interval,
                     window=min(interval, steps_per_epoch))


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
               manifest: dict[str, Any] | None) -> dict[str, Any]:
    """Train as process ``rank`` of ``processes`` (sim: the one process of all workers).

    Everything that can refuse the run (data, batch size, model, compressor, this process's
    checkpoint) happens before rank 0 first writes to ``cfg.out``.
    """
    task = get_task(cfg.task)
    data = task.load(cfg)
    loop = TrainLoop(cfg, task, data, rank=rank, progress=progress and rank == 0)
    loop.setup(build_compressor)
    plan = Plan(None if manifest is None else Manifest.from_dict(manifest))
    error = None
    if plan.manifest is not None:
        try:
            loop.load_state_dict(load_rank_file(cfg.out, plan.manifest, rank))
        except ValueError as exc:
            error = f"--resume: {exc}"
    agree(loop.stepper, error)  # every process loaded its part, or none goes on
    writer = open_out_dir(cfg, plan) if rank == 0 else None
    try:
        history, stats, train_seconds = loop.run(
            writer, Checkpointer(cfg, rank, processes, writer))
        summary = summarize(cfg, task.metric, history, stats, time.perf_counter() - started,
                            train_seconds)
        summary.update(loop.summary_fields())
        if writer is not None:
            for name, obj in loop.extra_files().items():
                writer.write_json(name, obj)
            writer.finish(summary)
        return summary
    finally:
        if writer is not None:
            writer.close()


def _preflight(cfg: RunConfig, plan: Plan) -> None:
    """Load the data, build the model and compressor, and read every process's checkpoint
    once in the parent, so configuration errors surface as one-line errors here rather than
    as tracebacks from every process."""
    task = get_task(cfg.task)
    data = task.load(cfg)
    spe = task.steps_per_epoch(data, cfg, cfg.workers)
    model = task.build_model(cfg, data)
    build_compressor(cfg, spe)
    if plan.manifest is None:
        return
    for rank in range(cfg.workers):
        state = load_rank_file(cfg.out, plan.manifest, rank)
        try:
            model.load_state_dict(state["model"])
        except (KeyError, RuntimeError) as exc:
            raise ValueError(f"--resume: rank {rank}'s checkpoint does not fit the model: "
                             f"{' '.join(str(exc).split())}") from None


def _proc_main(rank: int, world: int, cfg_dict: dict[str, Any], progress: bool,
               started: float, manifest: dict[str, Any] | None) -> dict[str, Any]:
    """Entry point of a spawned worker process (the process group already exists)."""
    torch.set_num_threads(cfg_dict.get("threads") or max(1, (os.cpu_count() or 1) // world))
    torch.manual_seed(stable_hash(cfg_dict["seed"], "process", rank))
    return _run_local(RunConfig.from_dict(cfg_dict), rank, world, progress, started, manifest)


def _torchrun_plan(cfg: RunConfig, resume: bool) -> Plan:
    """Rank 0 reads the directory (other machines may not share it) and tells every rank."""
    import torch.distributed as dist

    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = plan_out_dir(cfg, resume)
        except (ValueError, TypeError, OSError) as exc:  # raised on every rank, not one
            box[0] = str(exc)
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise ValueError(box[0])
    return box[0]


def _run_torchrun(cfg: RunConfig, progress: bool, started: float,
                  resume: bool) -> dict[str, Any]:
    import torch.distributed as dist

    backend = "nccl" if cfg.device == "cuda" else "gloo"
    created = not dist.is_initialized()
    if created:
        dist.init_process_group(backend)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // local))
    try:
        rank = dist.get_rank()
        plan = _torchrun_plan(cfg, resume)
        if plan.finished is not None:
            summary = plan.finished
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(stable_hash(cfg.seed, "process", rank))
                summary = _run_local(cfg, rank, cfg.workers, progress, started,
                                     plan.manifest_dict)
    except BaseException:
        if created:
            dist.destroy_process_group()
        raise
    if created:
        shutdown_process_group()  # together, so no rank aborts while gloo tears down
    return summary


def run(cfg: RunConfig, *, progress: bool = False, resume: bool = False) -> dict[str, Any]:
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

    Returns:
        The summary (as written to ``summary.json``; under torchrun, every rank returns its
        own copy and only rank 0 writes it).

    Raises:
        ValueError, TypeError: an invalid configuration, or ``cfg.out`` holding another
            configuration's results (the first difference named).
        RuntimeError: a worker process failed.
    """
    started = time.perf_counter()
    cfg = resolve_config(cfg)
    check_bool("resume", resume)
    if under_torchrun():
        return _run_torchrun(cfg, progress, started, resume)
    plan = plan_out_dir(cfg, resume)
    if plan.finished is not None:
        return plan.finished
    if cfg.launcher == "sim":
        threads = torch.get_num_threads()
        try:
            if cfg.threads is not None:
                torch.set_num_threads(cfg.threads)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(stable_hash(cfg.seed, "process", 0))
                return _run_local(cfg, 0, 1, progress, started, plan.manifest_dict)
        finally:
            torch.set_num_threads(threads)
    if cfg.device == "cuda" and torch.cuda.device_count() < cfg.workers:
        raise ValueError(
            f"`workers` must be <= the {torch.cuda.device_count()} GPUs with device='cuda' "
            f"and launcher='procs', got {cfg.workers}"
        )
    _preflight(cfg, plan)
    from gradzip.comm.launch import run_processes

    backend = "nccl" if cfg.device == "cuda" else "gloo"
    results = run_processes(_proc_main, cfg.workers, cfg.to_dict(), progress, started,
                            plan.manifest_dict, backend=backend, timeout=cfg.timeout)
    return results[0]
