"""Accordion's rule applied to the global batch size: small in critical regimes, large otherwise.

The controller only decides; the training loop realises the batch size with gradient
accumulation and applies the scaled learning rate::

    ctl = BatchSizeController(512, 4096, micro_batch=128, workers=4, interval_samples=10 * n)
    for ...:
        plan = ctl.begin_step(base_lr=schedule(epoch))       # LR drops are detected here
        set_lr(optimizer, plan.lr)                           # base_lr * batch / small
        for _ in range(plan.micro_batches):                  # micro_batch examples per worker
            loss(next(batches)).backward()                   # gradients add up
        averaged = engine.reduce(grads / plan.micro_batches) # one communication round
        optimizer.step()
        ctl.end_step(averaged)                               # the aggregated gradient

References:
    Agarwal et al., "Adaptive Gradient Communication via Critical Learning Regime
    Identification" (Accordion), MLSys 2021, section on adaptive batch size.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gradzip._validate import check_bool, check_choice, check_int, check_real
from gradzip.control.rule import CRITICAL, LR_HOLDS, decide, is_lr_drop, joint_norm

__all__ = ["BatchPlan", "BatchSizeController"]

FORMAT_VERSION = 1
_MAX_LOG = 1024  # decision records kept (one per interval; older ones are dropped)


@dataclass(frozen=True)
class BatchPlan:
    """What the next optimizer step should do.

    Attributes:
        batch_size: global examples in the step (all workers together).
        micro_batches: micro-batches each worker accumulates before the one communication
            round: ``batch_size / (micro_batch * workers)``.
        lr: the learning rate to use, ``base_lr * batch_size / small`` (``None`` when no
            base learning rate was given).
        level: ``"critical"`` (small batch) or ``"steady"`` (large batch).
    """

    batch_size: int
    micro_batches: int
    lr: float | None
    level: str


class BatchSizeController:
    """Choose the global batch size by Accordion's critical-regime rule.

    Over each interval (``interval_samples`` training examples, rounded up to whole optimizer
    steps) the controller accumulates the aggregated gradient of every step weighted by its
    batch size, i.e. the sum of per-example gradients, and divides by the examples seen: the
    mean gradient over the interval, comparable between intervals of different batch sizes.
    At the interval's end: critical (``small`` batch) when the norm changed by at least
    ``eta`` relative to the previous interval's (a zero previous norm counts as critical),
    else ``large``. The first two intervals are critical (nothing to compare with yet). A
    learning-rate drop makes the batch small at once, as Accordion does
    (:data:`~gradzip.control.rule.LR_HOLDS`): by default for one whole interval from the drop
    (the interval restarts there, and its decision compares it with the last interval before
    the drop); with ``lr_hold="boundary"`` until the current interval ends.

    The learning rate follows the linear scaling rule: ``lr = base_lr * batch_size / small``,
    so ``base_lr`` is the rate tuned for the small batch. Give :meth:`begin_step` the
    *unscaled* rate of your schedule (the scaled one would look like a drop at every switch).

    Every worker holds its own controller; fed the same aggregated gradients they take the
    same decisions, so every worker runs the same number of micro-batches.

    Args:
        small: global batch size in critical regimes (>= 1).
        large: global batch size otherwise (>= small).
        micro_batch: examples per worker per forward/backward pass (>= 1).
        workers: number of workers (>= 1).
        interval_samples: training examples per interval (>= 1), e.g. 10 epochs.
        eta: threshold on the relative change of the norm (> 0).
        lr_drop: make the batch small after a learning-rate drop seen by :meth:`begin_step`.
        lr_hold: ``"interval"`` or ``"boundary"``, as for Accordion.

    Raises:
        TypeError, ValueError: invalid arguments, naming the parameter; a batch size that is
            not a multiple of ``micro_batch * workers``.

    References:
        Agarwal et al., "Adaptive Gradient Communication via Critical Learning Regime
        Identification", MLSys 2021.
    """

    def __init__(
        self,
        small: int = 512,
        large: int = 4096,
        *,
        micro_batch: int,
        interval_samples: int,
        workers: int = 1,
        eta: float = 0.5,
        lr_drop: bool = True,
        lr_hold: str = "interval",
    ) -> None:
        self.small = check_int("small", small, minimum=1)
        self.large = check_int("large", large, minimum=self.small)
        self.micro_batch = check_int("micro_batch", micro_batch, minimum=1)
        self.workers = check_int("workers", workers, minimum=1)
        self.interval_samples = check_int("interval_samples", interval_samples, minimum=1)
        self.eta = check_real("eta", eta, low=0, low_open=True)
        self.lr_drop = check_bool("lr_drop", lr_drop)
        self.lr_hold = check_choice("lr_hold", lr_hold, LR_HOLDS)
        unit = self.micro_batch * self.workers
        for name, value in (("small", self.small), ("large", self.large)):
            if value % unit:
                raise ValueError(
                    f"`{name}` must be a multiple of micro_batch * workers = {unit}, got {value}"
                )
        self.state: dict[str, Any] = {
            "level": CRITICAL,
            "rounds": 0,  # optimizer steps = communication rounds
            "samples": 0,
            "interval": 0,
            "interval_samples": 0,  # examples seen in the current interval
            "acc": {},
            "prev_norm": None,
            "lr_drop": False,
            "last_lr": None,
            "log": [],
            "counts": {"critical_rounds": 0, "steady_rounds": 0, "switches": 0},
        }
        self.state["log"] = [self._record(None, None, None, CRITICAL, "first")]

    # -- what to do next -------------------------------------------------------------------
    @property
    def level(self) -> str:
        """``"critical"`` or ``"steady"``."""
        return str(self.state["level"])

    @property
    def batch_size(self) -> int:
        """The global batch size of the next optimizer step."""
        return self.small if self.level == CRITICAL else self.large

    @property
    def micro_batches(self) -> int:
        """Micro-batches per worker per optimizer step."""
        return self.batch_size // (self.micro_batch * self.workers)

    @property
    def lr_scale(self) -> float:
        """``batch_size / small``: the linear scaling rule's factor."""
        return self.batch_size / self.small

    def scaled_lr(self, base_lr: float) -> float:
        """``base_lr * batch_size / small``."""
        return float(base_lr) * self.lr_scale

    @property
    def rounds(self) -> int:
        """Optimizer steps (communication rounds) so far."""
        return int(self.state["rounds"])

    @property
    def samples(self) -> int:
        """Training examples consumed so far (all workers)."""
        return int(self.state["samples"])

    def begin_step(self, base_lr: float | None = None) -> BatchPlan:
        """Plan the next optimizer step; a drop of ``base_lr`` (below 0.9x the previous
        step's) makes the batch small (see ``lr_hold``).

        Args:
            base_lr: the schedule's unscaled learning rate for this step, if any.
        """
        if base_lr is not None:
            base_lr = check_real("base_lr", base_lr, low=0)
            if self.lr_drop and is_lr_drop(self.state["last_lr"], base_lr):
                self.signal_lr_drop()
            self.state["last_lr"] = base_lr
        return BatchPlan(
            batch_size=self.batch_size,
            micro_batches=self.micro_batches,
            lr=None if base_lr is None else self.scaled_lr(base_lr),
            level=self.level,
        )

    def signal_lr_drop(self) -> None:
        """Mark a learning-rate drop: small batches for one whole interval from here
        (``lr_hold="interval"``) or until the current interval ends (``"boundary"``)."""
        if self.state["lr_drop"] and self.lr_hold == "boundary":
            return
        self.state["lr_drop"] = True
        if self.lr_hold == "interval":
            # The interval restarts: what it sums lies after the drop; prev_norm (kept) was
            # measured before it.
            self.state.update(acc={}, interval_samples=0)
        self._set_level(self._record(None, self.state["prev_norm"], None, CRITICAL, "lr_drop"))

    # -- after the step --------------------------------------------------------------------
    def end_step(self, grads: Mapping[str, torch.Tensor] | Sequence[torch.Tensor]) -> bool:
        """Account one optimizer step of :attr:`batch_size` examples.

        Args:
            grads: the step's aggregated gradient (averaged over all workers, identical on
                each), as ``name -> tensor`` or a sequence of tensors in a fixed order.

        Returns:
            Whether the step ended an interval (a decision was taken).
        """
        if isinstance(grads, Mapping):
            items = [(str(n), g) for n, g in grads.items()]
        elif isinstance(grads, Sequence) and not isinstance(grads, (str, torch.Tensor)):
            items = [(str(i), g) for i, g in enumerate(grads)]
        else:
            raise TypeError(
                f"`grads` must be a mapping name -> tensor or a sequence of tensors, "
                f"got {type(grads).__name__}"
            )
        batch = self.batch_size
        acc = dict(self.state["acc"])
        for name, grad in items:
            if not isinstance(grad, torch.Tensor):
                raise TypeError(f"gradient {name!r} must be a tensor, got {type(grad).__name__}")
            part = grad.detach().to(torch.float32) * batch  # sum of per-example gradients
            old = acc.get(name)
            acc[name] = part if old is None else old.to(part.device) + part
        state = self.state
        state["acc"] = acc
        state["rounds"] += 1
        state["samples"] += batch
        state["interval_samples"] += batch
        counts = dict(state["counts"])
        counts[f"{self.level}_rounds"] += 1
        state["counts"] = counts
        if state["interval_samples"] < self.interval_samples:
            return False
        norm = joint_norm(acc.values()) / state["interval_samples"]
        decision = decide(state["prev_norm"], norm, self.eta)
        record = self._record(norm, state["prev_norm"], decision.rel_change, decision.level,
                              decision.reason, interval=state["interval"] + 1)
        state.update(acc={}, prev_norm=norm, interval=state["interval"] + 1,
                     interval_samples=0, lr_drop=False)
        self._set_level(record)
        return True

    # -- observability ---------------------------------------------------------------------
    @property
    def decisions(self) -> list[dict[str, Any]]:
        """Decision records, oldest first (the last 1024): ``round`` and ``samples`` (when the
        decision took effect), ``interval``, ``norm`` and ``prev_norm`` (mean gradient norms;
        ``None`` where not measured), ``rel_change``, ``level``, ``batch_size``, ``reason``."""
        return [dict(r) for r in self.state["log"]]

    @property
    def counts(self) -> dict[str, int]:
        """Rounds run at each level and the number of level switches."""
        return dict(self.state["counts"])

    # -- checkpoints -----------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        """The constructor's arguments."""
        return {
            "small": self.small, "large": self.large, "micro_batch": self.micro_batch,
            "workers": self.workers, "interval_samples": self.interval_samples,
            "eta": self.eta, "lr_drop": self.lr_drop, "lr_hold": self.lr_hold,
        }

    def state_dict(self) -> dict[str, Any]:
        """Plain data and tensors: the configuration and the whole state (copied)."""
        state = copy.deepcopy({k: v for k, v in self.state.items() if k != "acc"})
        state["acc"] = {n: t.clone() for n, t in self.state["acc"].items()}
        return {"format_version": FORMAT_VERSION, "config": self.config(), "state": state}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output.

        Raises:
            ValueError: another format version or configuration (the first difference named).
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"`state_dict` must be a mapping, got {type(state_dict).__name__}")
        if state_dict.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"`format_version` must be {FORMAT_VERSION}, got {state_dict.get('format_version')!r}"
            )
        got = state_dict.get("config", {})
        for key, want in self.config().items():
            if got.get(key) != want:
                raise ValueError(f"`{key}` of the checkpoint must be {want!r}, got {got.get(key)!r}")
        state = state_dict["state"]
        if set(state) != set(self.state):
            raise ValueError(f"`state` must have keys {sorted(self.state)}, got {sorted(state)}")
        restored = copy.deepcopy({k: v for k, v in state.items() if k != "acc"})
        restored["acc"] = {str(n): t.clone() for n, t in state["acc"].items()}
        self.state = restored

    # -- internals -------------------------------------------------------------------------
    def _record(self, norm: float | None, prev: float | None, change: float | None,
                level: str, reason: str, interval: int | None = None) -> dict[str, Any]:
        state = self.state
        return {
            "round": state["rounds"], "samples": state["samples"],
            "interval": state["interval"] if interval is None else interval,
            "norm": norm, "prev_norm": prev, "rel_change": change, "level": level,
            "batch_size": self.small if level == CRITICAL else self.large, "reason": reason,
        }

    def _set_level(self, record: dict[str, Any]) -> None:
        counts = dict(self.state["counts"])
        counts["switches"] += int(record["level"] != self.state["level"])
        self.state["counts"] = counts
        self.state["level"] = record["level"]
        self.state["log"] = [*self.state["log"], record][-_MAX_LOG:]

