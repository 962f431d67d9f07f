"""What every training task is: its defaults, its model, its batches, its evaluation.

A task knows how to load its data, build its default model, split one epoch into per-worker
mini-batches (disjoint shards, reshuffled every epoch from the seed), compute a worker's loss,
and evaluate. The runner is the same for every task.

Evaluation is computed as sums (loss, correct, count) over ``world`` disjoint shards of the
test set, so a simulated run and a multi-process run (one shard per process, then summed)
report the same numbers.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradzip.ops.random import generator_for
from gradzip.spec import parse_spec
from gradzip.train import data as D
from gradzip.train.models import available_models, build_model

__all__ = ["Defaults", "Task", "data_option", "new_model", "parse_model_spec"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Defaults:
    """Default hyper-parameters of a task (the learning rate is per worker).

    Attributes:
        model: model spec (``name`` or ``name:key=value,...``).
        epochs: training epochs.
        batch_size: examples (or LM columns) per worker per step.
        lr: single-worker learning rate; the peak is ``lr * workers`` (linear scaling rule).
        momentum, weight_decay, nesterov: SGD settings.
        warmup_epochs: linear warm-up from ``lr`` to the peak.
        milestones: LR decay points; values below 1 are fractions of training, others epochs.
        gamma: LR factor at each milestone.
        interval_epochs: Accordion's decision interval.
        clip: max global gradient norm (of the averaged gradient), or None.
        threads: torch intra-op threads for a simulated run (None: torch's default). Tiny
            models run fastest on one thread; more only adds synchronisation overhead.
    """

    model: str
    epochs: int
    batch_size: int
    lr: float
    momentum: float = 0.9
    weight_decay: float = 0.0
    nesterov: bool = False
    warmup_epochs: float = 0.0
    milestones: tuple[float, ...] = (0.5, 0.75)
    gamma: float = 0.1
    interval_epochs: float = 10.0
    clip: float | None = None
    threads: int | None = None


def parse_model_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """Split ``"resnet20:width=8"`` into the model name and constructor keywords.

    Raises:
        ValueError: unknown model name or malformed keywords.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise TypeError(f"`model` must be a model name such as 'resnet20', got {spec!r}")
    name, _, rest = spec.strip().partition(":")
    name = name.strip().lower()
    if name not in available_models():
        raise ValueError(f"`model` must be one of {', '.join(available_models())}, got {name!r}")
    kwargs = parse_spec("model:" + rest)[1] if rest.strip() else {}
    return name, kwargs


def new_model(spec: str, num_classes: int, seed: int, **extra: Any) -> nn.Module:
    """Build a model whose initial weights depend only on ``seed`` (global RNG left as it was)."""
    name, kwargs = parse_model_spec(spec)
    kwargs = {**extra, **kwargs}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            return build_model(name, num_classes, **kwargs)
        except TypeError as exc:  # an unknown keyword in the model spec
            raise ValueError(f"`model` keywords do not fit {name!r}: {exc}") from None


@contextlib.contextmanager
def data_option() -> Iterator[None]:
    """Inside, a loader's refusal of its ``path`` is reported as one of the run's ``--data``
    (the loaders are public functions whose parameter is ``path``)."""
    try:
        yield
    except ValueError as exc:
        text = str(exc)
        if not text.startswith("`path`"):
            raise
        raise ValueError("`--data`" + text[len("`path`"):]) from None


@dataclass
class Task:
    """Base class of tasks: image/vector classification with cross-entropy and accuracy."""

    name: str
    description: str
    defaults: Defaults
    metric: str = "accuracy"
    needs_data: bool = False
    augment: bool = False
    models: tuple[str, ...] = field(default_factory=tuple)

    # -- data and model ---------------------------------------------------------------
    def load(self, cfg: Any) -> Any:
        """Load the data for ``cfg`` (a resolved run configuration)."""
        raise NotImplementedError

    def build_model(self, cfg: Any, data: Any) -> nn.Module:
        """The model of ``cfg.model``, initialised from ``cfg.seed``."""
        return new_model(cfg.model, data.num_classes, cfg.seed)

    @staticmethod
    def _limit(data: D.TaskData, limit: int | None, seed: int) -> D.TaskData:
        if limit is None or limit >= len(data.train):
            return data
        keep = torch.randperm(len(data.train), generator=generator_for(seed, "limit-train"))[:limit]
        keep = keep.sort().values
        data.train = D.TensorSplit(data.train.x[keep], data.train.y[keep])
        return data

    # -- training -----------------------------------------------------------------------
    def steps_per_epoch(self, data: Any, cfg: Any, world: int) -> int:
        """Optimizer steps per epoch (identical on every worker)."""
        per_worker = len(data.train) // world
        if per_worker < cfg.batch_size:
            raise ValueError(
                f"`batch_size` must be <= the {per_worker} training examples per worker "
                f"({len(data.train)} examples, {world} workers), got {cfg.batch_size}"
            )
        return per_worker // cfg.batch_size

    def batches(self, data: Any, cfg: Any, world: int, rank: int, epoch: int) -> list[Any]:
        """Worker ``rank``'s mini-batches of ``epoch``: a disjoint shard, reshuffled per epoch."""
        idx = D.shard_indices(len(data.train), world, rank, epoch, cfg.seed)
        out = list(D.iter_batches(data.train, idx, cfg.batch_size, drop_last=True))
        if self.augment:
            out = [
                (D.augment_batch(x, generator_for(cfg.seed, "augment", epoch, rank, i)), y)
                for i, (x, y) in enumerate(out)
            ]
        return out

    def init_carry(self, model: nn.Module, cfg: Any) -> Any:
        """State carried from one batch to the next by one worker (LSTM hidden state)."""
        return None

    def loss(self, model: nn.Module, batch: Any, carry: Any) -> tuple[Tensor, Any]:
        """Mean loss of one worker's batch, and the new carry."""
        x, y = batch
        return F.cross_entropy(model(x), y), carry

    # -- evaluation ---------------------------------------------------------------------
    @torch.no_grad()
    def eval_sums(self, model: nn.Module, data: Any, cfg: Any, world: int, rank: int) -> Tensor:
        """``[loss_sum, correct, count]`` over shard ``rank`` of ``world`` of the test set."""
        test = data.test
        per = math.ceil(len(test) / world)
        x, y = test.x[rank * per:(rank + 1) * per], test.y[rank * per:(rank + 1) * per]
        device = next(model.parameters()).device
        sums = torch.zeros(3, dtype=torch.float64)
        for start in range(0, len(y), 1000):
            xb, yb = x[start:start + 1000].to(device), y[start:start + 1000].to(device)
            logits = model(xb)
            sums[0] += float(F.cross_entropy(logits, yb, reduction="sum"))
            sums[1] += float((logits.argmax(1) == yb).sum())
            sums[2] += len(yb)
        return sums

    def metrics(self, sums: Tensor) -> dict[str, float]:
        """Turn summed evaluation counts into ``{"test_loss", metric}``."""
        count = max(float(sums[2]), 1.0)
        return {"test_loss": float(sums[0]) / count, "accuracy": float(sums[1]) / count}
