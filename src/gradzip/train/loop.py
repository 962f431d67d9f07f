"""The training loop shared by both launchers, and the two ways of averaging gradients.

:class:`SimStepper` holds every worker in this process (an :class:`~gradzip.Engine` over a
:class:`~gradzip.SimulatedGroup`); :class:`DDPStepper` is one worker of a real process group
(``DistributedDataParallel`` with the gradzip comm hook). :class:`TrainLoop` drives either:
per-step learning rate, optimizer step, evaluation and the per-epoch metrics records.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from gradzip.comm.simulated import SimulatedGroup
from gradzip.compressors.base import Compressor
from gradzip.compressors.threshold import HardThreshold
from gradzip.compressors.topk import TopK
from gradzip.engine import Engine
from gradzip.train.metrics import MetricsWriter
from gradzip.train.schedules import lr_at, set_lr

__all__ = ["DDPStepper", "SimStepper", "TrainLoop", "require_ddp"]

log = logging.getLogger(__name__)


def require_ddp() -> Any:
    """The ``gradzip.ddp`` module, or a clear error where it is missing.

    Raises:
        ValueError: this installation has no DDP hook (the ``procs`` launcher needs it).
    """
    try:
        from gradzip import ddp
    except ImportError:
        raise ValueError(
            "`launcher` 'procs' needs gradzip.ddp, which this installation does not provide; "
            "use launcher 'sim'"
        ) from None
    return ddp


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to(b, device) for b in batch)
    return batch


class SimStepper:
    """All workers in one process; one model replica receives the averaged gradient."""

    def __init__(self, model: nn.Module, task: Any, compressor: Compressor, cfg: Any,
                 optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.model, self.task, self.device = model, task, device
        self.world = cfg.workers
        self.local_ranks = list(range(self.world))
        self.engine = Engine(model, compressor, error_feedback=cfg.error_feedback,
                             collective=SimulatedGroup(self.world), optimizer=optimizer)
        self.params = dict(self.engine.params)
        self.buffers = list(model.buffers())

    def step(self, batches: list[Any], carries: list[Any]) -> float:
        """Compute every worker's gradient, average them, leave the average in ``.grad``.

        Returns:
            The sum over workers of their mean batch losses.
        """
        saved = [b.clone() for b in self.buffers]
        grads: dict[str, list[Tensor]] = {n: [] for n in self.params}
        total = 0.0
        # Worker 0 runs last, from the pre-step buffers, so BatchNorm running statistics end
        # up as worker 0's, which is what DDP's buffer broadcast keeps.
        for w in reversed(range(self.world)):
            if w != self.world - 1:
                for b, s in zip(self.buffers, saved, strict=True):
                    b.copy_(s)
            for p in self.params.values():
                p.grad = None
            loss, carries[w] = self.task.loss(self.model, _to(batches[w], self.device), carries[w])
            loss.backward()
            total += float(loss.detach())
            for n, p in self.params.items():
                grads[n].append(p.grad if p.grad is not None else torch.zeros_like(p))
        stacked = {n: torch.stack(g[::-1]) for n, g in grads.items()}
        for n, avg in self.engine.reduce(stacked).items():
            self.params[n].grad = avg
        return total

    @property
    def stats(self) -> dict[str, Any]:
        return self.engine.stats

    @property
    def compressor_state(self) -> Any:
        return self.engine.compressor_state

    def all_sum(self, x: Tensor) -> Tensor:
        return x

    def all_max(self, x: Tensor) -> Tensor:
        return x

    def sync_buffers(self) -> None:
        """Nothing to do: one replica."""


class DDPStepper:
    """One worker of a ``torch.distributed`` group: DDP with the gradzip comm hook."""

    def __init__(self, model: nn.Module, task: Any, compressor: Compressor, cfg: Any,
                 optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        self.dist = dist
        self.model, self.task, self.device = model, task, device
        self.world = dist.get_world_size()
        self.local_ranks = [dist.get_rank()]
        ids = [device.index] if device.type == "cuda" else None
        # Buffers (BatchNorm statistics) follow rank 0 at every forward: DDP's default.
        self.ddp = DistributedDataParallel(model, device_ids=ids)
        self.hook = require_ddp().register(self.ddp, compressor, optimizer=optimizer)

    def step(self, batches: list[Any], carries: list[Any]) -> float:
        for p in self.model.parameters():
            p.grad = None
        loss, carries[0] = self.task.loss(self.ddp, _to(batches[0], self.device), carries[0])
        loss.backward()  # the comm hook leaves the averaged, compressed gradient in .grad
        return float(loss.detach())

    @property
    def stats(self) -> dict[str, Any]:
        # The hook reports this rank's counters as numbers; the loop expects per-worker lists.
        return {k: ([v] if k.endswith("_bytes") else v) for k, v in self.hook.stats.items()}

    @property
    def compressor_state(self) -> Any:
        engine = getattr(self.hook, "engine", None)
        return getattr(engine, "compressor_state", None)

    def _reduce(self, x: Tensor, op: Any) -> Tensor:
        y = x.to(self.device)
        self.dist.all_reduce(y, op=op)
        return y.cpu()

    def all_sum(self, x: Tensor) -> Tensor:
        return self._reduce(x, self.dist.ReduceOp.SUM)

    def all_max(self, x: Tensor) -> Tensor:
        return self._reduce(x, self.dist.ReduceOp.MAX)

    def sync_buffers(self) -> None:
        """Give every rank worker 0's BatchNorm statistics before evaluating."""
        for b in self.model.buffers():
            self.dist.broadcast(b, 0)


class TrainLoop:
    """One run's training: model, optimizer, schedule, steps, evaluation, records.

    Args:
        cfg: a resolved :class:`~gradzip.train.runner.RunConfig`.
        task: the task object.
        data: what ``task.load`` returned.
        rank: this process's first worker rank (0 in a simulated run).
        progress: show a tqdm progress bar.
    """

    def __init__(self, cfg: Any, task: Any, data: Any, *, rank: int, progress: bool) -> None:
        self.cfg, self.task, self.data, self.rank = cfg, task, data, rank
        self.progress = progress
        if cfg.device == "cuda":
            self.device = torch.device("cuda", rank % torch.cuda.device_count())
        else:
            self.device = torch.device("cpu")
        self.steps_per_epoch = task.steps_per_epoch(data, cfg, cfg.workers)
        self.model = task.build_model(cfg, data).to(self.device)
        self.optimizer = torch.optim.SGD(
            self.model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
            weight_decay=cfg.weight_decay, nesterov=cfg.nesterov,
        )
        self.compressor: Compressor | None = None
        self.stepper: SimStepper | DDPStepper | None = None

    # -- helpers ----------------------------------------------------------------------
    def _lr(self, epoch_float: float) -> float:
        from gradzip.train.runner import milestone_epochs

        cfg = self.cfg
        return lr_at(epoch_float, base_lr=cfg.lr, warmup_epochs=cfg.warmup_epochs,
                     milestones=milestone_epochs(cfg), gamma=cfg.gamma, workers=cfg.workers,
                     scale_with_workers=cfg.scale_lr)

    def levels(self) -> dict[str, str] | None:
        """Accordion's current level per tensor, or None without Accordion."""
        levels_fn = getattr(self.compressor, "levels", None)
        state = self.stepper.compressor_state if self.stepper is not None else None
        if levels_fn is None or state is None:
            return None
        return dict(levels_fn(state))

    def _bytes(self) -> dict[str, int]:
        """Cumulative counters, max over all workers (a collective in a process group)."""
        assert self.stepper is not None
        s = self.stepper.stats
        local = torch.tensor([max(s["payload_bytes"]), max(s["wire_bytes"]),
                              max(s["dense_payload_bytes"]), max(s["dense_wire_bytes"])],
                             dtype=torch.float64)
        vals = [int(v) for v in self.stepper.all_max(local).tolist()]
        return dict(zip(("payload_bytes", "wire_bytes", "dense_payload_bytes",
                         "dense_wire_bytes"), vals, strict=True))

    def _density(self, prev: tuple[int, int]) -> tuple[float | None, tuple[int, int]]:
        """Fraction of gradient entries sent in the epoch, where that is meaningful."""
        comp, state = self.compressor, self.stepper.compressor_state if self.stepper else None
        if isinstance(comp, HardThreshold) and isinstance(state, dict) and "sent" in state:
            now = (int(state["sent"]), int(state["offered"]))
            offered = now[1] - prev[1]
            return ((now[0] - prev[0]) / offered if offered else None), now
        if isinstance(comp, TopK):
            return comp.ratio, prev
        return None, prev

    def _evaluate(self) -> Tensor:
        assert self.stepper is not None
        self.stepper.sync_buffers()
        self.model.eval()
        sums = sum(self.task.eval_sums(self.model, self.data, self.cfg, self.cfg.workers, r)
                   for r in self.stepper.local_ranks)
        self.model.train()
        return sums  # type: ignore[return-value]

    def extra_files(self) -> dict[str, Any]:
        """Additional JSON files for the run directory (Accordion's decisions log)."""
        log_fn = getattr(self.compressor, "decisions", None)
        state = self.stepper.compressor_state if self.stepper is not None else None
        if log_fn is None or state is None:
            return {}
        return {"accordion_decisions.json": list(log_fn(state))}

    # -- the loop ---------------------------------------------------------------------
    def run(self, build_compressor: Callable[[Any, int], Compressor],
            writer: MetricsWriter | None) -> tuple[list[dict[str, Any]], dict[str, Any], float]:
        """Train every epoch.

        Returns:
            (epoch records, cumulative counters (max over workers), training seconds).
        """
        cfg, task, spe = self.cfg, self.task, self.steps_per_epoch
        self.compressor = build_compressor(cfg, spe)
        stepper_cls = SimStepper if cfg.launcher == "sim" else DDPStepper
        self.stepper = stepper = stepper_cls(self.model, task, self.compressor, cfg,
                                             self.optimizer, self.device)
        bar = _progress_bar(cfg.epochs * spe, self.progress, f"{cfg.task} {cfg.compressor}")
        history: list[dict[str, Any]] = []
        started = time.perf_counter()
        prev_wire, density_mark, step, lr = 0, (0, 0), 0, cfg.lr
        prev_payload = prev_dense = 0
        self.model.train()
        for epoch in range(cfg.epochs):
            epoch_start = time.perf_counter()
            shards = [task.batches(self.data, cfg, cfg.workers, r, epoch)
                      for r in stepper.local_ranks]
            carries = [task.init_carry(self.model, cfg) for _ in stepper.local_ranks]
            loss_sum, critical_seen, level_count = 0.0, 0, 0
            for i in range(spe):
                lr = self._lr(epoch + i / spe)
                set_lr(self.optimizer, lr)
                skipped = stepper.stats["skipped_steps"]
                step_loss = stepper.step([s[i] for s in shards], carries)
                if cfg.clip is not None:
                    nn.utils.clip_grad_norm_(self.model.parameters(), cfg.clip)
                if stepper.stats["skipped_steps"] == skipped:
                    self.optimizer.step()
                loss_sum += step_loss
                step += 1
                levels = self.levels()
                if levels is not None:
                    critical_seen += sum(v == "critical" for v in levels.values())
                    level_count += len(levels)
                if writer is not None and cfg.log_every and step % cfg.log_every == 0:
                    writer.write({"kind": "step", "epoch": epoch + (i + 1) / spe, "step": step,
                                  "lr": lr, "loss": step_loss / len(stepper.local_ranks),
                                  "wire_bytes": max(stepper.stats["wire_bytes"])})
                bar.update(1)
            sums = self._evaluate()
            reduced = stepper.all_sum(torch.cat([sums.double(),
                                                 torch.tensor([loss_sum], dtype=torch.float64)]))
            counts = self._bytes()
            rec: dict[str, Any] = {
                "kind": "epoch", "epoch": epoch + 1, "step": step, "lr": lr,
                "train_loss": float(reduced[-1]) / (spe * cfg.workers),
                **task.metrics(reduced[:-1]),
                **counts,
                "epoch_wire_bytes": counts["wire_bytes"] - prev_wire,
                "compression": (counts["dense_wire_bytes"] / counts["wire_bytes"]
                                if counts["wire_bytes"] else None),
                "payload_fraction": ((counts["payload_bytes"] - prev_payload)
                                     / max(counts["dense_payload_bytes"] - prev_dense, 1)),
                "rounds": stepper.stats["steps"],
                "skipped_steps": stepper.stats["skipped_steps"],
            }
            density, density_mark = self._density(density_mark)
            if density is not None:
                rec["density"] = density
            levels = self.levels()
            if levels is not None:
                rec["critical"] = sum(v == "critical" for v in levels.values())
                rec["critical_fraction"] = critical_seen / max(level_count, 1)
                rec["levels"] = levels
            now = time.perf_counter()
            rec["epoch_seconds"], rec["seconds"] = now - epoch_start, now - started
            prev_wire = counts["wire_bytes"]
            prev_payload, prev_dense = counts["payload_bytes"], counts["dense_payload_bytes"]
            history.append(rec)
            if writer is not None:
                writer.write(rec)
            bar.set_postfix({task.metric[:4]: f"{rec[task.metric]:.4g}",
                             "loss": f"{rec['train_loss']:.3g}"}, refresh=False)
        bar.close()
        counts = self._bytes()
        stats = {**counts, "steps": step, "rounds": stepper.stats["steps"],
                 "skipped_steps": stepper.stats["skipped_steps"]}
        return history, stats, time.perf_counter() - started


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, *args: Any, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int, enabled: bool, desc: str) -> Any:
    if not enabled:
        return _NoBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, leave=False)
