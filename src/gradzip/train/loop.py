"""The training loop shared by both launchers.

:class:`TrainLoop` drives one run's training through a stepper
(:mod:`gradzip.train.steppers`: every worker simulated in this process, or one worker of a
process group): per-step learning rate, optimizer step, evaluation and the per-epoch metrics
records.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from gradzip.compressors.base import Compressor
from gradzip.control.batch import BatchSizeController
from gradzip.train.auto_outer import SwitchingStepper
from gradzip.train.metrics import MetricsWriter, progress_bar
from gradzip.train.outer_stepper import OuterStepper
from gradzip.train.rule_records import control_fields, new_rule_decisions, rule_counts, rule_fields
from gradzip.train.schedules import lr_at, milestone_epochs, set_lr
from gradzip.train.steppers import DDPStepper, SimStepper, to_device

__all__ = ["DDPStepper", "SimStepper", "TrainLoop"]

log = logging.getLogger(__name__)


class TrainLoop:
    """One run's training: model, optimizer, schedule, steps, evaluation, records.

    Args:
        cfg: a resolved :class:`~gradzip.train.config.RunConfig`.
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
        if cfg.optimizer == "adamw":
            self.optimizer: torch.optim.Optimizer = torch.optim.AdamW(
                self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                betas=(0.9, 0.95))
        else:
            self.optimizer = torch.optim.SGD(
                self.model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                weight_decay=cfg.weight_decay, nesterov=cfg.nesterov,
            )
        self.compressor: Compressor | None = None
        self.stepper: SimStepper | DDPStepper | OuterStepper | SwitchingStepper | None = None
        self.batch_controller = self._batch_controller()
        self.decisions: list[dict[str, Any]] = []
        self._decision_count = 0
        # Where training stands after the last completed epoch (all of it plain data, so a
        # checkpoint can hold it and a resumed run continue exactly).
        self.done: dict[str, Any] = {
            "epoch": 0, "step": 0, "lr": cfg.lr, "seconds": 0.0, "eval_total": 0.0, "history": [],
            "prev": {"wire_bytes": 0, "payload_bytes": 0, "dense_payload_bytes": 0},
            "density_mark": [0, 0], "marks": {},
        }
        self._rng: dict[str, Any] | None = None

    # -- helpers ----------------------------------------------------------------------
    def _batch_controller(self) -> Any:
        """Accordion's batch-size controller for ``accordion_batch``, else None."""
        cfg = self.cfg
        if cfg.accordion_batch is None:
            return None
        small, large = cfg.accordion_batch
        examples = self.steps_per_epoch * cfg.batch_size * cfg.workers
        return BatchSizeController(
            small, large, micro_batch=cfg.batch_size, workers=cfg.workers, eta=cfg.eta,
            interval_samples=max(1, round(cfg.interval_epochs * examples)),
        )

    def _lr(self, epoch_float: float) -> float:
        cfg = self.cfg
        return lr_at(epoch_float, base_lr=cfg.lr, warmup_epochs=cfg.warmup_epochs,
                     milestones=milestone_epochs(cfg), gamma=cfg.gamma, workers=cfg.workers,
                     scale_with_workers=cfg.scale_lr)

    def _plan(self, epoch_float: float) -> tuple[int, float]:
        """Micro-batches per worker and learning rate of the next optimizer step."""
        lr = self._lr(epoch_float)
        ctl = self.batch_controller
        if ctl is None:
            return 1, lr
        # The schedule's rate belongs to the global batch batch_size * workers; the
        # controller scales linearly from its small batch.
        unit = self.cfg.batch_size * self.cfg.workers
        plan = ctl.begin_step(base_lr=lr * ctl.small / unit)
        return plan.micro_batches, float(plan.lr)

    def _report(self) -> dict[str, Any]:
        """The compressor's own report (see ``Compressor.report``); empty before training."""
        state = self.stepper.compressor_state if self.stepper is not None else None
        if self.compressor is None or state is None:
            return {}
        return self.compressor.report(state)

    def _engine(self) -> Any:
        """The stepper's engine (``None`` before a process group's first step)."""
        return getattr(self.stepper, "engine", None)

    def _track_decisions(self) -> None:
        """Append the controllers' latest decision records to the run's log when new (a
        rule's records carry its ``rule`` text)."""
        self.decisions.extend(new_rule_decisions(self._engine(), self.done["marks"]))
        counts = self._report().get("counts")
        if counts is not None and counts["decisions"] != self._decision_count:
            # Every point since the last poll: one step can hold two (an LR drop seen in an
            # interval's last step), and the latest alone would miss the drop's records.
            state = self.stepper.compressor_state  # type: ignore[union-attr]
            self.decisions.extend(self.compressor.decisions(  # type: ignore[union-attr]
                state, since=self._decision_count))
            self._decision_count = counts["decisions"]
        # --auto-outer's weighing of those decisions (after them: each follows its decision).
        self.decisions.extend(getattr(self.stepper, "take_records", list)())

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

    def _density(self, prev: tuple[Any, Any]) -> tuple[float | None, tuple[Any, Any]]:
        """Fraction of gradient entries sent in the epoch, where the compressor reports one."""
        report = self._report()
        parts = report.get("density_parts")
        if parts is not None:
            now = (parts[0], parts[1])
            offered = now[1] - prev[1]
            return ((now[0] - prev[0]) / offered if offered else None), now
        return report.get("density"), prev

    def _evaluate(self) -> Tensor:
        assert self.stepper is not None
        self.stepper.sync_buffers()
        # A sharded model's forward is a collective of its island, and the ranks' test shards
        # may take different numbers of batches: the HSDP steppers hand an unsharded copy.
        eval_model = getattr(self.stepper, "eval_model", None)
        model = self.model if eval_model is None else eval_model()
        model.eval()
        sums = sum(self.task.eval_sums(model, self.data, self.cfg, self.cfg.workers, r)
                   for r in self.stepper.local_ranks)
        model.train()
        return sums  # type: ignore[return-value]

    def _eval_record(self, epoch: float, step: int, lr: float) -> dict[str, Any]:
        """An ``eval`` record between epochs (``eval_every``): the test metrics of the model
        now and the cumulative byte counters. Every process calls it (collectives)."""
        assert self.stepper is not None
        metrics = self.task.metrics(self.stepper.all_sum(self._evaluate().double()))
        report = self._report()
        if "choice" in report:  # auto: the level in use, and the steps run at each so far
            metrics.update(level=report["choice"], level_steps=report["counts"]["steps"])
        metrics.update(getattr(self.stepper, "eval_fields", dict)())  # --auto-outer: H, switch
        return {"kind": "eval", "epoch": epoch, "step": step, "lr": lr, **metrics,
                **self._bytes(), "rounds": self.stepper.stats["steps"]}

    def summary_fields(self) -> dict[str, Any]:
        """Controller counters for ``summary.json`` (empty without Accordion)."""
        out: dict[str, Any] = {}
        counts = self._report().get("counts")
        if counts is not None:
            out["accordion_counts"] = counts
        if self.batch_controller is not None:
            out["batch_counts"] = {**self.batch_controller.counts,
                                   "samples": self.batch_controller.samples}
        out.update(rule_counts(self._engine()))
        out.update(getattr(self.stepper, "summary_fields", dict)())  # --auto-outer's switch
        return out

    def extra_files(self) -> dict[str, Any]:
        """Additional JSON files for the run directory (the controllers' decision logs)."""
        out: dict[str, Any] = {}
        main = [r for r in self.decisions if "rule" not in r]
        if main:
            out["accordion_decisions.json"] = main
        if len(main) < len(self.decisions):
            out["rule_decisions.json"] = [r for r in self.decisions if "rule" in r]
        if self.batch_controller is not None:
            out["batch_decisions.json"] = self.batch_controller.decisions
        return out

    # -- checkpoints ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This process's whole training state after the last completed epoch: model,
        optimizer, gradzip state of its workers, controllers, random generators, records."""
        assert self.stepper is not None, "setup() first"
        rng: dict[str, Any] = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        ctl = self.batch_controller
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "gradzip": self.stepper.state_dict(),
            "batch_controller": ctl.state_dict() if ctl is not None else None,
            "rng": rng,
            "loop": {**self.done, "decisions": self.decisions,
                     "decision_count": self._decision_count},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` output (after :meth:`setup`).

        Raises:
            ValueError: a part that does not fit this run (the part named).
        """
        assert self.stepper is not None, "setup() first"
        for key in ("model", "optimizer", "gradzip", "batch_controller", "rng", "loop"):
            if key not in state:
                raise ValueError(f"the checkpoint must hold `{key}`, got keys {sorted(state)}")
        if (state["batch_controller"] is None) != (self.batch_controller is None):
            raise ValueError("the checkpoint's `batch_controller` must match `accordion_batch`")
        for part, load in (("model", self.model.load_state_dict),
                           ("optimizer", self.optimizer.load_state_dict),
                           ("gradzip", self.stepper.load_state_dict)):
            try:
                load(state[part])
            except (KeyError, RuntimeError, TypeError, ValueError) as exc:
                raise ValueError(f"the checkpoint's `{part}` does not fit this run: "
                                 f"{' '.join(str(exc).split())}") from None
        if self.batch_controller is not None:
            self.batch_controller.load_state_dict(to_device(state["batch_controller"], self.device))
        loop = {"eval_total": 0.0, **state["loop"]}  # checkpoints from before eval_every
        want = {*self.done, "decisions", "decision_count"}
        if set(loop) != want:
            raise ValueError(f"the checkpoint's `loop` must have keys {sorted(want)}, "
                             f"got {sorted(loop)}")
        self.decisions = list(loop.pop("decisions"))
        self._decision_count = int(loop.pop("decision_count"))
        self.done = loop
        self._rng = state["rng"]  # restored when training continues

    # -- the loop ---------------------------------------------------------------------
    def setup(self, build_compressor: Callable[[Any, int], Compressor]) -> None:
        """Build the compressor and the stepper (DDP and its hook, or the simulated engine)."""
        self.compressor = build_compressor(self.cfg, self.steps_per_epoch)
        stepper_cls: Any = SimStepper if self.cfg.launcher == "sim" else DDPStepper
        if self.cfg.outer_steps:
            stepper_cls = OuterStepper
        if self.cfg.auto_outer:  # per-step first, outer steps once Auto's decisions say so
            stepper_cls = SwitchingStepper
        if self.cfg.hsdp or self.cfg.fsdp:
            # Imported here: torch's FSDP2 is slow to import and most runs never use it.
            from gradzip.train import hsdp_stepper

            stepper_cls = (hsdp_stepper.ShardedOuterStepper if self.cfg.outer_steps
                           else hsdp_stepper.HSDPStepper)
        self.stepper = stepper_cls(self.model, self.task, self.compressor, self.cfg,
                                   self.optimizer, self.device)

    def run(self, writer: MetricsWriter | None,
            checkpoint: Callable[[TrainLoop], None] | None = None,
            ) -> tuple[list[dict[str, Any]], dict[str, Any], float]:
        """Train the epochs not done yet (all of them, unless a checkpoint was loaded).

        Args:
            writer: where records go (rank 0), or None.
            checkpoint: called after each epoch's record is written; decides itself whether
                to save (every process calls it: saving may be a collective).

        Returns:
            (epoch records, cumulative counters (max over workers), training seconds).
        """
        if self.stepper is None:
            raise RuntimeError("TrainLoop.setup() must run before run()")
        cfg, task, spe, stepper = self.cfg, self.task, self.steps_per_epoch, self.stepper
        done = self.done
        if self._rng is not None:
            torch.set_rng_state(self._rng["cpu"].cpu())
            if "cuda" in self._rng and self.device.type == "cuda":
                torch.cuda.set_rng_state(self._rng["cuda"].cpu(), self.device)
        bar = progress_bar((cfg.epochs - done["epoch"]) * spe, self.progress,
                           f"{cfg.task} {cfg.compressor}")
        history = done["history"]
        started = time.perf_counter() - done["seconds"]
        step, lr = done["step"], done["lr"]
        self._track_decisions()
        self.model.train()
        for epoch in range(done["epoch"], cfg.epochs):
            epoch_start = time.perf_counter()
            shards = [task.batches(self.data, cfg, cfg.workers, r, epoch)
                      for r in stepper.local_ranks]
            carries = [task.init_carry(self.model, cfg) for _ in stepper.local_ranks]
            loss_sum, used, i = 0.0, 0, 0
            while i < spe:
                micro, lr = self._plan(epoch + i / spe)
                if i + micro > spe:
                    break  # too few micro-batches left for this step: the epoch ends here
                set_lr(self.optimizer, lr)
                skipped = stepper.stats["skipped_steps"]
                step_loss = stepper.step([s[i:i + micro] for s in shards], carries)
                if cfg.clip:
                    nn.utils.clip_grad_norm_(self.model.parameters(), cfg.clip)
                if stepper.stats["skipped_steps"] == skipped:
                    self.optimizer.step()
                if self.batch_controller is not None:
                    self.batch_controller.end_step(stepper.averaged)
                loss_sum, used, i, step = loss_sum + step_loss, used + 1, i + micro, step + 1
                self._track_decisions()
                if writer is not None and cfg.log_every and step % cfg.log_every == 0:
                    writer.write({"kind": "step", "epoch": epoch + i / spe, "step": step,
                                  "lr": lr, "loss": step_loss / len(stepper.local_ranks),
                                  "wire_bytes": max(stepper.stats["wire_bytes"])})
                due = getattr(stepper, "eval_due", None)  # --auto-outer: at synchronisations
                if cfg.eval_every and (step % cfg.eval_every == 0 if due is None
                                       else due(step, cfg.eval_every)) and i < spe:
                    # Out of the training clock: what time-to-target measurements subtract.
                    eval_start = time.perf_counter()
                    rec = self._eval_record(epoch + i / spe, step, lr)
                    now = time.perf_counter()
                    done["eval_total"] += now - eval_start
                    rec.update(eval_seconds=now - eval_start, seconds=now - started,
                               train_seconds=now - started - done["eval_total"])
                    if writer is not None:
                        writer.write(rec)
                bar.update(micro)
            bar.update(spe - i)
            eval_start = time.perf_counter()
            sums = self._evaluate()
            reduced = stepper.all_sum(torch.cat([sums.double(),
                                                 torch.tensor([loss_sum], dtype=torch.float64)]))
            counts = self._bytes()
            prev = done["prev"]
            rec: dict[str, Any] = {
                "kind": "epoch", "epoch": epoch + 1, "step": step, "lr": lr,
                "train_loss": float(reduced[-1]) / (max(used, 1) * cfg.workers),
                **task.metrics(reduced[:-1]),
                **counts,
                "epoch_wire_bytes": counts["wire_bytes"] - prev["wire_bytes"],
                "compression": (counts["dense_wire_bytes"] / counts["wire_bytes"]
                                if counts["wire_bytes"] else None),
                "payload_fraction": ((counts["payload_bytes"] - prev["payload_bytes"])
                                     / max(counts["dense_payload_bytes"]
                                           - prev["dense_payload_bytes"], 1)),
                "rounds": stepper.stats["steps"],
                "skipped_steps": stepper.stats["skipped_steps"],
            }
            density, mark = self._density(tuple(done["density_mark"]))  # type: ignore[arg-type]
            if density is not None:
                rec["density"] = density
            # Relative compression error of the epoch (read once, which starts the next span;
            # see gradzip.engine.error): ``compression_error`` and, with a controller, per level.
            rec.update(stepper.compression_error())
            rec.update(control_fields(self._report(), self.batch_controller, done["marks"]))
            rec.update(getattr(stepper, "epoch_fields", dict)())  # --auto-outer: H in force
            rec.update(rule_fields(self._engine(), done["marks"]))
            now = time.perf_counter()
            rec["eval_seconds"] = now - eval_start
            rec["epoch_seconds"], rec["seconds"] = now - epoch_start, now - started
            done["eval_total"] += now - eval_start
            rec["train_seconds"] = now - started - done["eval_total"]
            history.append(rec)
            done.update(epoch=epoch + 1, step=step, lr=lr, seconds=now - started, prev=counts,
                        density_mark=list(mark))
            if writer is not None:
                writer.write(rec)
            if checkpoint is not None:
                checkpoint(self)
            bar.set_postfix({task.metric[:4]: f"{rec[task.metric]:.4g}",
                             "loss": f"{rec['train_loss']:.3g}"}, refresh=False)
        bar.close()
        counts = self._bytes()
        stats = {**counts, "steps": step, "rounds": stepper.stats["steps"],
                 "skipped_steps": stepper.stats["skipped_steps"]}
        return history, stats, time.perf_counter() - started
