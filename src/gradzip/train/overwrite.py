"""Starting a finished (or interrupted) run over without losing it first.

A run asked to start over (``gradzip train --overwrite``) writes everything to a staging
folder inside its directory, ``OUT/.gradzip-overwrite/``, and only once it has finished does
:func:`promote` move its results over the old ones. Until then the old run stays whole: a
crash, a Ctrl-C or a kill of the new run leaves it as it was (the next start over clears the
stale staging folder, which holds nothing but the abandoned attempt).

:func:`promote` replaces the files in an order that keeps the directory a valid run at every
moment: the old summary goes first (the directory then reads as an interrupted old run), the
old checkpoint next (nothing to resume from: a ``--resume`` would start from the beginning),
then the new records, the new checkpoint, and the new summary last (a finished new run). No
moment pairs a checkpoint with records of another run.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from gradzip.train.events import EVENTS_DIR, clear_events
from gradzip.train.rundir import CHECKPOINT_DIR, RUN_FILE, run_token

__all__ = ["STAGING_DIR", "prepare_staging", "promote", "staging_dir"]

#: The folder (inside a run directory) where a run starting over writes until it finishes.
STAGING_DIR = ".gradzip-overwrite"


def staging_dir(out: str | os.PathLike[str]) -> Path:
    """The staging folder of the run directory ``out``."""
    return Path(out) / STAGING_DIR


def prepare_staging(out: str | os.PathLike[str]) -> Path:
    """An empty staging folder for ``out`` (the caller holds the directory's lock).

    A staging folder left by an earlier start over that never finished holds only that
    attempt's files (nothing else writes there), so it is removed.

    Returns:
        The staging folder.
    """
    path = staging_dir(out)
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def promote(out: str | os.PathLike[str]) -> None:
    """Replace the results in ``out`` by the finished run in its staging folder (rank 0,
    holding the lock, after every process is done writing).

    Raises:
        OSError: a rename failed (the directory then holds a valid run: see the module).
    """
    out = Path(out)
    staging = staging_dir(out)
    (out / "summary.json").unlink(missing_ok=True)  # from here: an interrupted old run
    # Event files are derived from the records: the old run's go, the new run's come in.
    old_token = run_token(out)
    if old_token is not None:
        clear_events(out / EVENTS_DIR, old_token)
    new_events = staging / EVENTS_DIR
    if new_events.is_dir():
        (out / EVENTS_DIR).mkdir(exist_ok=True)
        for file in sorted(new_events.iterdir()):
            shutil.move(str(file), str(out / EVENTS_DIR / file.name))
    old_checkpoint = out / CHECKPOINT_DIR
    if old_checkpoint.exists() or old_checkpoint.is_symlink():
        os.replace(old_checkpoint, staging / ".replaced-checkpoint")
    os.replace(staging / RUN_FILE, out / RUN_FILE)
    os.replace(staging / "metrics.jsonl", out / "metrics.jsonl")
    if (staging / CHECKPOINT_DIR).exists():
        os.replace(staging / CHECKPOINT_DIR, out / CHECKPOINT_DIR)
    for file in sorted(staging.glob("*.json")):
        if file.name != "summary.json":
            os.replace(file, out / file.name)  # the controllers' decision logs
    os.replace(staging / "summary.json", out / "summary.json")  # last: a finished new run
    shutil.rmtree(staging, ignore_errors=True)
