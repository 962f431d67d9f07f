"""What defines one run: :class:`RunConfig`, its resolution, and the compressor it builds.

Each field of :class:`RunConfig` is declared once, with its default, its meaning, its check
and how it appears on the command line (an :class:`Option` in the field's metadata):
:func:`resolve_config` applies the checks, and :mod:`gradzip.cli` builds the ``train``
options from the same declarations, so adding a run option means adding one field.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import torch

from gradzip._validate import check_bool, check_choice, check_int, check_real
from gradzip.compressors.base import Compressor
from gradzip.control import Accordion, BatchSizeController, Schedule
from gradzip.options import EngineOptions, Rule
from gradzip.spec import compressor_from_spec, parse_level_schedule
from gradzip.train.events import require_tensorboard
from gradzip.train.fields import ACCORDION, OPTIM, SCHEDULE, Option, int_at_least, option, real_in
from gradzip.train.hsdp_fields import HSDPFields, check_hsdp
from gradzip.train.idle import ETA_DEFAULT, check_idle_options, idle_options
from gradzip.train.outer_fields import OuterFields, outer_exchanges_list, outer_steps_list
from gradzip.train.rundir import check_out_dir
from gradzip.train.schedules import milestone_epochs
from gradzip.train.tasks import TASKS, get_task, parse_model_spec

__all__ = ["ACCORDION_RULES", "DEVICES", "LAUNCHERS", "NON_RESULT_FIELDS", "TEXT_LEVELS",
           "RunConfig", "build_compressor", "resolve_config", "run_options",
           "under_torchrun"]

log = logging.getLogger(__name__)

LAUNCHERS = ("auto", "sim", "procs")
DEVICES = ("cpu", "cuda")
#: Accordion's rule: the paper's code (default) or gradzip's first rule.
ACCORDION_RULES = ("reference", "first")
#: LM tokens.
TEXT_LEVELS = ("word", "char")
#: Fields that do not change what is computed (ignored when deciding whether a run is done).
NON_RESULT_FIELDS = ("out", "cache_dir", "timeout", "threads", "checkpoint_every", "tensorboard")

POSITIVE, NON_NEGATIVE = real_in(low=0, low_open=True), real_in(low=0)

@dataclasses.dataclass
class RunConfig(OuterFields, HSDPFields):
    """Everything that defines one run; ``None`` fields take the task's defaults.

    Every field is documented where it is declared (its :class:`Option`'s ``help``, the line
    ``gradzip train --help`` prints); :func:`run_options` lists them.
    """

    task: str = option("digits", ", ".join(f"{n} (default)" if n == "digits" else n
                                         for n in TASKS))
    out: str = option("gradzip-run", "output directory (metrics.jsonl, summary.json, checkpoint)",
                    metavar="DIR", required=True)
    workers: int = option(4, "data-parallel workers (default 4; under torchrun: the world size)",
                        check=int_at_least(1))
    compressor: str = option("none", "compressor spec, e.g. topk:ratio=0.01, powersgd:rank=2 "
                           "(default none)", metavar="SPEC")
    accordion: str | None = option(
        None, "gentle level for critical regimes (--compressor is the aggressive one), e.g. "
        "--compressor powersgd:rank=1 --accordion powersgd:rank=4",
        group=ACCORDION, metavar="SPEC")
    accordion_batch: tuple[int, int] | None = option(
        None, "Accordion on the batch size: global batch SMALL in critical regimes, LARGE "
        "otherwise (multiples of batch-size x workers, by accumulating micro-batches; LR "
        "scaled linearly)", group=ACCORDION, metavar="SMALL,LARGE")
    eta: float = option(ETA_DEFAULT, "critical when the gradient norm changes by >= eta (default 0.5)",
                      group=ACCORDION, check=POSITIVE)
    interval_epochs: float | None = option(
        None, "epochs between Accordion decisions, rounded to steps (default: the task's)",
        group=ACCORDION, metavar="E", check=POSITIVE)
    accordion_rule: str = option(
        "reference", "reference: the paper's code (an epoch's window, the raw gradient, a "
        "drop held one interval); first: gradzip's first rule (whole intervals of the "
        "averaged gradient sent, a drop held to the interval's end)",
        group=ACCORDION, choices=ACCORDION_RULES)
    level_schedule: str | None = option(
        None, "fixed levels by epoch, e.g. 'gentle:0-5,aggressive:5-30': --gentle in the "
        "gentle ranges, --compressor elsewhere", group=SCHEDULE, metavar="RANGES")
    warmup_steps: int = option(0, "--gentle for the first N optimizer steps, then --compressor",
                             group=SCHEDULE, metavar="N", check=int_at_least(0))
    gentle: str | None = option(None, "gentle level of --level-schedule/--warmup-steps (default "
                              "none: dense)", group=SCHEDULE, metavar="SPEC")
    epochs: int | None = option(None, "training epochs", check=int_at_least(1))
    launcher: str = option("auto", "sim: simulated workers in one process; procs: one process "
                         "per worker (gloo/NCCL, DDP hook); auto: procs under torchrun, else sim",
                         choices=LAUNCHERS)
    seed: int = option(0, "seed of model initialisation, shuffling, augmentation and compressor "
                     "randomness (default 0)", check=int_at_least(0))
    data: str | None = option(None, "data path (cifar10: release dir, ImageFolder dir or .tar.gz; "
                            "lm: text file or dir; logreg: LIBSVM file, default a generated "
                            "problem)", metavar="PATH")
    model: str | None = option(None, "model, optionally with keywords: resnet20:width=8, "
                             "lstm:hidden=100", metavar="SPEC")
    lr: float | None = option(None, "per-worker learning rate (the peak is lr x workers unless "
                            "--no-scale-lr)", group=OPTIM, check=POSITIVE)
    batch_size: int | None = option(None, "per-worker batch size (lm: columns)", group=OPTIM,
                                  check=int_at_least(1))
    momentum: float | None = option(None, "SGD momentum", group=OPTIM,
                                  check=real_in(low=0, high=1, high_open=True))
    weight_decay: float | None = option(None, "SGD weight decay", group=OPTIM,
                                      check=NON_NEGATIVE)
    nesterov: bool | None = option(None, "Nesterov momentum", group=OPTIM, check=check_bool)
    warmup_epochs: float | None = option(None, "linear learning-rate warm-up, in epochs",
                                       group=OPTIM, check=NON_NEGATIVE)
    milestones: tuple[float, ...] | None = option(
        None, "LR decay points: values < 1 are fractions of training, others epochs",
        group=OPTIM, metavar="M1,M2")
    gamma: float | None = option(None, "LR factor at each milestone", group=OPTIM,
                               check=POSITIVE)
    clip: float | None = option(None, "max norm of the averaged gradient (0: off)", group=OPTIM,
                              check=NON_NEGATIVE)
    scale_lr: bool = option(True, "do not multiply the learning rate by the number of workers",
                          group=OPTIM, flag="--no-scale-lr", check=check_bool)
    error_feedback: bool | None = option(None, "force error feedback on/off (default: the "
                                       "compressor's)", group=OPTIM, check=check_bool)
    dense_1d: bool = option(False, "send biases and normalisation weights (tensors of < 2 "
                          "dimensions) uncompressed", group=OPTIM, check=check_bool)
    rules: tuple[str, ...] = option(
        (), "per-parameter compressor: parameters whose name matches the glob PATTERN use "
        "SPEC (a compressor spec, or dense: exact); first match wins, others use --compressor "
        "(repeatable), e.g. '*.bias=dense'", group=OPTIM, flag="--rule", metavar="PATTERN=SPEC")
    min_numel: int = option(0, "all-reduce tensors of fewer than N entries exactly (default 0: "
                          "off)", group=OPTIM, metavar="N", check=int_at_least(0))
    bptt: int = option(35, "lm: truncated-BPTT length", group=OPTIM, check=int_at_least(1))
    text_level: str = option("word", "lm tokens", group=OPTIM, choices=TEXT_LEVELS)
    limit_train: int | None = option(None, "use only N training examples (lm: tokens), for quick "
                                   "runs", metavar="N", check=int_at_least(2))
    log_every: int = option(0, "also log a record every STEPS optimizer steps", metavar="STEPS",
                          check=int_at_least(0))
    eval_every: int = option(0, "also evaluate every STEPS optimizer steps (an 'eval' record; its "
                           "train_seconds exclude evaluations; with --auto-outer, after the "
                           "switch, at every synchronisation)", metavar="STEPS",
                           check=int_at_least(0))
    cache_dir: str | None = option(None, "cache of decoded CIFAR arrays (default "
                                 "~/.cache/gradzip)")
    device: str = option("cpu", "cpu or cuda", choices=DEVICES)
    timeout: float = option(7 * 24 * 3600.0, "seconds before a spawned multi-process run is "
                          "abandoned", cli=False, check=POSITIVE)
    threads: int | None = option(None, "torch threads of a simulated run (default: the task's; "
                               "spawned processes share the cores)", check=int_at_least(1))
    checkpoint_every: int = option(1, "save a checkpoint to DIR/checkpoint every N epochs and "
                                 "after the last (default 1; 0: never)", metavar="N",
                                 check=int_at_least(0))
    tensorboard: bool = option(False, "also write TensorBoard event files to DIR/tensorboard "
                             "(needs the tensorboard package)", check=check_bool)

    def to_dict(self) -> dict[str, Any]:
        """Plain-data view (tuples as lists)."""
        out = dataclasses.asdict(self)
        for key in ("milestones", "accordion_batch", "rules", "auto_outer_steps",
                    "auto_outer_exchanges"):
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
        if "auto_outer_steps" in values:
            values["auto_outer_steps"] = outer_steps_list(values["auto_outer_steps"])
        if "auto_outer_exchanges" in values:
            values["auto_outer_exchanges"] = outer_exchanges_list(values["auto_outer_exchanges"])
        return cls(**values)

    @classmethod
    def from_stored(cls, values: dict[str, Any]) -> RunConfig:
        """:meth:`from_dict` for the ``config`` of a finished run's ``summary.json``: options
        added since it was written take the value that run actually used (an Accordion run
        stored without ``accordion_rule`` ran the first rule)."""
        values = dict(values)
        if values.get("accordion") is not None and "accordion_rule" not in values:
            values["accordion_rule"] = "first"
        if values.get("auto_outer") and "auto_outer_exchanges" not in values:
            values["auto_outer_exchanges"] = ["none"]  # its candidates were dense only
        return cls.from_dict(values)

    def result_key(self) -> dict[str, Any]:
        """The fields that determine the results (what a re-run must match to be skipped)."""
        key = {k: v for k, v in self.to_dict().items() if k not in NON_RESULT_FIELDS}
        if self.accordion is None:
            key.pop("accordion_rule")  # no effect without Accordion
        for name in idle_options(self):  # no effect either (summaries once recorded them)
            key.pop(name)
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


def run_options() -> list[tuple[dataclasses.Field[Any], Option]]:
    """Every :class:`RunConfig` field with its :class:`Option`, in declaration order."""
    return [(f, f.metadata["option"]) for f in dataclasses.fields(RunConfig)]


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


def under_torchrun() -> bool:
    """Whether this process was started by ``torchrun`` (or another env:// launcher)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def resolve_config(cfg: RunConfig) -> RunConfig:
    """Fill task defaults and validate every field.

    Raises:
        ValueError, TypeError: the first invalid field, named.
    """
    if not isinstance(cfg, RunConfig):
        raise TypeError(f"`cfg` must be a RunConfig, got {type(cfg).__name__}")
    task = get_task(cfg.task)
    d = task.defaults
    # Options that act on nothing here are not filled from the task's defaults: a resolved
    # configuration records what ran, and resolves again unchanged.
    idle = idle_options(cfg)
    fill = {
        f.name: getattr(d, f.name)
        for f in dataclasses.fields(d)
        if getattr(cfg, f.name) is None and f.name not in idle
    }
    cfg = dataclasses.replace(cfg, **fill)
    for f, declared in run_options():  # the checks declared with the fields
        value = getattr(cfg, f.name)
        if value is None:
            continue
        if declared.check is not None:
            declared.check(f.name, value)
        if declared.choices is not None:
            check_choice(f.name, value, declared.choices)
    if cfg.tensorboard:
        require_tensorboard()
    check_out_dir(cfg.out)
    cfg = dataclasses.replace(cfg, rules=_rule_texts(cfg.rules))
    for text in cfg.rules:
        _prefixed("rule", Rule.parse, text)
    if cfg.nesterov and cfg.momentum == 0:
        raise ValueError("`nesterov` must be off when `momentum` is 0, got nesterov=True")
    check_idle_options(cfg)
    cfg = dataclasses.replace(cfg, milestones=_milestones(cfg.milestones))
    parse_model_spec(cfg.model)
    _prefixed("compressor", compressor_from_spec, cfg.compressor)
    if cfg.accordion is not None:
        _prefixed("accordion", compressor_from_spec, cfg.accordion)
        _prefixed("accordion", Accordion, cfg.compressor, cfg.accordion, eta=cfg.eta, interval=1)
    _check_schedule(cfg)
    cfg = dataclasses.replace(cfg, auto_outer_steps=outer_steps_list(cfg.auto_outer_steps),
                              auto_outer_exchanges=outer_exchanges_list(cfg.auto_outer_exchanges))
    cfg.check_outer()
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
    cfg = dataclasses.replace(cfg, launcher=launcher, out=str(cfg.out))
    check_hsdp(cfg)
    return cfg


def _check_schedule(cfg: RunConfig) -> None:
    """Validate the level-schedule options (``level_schedule``, ``warmup_steps``, ``gentle``)
    together (each alone is checked with its field)."""
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
    """The run's compressor: a level schedule, a warm-up, an Accordion switching between the
    two specs (deciding every ``interval_epochs`` epochs, converted to optimizer steps), or
    the ``compressor`` spec alone."""
    if cfg.level_schedule is not None:
        return _prefixed("level_schedule", Schedule.from_text, cfg.level_schedule, cfg.compressor,
                         gentle=cfg.gentle or "none", steps_per_epoch=steps_per_epoch)
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
