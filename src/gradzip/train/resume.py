"""Whether a run may use its output directory, and how it continues there.

The order is the point: :func:`plan_out_dir` (every check, nothing written) decides first;
:func:`open_out_dir` (rank 0, after every process has loaded its checkpoint) is the first
thing that writes; :class:`Checkpointer` then saves after epochs. A run refused at any check
leaves the directory byte for byte as it was.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gradzip.train.events import EVENTS_DIR, EventSink
from gradzip.train.metrics import MetricsWriter, read_metrics, read_summary
from gradzip.train.rundir import (
    FORMAT_VERSION,
    Manifest,
    atomic_save,
    commit_checkpoint,
    epoch_directory,
    prune_checkpoints,
    rank_file,
    read_manifest,
    remove_checkpoints,
    stored_config,
    write_run_file,
)

__all__ = ["Checkpointer", "Plan", "agree", "open_out_dir", "plan_out_dir"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """How a run uses its directory.

    Attributes:
        manifest: the checkpoint to continue from (None: start from the beginning).
        finished: the stored summary when a resumed run has nothing left to do.
    """

    manifest: Manifest | None = None
    finished: dict[str, Any] | None = None

    @property
    def manifest_dict(self) -> dict[str, Any] | None:
        return None if self.manifest is None else self.manifest.to_dict()


def _refuse(out: str, difference: str) -> ValueError:
    return ValueError(f"`out` {out!r} holds a run of another configuration ({difference}); "
                      "choose another --out (nothing there was changed)")


def plan_out_dir(cfg: Any, resume: bool) -> Plan:
    """Check that ``cfg.out`` may hold this run; read where a resumed run continues.

    Without ``resume`` the directory must be empty of results or hold this very configuration
    (which then starts over). With ``resume`` the number of epochs may differ: the run continues
    from the checkpoint, if the learning-rate schedule of the epochs already run is unchanged.

    Args:
        cfg: a resolved run configuration.
        resume: continue the run in ``cfg.out`` from its checkpoint.

    Raises:
        ValueError: another configuration's results, unreadable files, a checkpoint past
            ``cfg.epochs`` or with another schedule, or metrics shorter than the checkpoint.
    """
    stored = stored_config(cfg.out)
    if stored is None:
        return Plan()
    manifest = read_manifest(cfg.out) if resume else None
    difference = cfg.first_difference(stored, epochs=manifest is None)
    if difference:
        if not resume and cfg.first_difference(stored, epochs=False) is None:
            difference += "; --resume continues it to the new number of epochs"
        raise _refuse(cfg.out, difference)
    if manifest is None:
        if resume:
            log.warning("%s holds no checkpoint: the run starts from the beginning", cfg.out)
        return Plan()
    difference = cfg.first_difference(manifest.config, epochs=False)
    if difference:
        raise _refuse(cfg.out, difference)
    if manifest.epoch > cfg.epochs:
        raise ValueError(f"`epochs` must be >= the {manifest.epoch} epochs {cfg.out!r} holds to "
                         f"resume, got {cfg.epochs}")
    changed = cfg.schedule_change(type(cfg).from_dict(manifest.config), manifest.epoch)
    if changed:
        raise ValueError(f"`epochs` {cfg.epochs} changes the learning-rate schedule of the "
                         f"{manifest.epoch} epochs {cfg.out!r} holds ({changed}); give "
                         "--milestones in epochs to extend a run")
    summary = read_summary(cfg.out)
    if (manifest.epoch == cfg.epochs and summary is not None
            and summary.get("config", {}).get("epochs") == cfg.epochs):
        return Plan(manifest, summary)
    _check_metrics_prefix(Path(cfg.out) / "metrics.jsonl", manifest.metrics_bytes)
    return Plan(manifest)


def _check_metrics_prefix(path: Path, length: int) -> None:
    if length == 0:
        return
    size = path.stat().st_size if path.is_file() else 0
    ok = size >= length
    if ok:
        with path.open("rb") as fh:
            fh.seek(length - 1)
            ok = fh.read(1) == b"\n"
    if not ok:
        raise ValueError(f"`out` {str(path)!r} must begin with the {length} bytes of records the "
                         f"checkpoint covers, got {size} bytes; it cannot be resumed")


def agree(stepper: Any, error: str | None, what: str = "load its part of the checkpoint") -> None:
    """Raise on every process when any process failed (a collective in a process group).

    Args:
        stepper: the loop's stepper (its ``all_sum`` spans every process).
        error: this process's failure, or None.
        what: what the others failed to do, for the message.

    Raises:
        ValueError: this process's error, or a note that another process failed.
    """
    failed = stepper.all_sum(torch.tensor([0.0 if error is None else 1.0], dtype=torch.float64))
    if error is not None:
        raise ValueError(error)
    if float(failed[0]) > 0:
        raise ValueError(f"another worker could not {what}")


def open_out_dir(cfg: Any, plan: Plan) -> MetricsWriter:
    """Rank 0: take the directory over (the first write of the run) and return its writer.

    A fresh start removes an old checkpoint of the same configuration; a resumed one keeps the
    metrics the checkpoint covers. ``run.json`` records the configuration first, so even a run
    killed before its first record is known.
    """
    out = Path(cfg.out)
    keep = plan.manifest.metrics_bytes if plan.manifest is not None else None
    write_run_file(out, cfg.to_dict())
    if plan.manifest is None:
        remove_checkpoints(out)
    writer = MetricsWriter(out, keep_bytes=keep)
    if cfg.tensorboard:
        sink = EventSink(out / EVENTS_DIR)
        for record in read_metrics(out, kind=None):  # the records kept, replayed
            sink.write(record)
        writer.sinks.append(sink)
    return writer


class Checkpointer:
    """Saves the loop every ``cfg.checkpoint_every`` epochs and after the last one.

    Every process writes its own file, all agree, then rank 0 commits the manifest and every
    process removes its files of older checkpoints.

    Args:
        cfg: the resolved run configuration.
        rank: this process's rank.
        processes: number of processes (1 for a simulated run).
        writer: rank 0's metrics writer (its length goes into the manifest), else None.
    """

    def __init__(self, cfg: Any, rank: int, processes: int, writer: MetricsWriter | None) -> None:
        self.cfg, self.rank, self.processes, self.writer = cfg, rank, processes, writer

    def __call__(self, loop: Any) -> None:
        epoch, every = loop.done["epoch"], self.cfg.checkpoint_every
        if not every or (epoch % every and epoch != self.cfg.epochs):
            return
        directory = epoch_directory(epoch)
        error = None
        try:
            atomic_save({"format_version": FORMAT_VERSION, **loop.state_dict()},
                        rank_file(self.cfg.out, directory, self.rank))
        except OSError as exc:
            error = f"writing the checkpoint failed: {exc}"
        # Every file is complete before the manifest names them.
        agree(loop.stepper, error, "write its part of the checkpoint")
        if self.rank == 0:
            assert self.writer is not None
            commit_checkpoint(self.cfg.out, Manifest(
                epoch=epoch, step=loop.done["step"], directory=directory,
                processes=self.processes, metrics_bytes=self.writer.position,
                config=self.cfg.to_dict()))
        agree(loop.stepper, None)  # the manifest is committed before older files go
        prune_checkpoints(self.cfg.out, directory, self.rank)
