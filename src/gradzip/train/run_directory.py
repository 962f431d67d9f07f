"""The run directory as one object: the runner asks it, and nothing else touches ``--out``.

A run directory (``--out``) holds ``run.json``, ``metrics.jsonl``, ``summary.json``,
``checkpoint/`` (a manifest and one file per process), ``tensorboard/`` and, while a run
starts over, ``.gradzip-overwrite/``. :class:`RunDirectory` owns all of it for one run:

1. :meth:`RunDirectory.open` locks the directory (when a run ever locked it) before anything else,
   then plans: start afresh, resume from the checkpoint, start over, or nothing left to do.
2. :meth:`RunDirectory.load_rank` hands each process its part of the checkpoint.
3. :meth:`RunDirectory.claim` (the writer, once every check has passed) holds the lock; a
   directory that did not exist at :meth:`open` is locked now and planned again.
4. :meth:`RunDirectory.start` is the first write: ``run.json``, the kept records.
5. :meth:`RunDirectory.checkpointer` saves after epochs (every process).
6. :meth:`RunDirectory.finish` writes the last files and the summary, and promotes a run
   that started over; :meth:`RunDirectory.close` drops the lock.

Invariants (each one a row of the failure table in ``tests/train/test_run_directory.py``):

* One writer: a directory in use by another run is refused (one line naming it and the
  holder's pid) before data, model or checkpoint is read. The lock is an ``flock`` the
  kernel drops when its holder dies, so it is never stale.
* A refused run changes nothing: every check (configuration, data, model, checkpoint
  digests, the records' prefix) comes before the first write, and a directory that did not
  exist is not created.
* A checkpoint is either the previous one or the new one, never a mixture: every process's
  file is complete (and its sha256 pooled) before rank 0 replaces the manifest.
* A checkpoint loads only as what its manifest says: each file's digest and its epoch and
  step must match the manifest (an earlier epoch's file would write its records twice).
* Records and checkpoint agree: a resumed run keeps exactly the records its checkpoint
  covers (``CRLF`` line ends read as ``LF``; a deleted ``metrics.jsonl`` rebuilt from the
  checkpoint's epoch records) and writes the rest again, so they equal an uninterrupted run's.
* Starting over never loses the old run: the new one writes to the staging folder and
  replaces the old results only once finished (:func:`~gradzip.train.overwrite.promote`).
"""

from __future__ import annotations

import dataclasses
import secrets
from pathlib import Path
from typing import Any

from gradzip.train.events import EVENTS_DIR, EventSink
from gradzip.train.metrics import MetricsWriter, read_metrics
from gradzip.train.overwrite import prepare_staging, promote
from gradzip.train.resume import Checkpointer, Plan, agree, plan_out_dir
from gradzip.train.rundir import (
    LOCK_FILE,
    OutDirLock,
    load_rank_file,
    lock_out_dir,
    remove_checkpoints,
    run_token,
    write_run_file,
)

__all__ = ["RunDirectory"]


class RunDirectory:
    """The output directory of one run, from its lock to its summary.

    Build it with :meth:`open` (the process that owns the directory: the simulator's, the
    ``procs`` launcher's parent, rank 0 under torchrun) or :meth:`joined` (a process writing
    under another's lock: spawned workers, other torchrun ranks).

    Args:
        cfg: the resolved run configuration.
        plan: how the run uses the directory.
        lock: the lock held so far (None: not held).
        owner: whether this process takes the lock itself (False: a parent holds it).
    """

    def __init__(self, cfg: Any, plan: Plan, lock: OutDirLock | None = None,
                 owner: bool = True) -> None:
        self.cfg, self.plan, self._lock, self._owner = cfg, plan, lock, owner
        self._writer: MetricsWriter | None = None

    # -- 1. open: lock, then plan ---------------------------------------------------------
    @classmethod
    def open(cls, cfg: Any, *, resume: bool, overwrite: bool) -> RunDirectory:
        """Lock ``cfg.out`` (where a run ever locked it) and plan the run there.

        A directory no run has locked yet (no lock file) is left as it is, so a refused run
        leaves nothing behind; :meth:`claim` locks it when the run first writes. A run that
        holds a directory always has its lock file there, so that one is never planned
        unlocked.

        Raises:
            ValueError: ``cfg.out`` in use by another run, or refused by the plan (see
                :func:`~gradzip.train.resume.plan_out_dir`).
        """
        held = (Path(cfg.out) / LOCK_FILE).is_file()
        lock = lock_out_dir(cfg.out) if held else None
        try:
            plan = plan_out_dir(cfg, resume, overwrite)
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        return cls(cfg, plan, lock)

    @classmethod
    def joined(cls, cfg: Any, plan: Plan) -> RunDirectory:
        """The directory as seen by a process writing under another process's lock."""
        return cls(cfg, plan, owner=False)

    @property
    def finished(self) -> dict[str, Any] | None:
        """The stored summary when a resumed run has nothing left to do, else None."""
        return self.plan.finished

    @property
    def shared_plan(self) -> Plan:
        """The plan other processes need (without the kept records, which only the writer
        uses: they can be long)."""
        return dataclasses.replace(self.plan, records="")

    def describe(self) -> str | None:
        """One line saying what the run does with its directory (None: a plain fresh
        start, nothing worth saying)."""
        plan, out = self.plan, self.cfg.out
        if plan.finished is not None:
            return f"{out} already holds this run, finished after {self.cfg.epochs} epochs"
        if plan.manifest is not None:
            return (f"resuming {out} from epoch {plan.manifest.epoch} of {self.cfg.epochs} "
                    f"(its checkpoint, step {plan.manifest.step})")
        if plan.staging is not None:
            return f"starting {out} over (its old results stay until this run finishes)"
        return None  # a fresh start (a --resume without a checkpoint is warned of in the plan)

    # -- 2. the checkpoint ----------------------------------------------------------------
    def load_rank(self, rank: int) -> dict[str, Any] | None:
        """Process ``rank``'s part of the checkpoint to resume from (None: none).

        Raises:
            ValueError: the file is missing, damaged, changed, or not of the manifest's epoch.
        """
        if self.plan.manifest is None:
            return None
        return load_rank_file(self.cfg.out, self.plan.manifest, rank)

    # -- 3. claim: the lock before the first write ------------------------------------------
    def claim(self) -> None:
        """Hold the lock for the writer (idempotent; nothing for a joined process).

        Raises:
            ValueError: another run took the directory, or wrote there, since :meth:`open`.
        """
        if self._lock is not None or not self._owner:
            return
        lock = lock_out_dir(self.cfg.out)
        try:
            again = plan_out_dir(self.cfg, self.plan.resume, self.plan.overwrite)
        except BaseException:
            lock.release()
            raise
        if again != self.plan:
            lock.release()
            raise ValueError(f"`out` {self.cfg.out!r} changed while this run was starting "
                             "(another run wrote there); run the command again")
        self._lock = lock

    def agree_to_start(self, stepper: Any, rank: int, error: str | None) -> None:
        """Every process loaded its part of the checkpoint (``error``: why this one could
        not) and rank 0 holds the lock, or no process goes on.

        Args:
            stepper: the loop's stepper (its collectives span every process).
            rank: this process's rank.
            error: this process's failure so far, or None.

        Raises:
            ValueError: on every process, when any failed (this one's message, or a note
                that another failed).
        """
        if rank == 0 and error is None:
            try:
                self.claim()
            except ValueError as exc:
                error = str(exc)
        agree(stepper, error, "load its part of the checkpoint or lock --out")

    # -- 4. start: the first write --------------------------------------------------------
    def start(self) -> MetricsWriter:
        """Take the directory over (rank 0, holding the lock) and return its record writer.

        A fresh start removes an old checkpoint of the same configuration (one with nothing
        worth keeping: the plan refuses the others); a run starting over writes to an empty
        staging folder; a resumed one keeps the records its checkpoint covers. The event
        file is opened first (the one step that may still fail on the file system), then
        ``run.json`` records the configuration, so even a run killed before its first
        record is known.
        """
        cfg, plan = self.cfg, self.plan
        self.claim()
        if plan.staging is not None:
            prepare_staging(cfg.out)
        out = plan.root(cfg.out)
        # The run directory's own token marks its event files, so only those are replaced.
        token = (None if plan.staging is not None else run_token(out)) or secrets.token_hex(6)
        sink = EventSink(out / EVENTS_DIR, token) if cfg.tensorboard else None
        try:
            write_run_file(out, cfg.to_dict(), token)
            if plan.manifest is None:
                remove_checkpoints(out)
            writer = MetricsWriter(out, kept=plan.records if plan.manifest is not None else "")
        except BaseException:
            if sink is not None:
                sink.close()
            raise
        if sink is not None:
            for record in read_metrics(out, kind=None):  # the records kept, replayed
                sink.write(record)
            writer.sinks.append(sink)
        self._writer = writer
        return writer

    # -- 5. checkpoints -------------------------------------------------------------------
    def checkpointer(self, rank: int, processes: int,
                     writer: MetricsWriter | None) -> Checkpointer:
        """What the loop calls after each epoch to save (every process)."""
        return Checkpointer(self.cfg, rank, processes, writer, self.plan.staging)

    # -- 6. finish and close --------------------------------------------------------------
    def finish(self, stepper: Any, writer: MetricsWriter | None, summary: dict[str, Any],
               files: dict[str, Any]) -> None:
        """End the run: every process is done writing, then rank 0 (``writer``) writes
        ``files`` and the summary (last: it marks a finished run) and, for a run starting
        over, replaces the old results.

        Args:
            stepper: the loop's stepper (its collectives span every process).
            writer: rank 0's writer, None elsewhere.
            summary: the ``summary.json`` object.
            files: further JSON files by name (the controllers' decision logs).
        """
        if self.plan.staging is not None:
            agree(stepper, None)  # every process is done writing to the staging folder
        if writer is None:
            return
        for name, obj in files.items():
            writer.write_json(name, obj)
        writer.finish(summary)
        if self.plan.staging is not None:
            promote(self.cfg.out)

    def close(self) -> None:
        """Close the records (a run ended early keeps what it wrote) and drop the lock
        (idempotent)."""
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.close()
        if self._lock is not None:
            lock, self._lock = self._lock, None
            lock.release()

    def __enter__(self) -> RunDirectory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
