"""Where a run continues in its output directory, and its checkpoints while it trains.

:func:`plan_out_dir` reads the directory (nothing written) and says how a run uses it: start
afresh, resume from the committed checkpoint (with the records that checkpoint covers), start
over in a staging folder, or nothing left to do. :class:`Checkpointer` saves after epochs.
Both serve :class:`~gradzip.train.run_directory.RunDirectory`, the one object the runner
asks; its docstring states the order of things and the invariants.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gradzip.train.events import EVENTS_DIR, check_events_dir
from gradzip.train.metrics import MetricsWriter, read_summary, record_line
from gradzip.train.overwrite import staging_dir
from gradzip.train.rundir import (
    CHECKPOINT_DIR,
    FORMAT_VERSION,
    Manifest,
    commit_checkpoint,
    epoch_directory,
    load_rank_file,
    prune_checkpoints,
    rank_file,
    read_manifest,
    save_hashed,
    stored_config,
)

__all__ = ["Checkpointer", "Plan", "agree", "plan_out_dir"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """How a run uses its directory.

    Attributes:
        manifest: the checkpoint to continue from (None: start from the beginning).
        finished: the stored summary when a resumed run has nothing left to do.
        staging: where a run starting over writes until it has finished (None: ``out``).
        resume, overwrite: what was asked (to plan again under the lock).
        records: the records a resumed run keeps (whole lines of ``metrics.jsonl``; empty
            for a run from the beginning); only the writer (rank 0) needs them.
    """

    manifest: Manifest | None = None
    finished: dict[str, Any] | None = None
    staging: str | None = None
    resume: bool = False
    overwrite: bool = False
    records: str = ""

    @property
    def manifest_dict(self) -> dict[str, Any] | None:
        return None if self.manifest is None else self.manifest.to_dict()

    def root(self, out: str) -> Path:
        """The folder the run writes its results and checkpoints to."""
        return Path(self.staging if self.staging is not None else out)


def _refuse(out: str, difference: str) -> ValueError:
    return ValueError(f"`out` {out!r} holds a run of another configuration ({difference}); "
                      "choose another --out (nothing there was changed)")


def _held(out: str) -> str | None:
    """What ``out`` holds that starting over would lose: a finished run, a checkpoint or
    records; None when it holds nothing of value (a run stopped before its first record)."""
    path = Path(out)
    if (path / "summary.json").exists():
        return "a finished run"
    if (path / CHECKPOINT_DIR).exists():
        try:
            manifest = read_manifest(out)
        except ValueError:  # still worth keeping unless the user starts over explicitly
            return "a run with a damaged checkpoint"
        if manifest is not None:
            return f"a run interrupted after epoch {manifest.epoch}"
    metrics = path / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        return "the records of an interrupted run"
    return None


def plan_out_dir(cfg: Any, resume: bool, overwrite: bool = False) -> Plan:
    """Check that ``cfg.out`` may hold this run; read where a resumed run continues.

    Without ``resume`` or ``overwrite`` the directory must be empty of results or hold this
    configuration with nothing worth keeping (a run stopped before its first record). With
    ``resume`` the number of epochs may differ: the run continues from the checkpoint, if the
    learning-rate schedule of the epochs already run is unchanged. With ``overwrite`` a run of
    this configuration (any number of epochs) starts over in a staging folder; the old results
    stay until the new run has finished.

    Args:
        cfg: a resolved run configuration.
        resume: continue the run in ``cfg.out`` from its checkpoint.
        overwrite: start over, replacing the results of this configuration once finished.

    Raises:
        ValueError: another configuration's results, results of this one without ``resume``
            or ``overwrite``, unreadable files, an unusable TensorBoard folder, a checkpoint
            past ``cfg.epochs`` or with another schedule, or metrics shorter than the
            checkpoint.
    """
    if resume and overwrite:
        raise ValueError("`resume` and `overwrite` exclude each other (continue the run, or "
                         "start it over), got both")
    if cfg.tensorboard:
        check_events_dir(Path(cfg.out) / EVENTS_DIR)
    stored = stored_config(cfg.out)
    if stored is None:
        return Plan(resume=resume, overwrite=overwrite)
    manifest = read_manifest(cfg.out) if resume else None
    difference = cfg.first_difference(stored, epochs=manifest is None and not overwrite)
    if difference:
        if not resume and cfg.first_difference(stored, epochs=False) is None:
            difference += ("; --resume continues it to the new number of epochs, --overwrite "
                           "starts it over")
        raise _refuse(cfg.out, difference)
    if not resume:
        held = _held(cfg.out)
        if held is None:
            return Plan(overwrite=overwrite)
        if not overwrite:
            raise ValueError(f"`out` {cfg.out!r} holds {held} of this configuration; --resume "
                             "continues it, --overwrite starts it over (nothing there was "
                             "changed)")
        return Plan(staging=str(staging_dir(cfg.out)), overwrite=True)
    if manifest is None:
        log.warning("%s holds no checkpoint: the run starts from the beginning", cfg.out)
        return Plan(resume=True)
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
        return Plan(manifest, summary, resume=True)
    return Plan(manifest, resume=True, records=_kept_records(cfg.out, manifest))


def _kept_records(out: str, manifest: Manifest) -> str:
    """The records a run resumed from ``manifest`` keeps: the first ``metrics_bytes`` bytes
    of ``metrics.jsonl``, line ends ``CRLF`` read as ``LF`` (a file that went through an
    editor or a checkout that converts them); with the file gone, the epoch records the
    checkpoint holds (its step and eval records are lost, said in a warning).

    Raises:
        ValueError: the records are shorter than the checkpoint's, cut mid-record, or not
            JSON objects.
    """
    path = Path(out) / "metrics.jsonl"
    length = manifest.metrics_bytes
    if not path.exists():
        if length == 0:
            return ""
        history = load_rank_file(out, manifest, 0)["loop"].get("history")
        if not isinstance(history, list) or not all(isinstance(r, dict) for r in history):
            raise ValueError(f"`out` {str(path)!r} is missing and the checkpoint holds no records "
                             "to rebuild it from; restore the file, or start over with --overwrite")
        log.warning("%s is missing: its %d epoch records were rebuilt from the checkpoint of "
                    "epoch %d (step and eval records before it are lost)", path, len(history),
                    manifest.epoch)
        return "".join(record_line(r) for r in history)
    try:
        data = path.read_bytes().replace(b"\r\n", b"\n")
    except OSError as exc:
        raise ValueError(f"`out` {str(path)!r} cannot be read back to resume: {exc}") from None
    kept = data[:length]
    if len(kept) != length or (length and not kept.endswith(b"\n")):
        raise ValueError(f"`out` {str(path)!r} must begin with the {length} bytes of records the "
                         f"checkpoint covers, got {len(data)} bytes; it cannot be resumed as it "
                         "is: restore it, remove it (its epoch records are then rebuilt from "
                         "the checkpoint) or start over with --overwrite")
    for number, line in enumerate(kept.split(b"\n")[:-1], 1):
        try:
            record = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError):
            record = None
        if not isinstance(record, dict):
            raise ValueError(f"`out` {str(path)!r} line {number} must be a JSON record, got "
                             f"{line[:40]!r}; restore the file, remove it (its epoch records "
                             "are then rebuilt from the checkpoint) or start over with "
                             "--overwrite")
    return kept.decode("utf-8")


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


class Checkpointer:
    """Saves the loop every ``cfg.checkpoint_every`` epochs and after the last one.

    Every process writes its own file and its sha256, all agree (and pool the digests), then
    rank 0 commits the manifest and every process removes its files of older checkpoints.

    Args:
        cfg: the resolved run configuration.
        rank: this process's rank.
        processes: number of processes (1 for a simulated run).
        writer: rank 0's metrics writer (its length goes into the manifest), else None.
        root: the folder written to (``cfg.out``, or the staging folder of a run starting
            over).
    """

    def __init__(self, cfg: Any, rank: int, processes: int, writer: MetricsWriter | None,
                 root: str | None = None) -> None:
        self.cfg, self.rank, self.processes, self.writer = cfg, rank, processes, writer
        self.root = cfg.out if root is None else root

    def _pool_digests(self, loop: Any, digest: str) -> dict[str, str]:
        """Every process's sha256 by file name. Each process hashes only the bytes it wrote
        (the files may live on disks the others cannot read); the digests travel as one byte
        per entry of a sum in which every other process contributes zeros, which is exact."""
        table = torch.zeros(self.processes, 32, dtype=torch.float64)
        if digest:
            table[self.rank] = torch.tensor(list(bytes.fromhex(digest)), dtype=torch.float64)
        table = loop.stepper.all_sum(table) if self.processes > 1 else table
        return {f"rank-{r}.pt": bytes(int(v) for v in table[r].tolist()).hex()
                for r in range(self.processes)}

    def __call__(self, loop: Any) -> None:
        epoch, every = loop.done["epoch"], self.cfg.checkpoint_every
        if not every or (epoch % every and epoch != self.cfg.epochs):
            return
        directory = epoch_directory(epoch)
        error, digest = None, ""
        try:
            digest = save_hashed({"format_version": FORMAT_VERSION, **loop.state_dict()},
                                 rank_file(self.root, directory, self.rank))
        except OSError as exc:
            error = f"writing the checkpoint failed: {exc}"
        # Every file is complete before the manifest names them.
        agree(loop.stepper, error, "write its part of the checkpoint")
        digests = self._pool_digests(loop, digest)
        if self.rank == 0:
            assert self.writer is not None
            commit_checkpoint(self.root, Manifest(
                epoch=epoch, step=loop.done["step"], directory=directory,
                processes=self.processes, metrics_bytes=self.writer.position,
                config=self.cfg.to_dict(), sha256=digests))
        agree(loop.stepper, None)  # the manifest is committed before older files go
        prune_checkpoints(self.root, directory, self.rank)
