"""TensorBoard event files mirroring ``metrics.jsonl``.

Every record a run writes to ``metrics.jsonl`` can also go to a TensorBoard event file (the
same numbers, nothing computed twice). Epoch records are logged against the epoch number,
step records (``log_every``) against the optimizer step:

==========================  =====================================================
tag                         from the record
==========================  =====================================================
``loss/train``              ``train_loss``
``loss/test``               ``test_loss``
``accuracy``, ``perplexity``  the task's metric
``lr``                      learning rate of the epoch's last step
``bytes/wire``              cumulative wire bytes per worker (``wire_bytes``)
``bytes/epoch_wire``        wire bytes of the epoch
``compression/rate``        dense wire bytes / wire bytes (``compression``)
``compression/payload_fraction``  payload bytes / dense payload bytes of the epoch
``density``                 fraction of gradient entries sent (where meaningful)
``levels/<level>``          share of tensors at each level (Accordion, level schedules), from
                            the first record that shows the level
``accordion/critical_fraction``, ``batch/global``, ``batch/critical_fraction``  controllers
``auto/outer_steps``        ``--auto-outer``: H of outer-step training once switched, else 0
``step/loss``, ``step/lr``, ``step/wire_bytes``  step records
==========================  =====================================================

Needs the ``tensorboard`` package (``pip install tensorboard``, or the ``tensorboard`` extra).

The event folder may be shared (a link to a common log directory, another tool's events):
every event file gradzip writes ends in ``.gradzip-<token>``, the token being the run
directory's own, and only files with that ending are ever removed.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = [
    "COMPARE_TOKEN", "EVENTS_DIR", "EventSink", "check_events_dir", "clear_events", "event_files",
    "require_tensorboard", "write_events",
]

#: Folder of a run directory holding its event files.
EVENTS_DIR = "tensorboard"
#: Token of the event files ``write_events`` (``gradzip compare``) writes.
COMPARE_TOKEN = "compare"

_EPOCH_TAGS = {
    "train_loss": "loss/train", "test_loss": "loss/test", "accuracy": "accuracy",
    "perplexity": "perplexity", "lr": "lr", "wire_bytes": "bytes/wire",
    "epoch_wire_bytes": "bytes/epoch_wire", "compression": "compression/rate",
    "payload_fraction": "compression/payload_fraction", "density": "density",
    "critical_fraction": "accordion/critical_fraction", "global_batch": "batch/global",
    "batch_critical_fraction": "batch/critical_fraction", "outer_steps": "auto/outer_steps",
}
_STEP_TAGS = {"loss": "step/loss", "lr": "step/lr", "wire_bytes": "step/wire_bytes"}


def require_tensorboard() -> Any:
    """``torch.utils.tensorboard.SummaryWriter``, or a one-line error where it is missing.

    Raises:
        ValueError: the ``tensorboard`` package is not installed.
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ValueError(
            "`tensorboard` needs the tensorboard package: pip install tensorboard (or the "
            "`tensorboard` extra: pip install -e '.[tensorboard]' in gradzip's source tree)"
        ) from None
    return SummaryWriter


def check_events_dir(logdir: str | os.PathLike[str]) -> None:
    """Refuse an event folder that cannot be used, before a run writes anything.

    Raises:
        ValueError: ``logdir`` is a file, a dangling link, or a folder this user cannot
            write to.
    """
    path = Path(logdir)
    if path.is_symlink() and not path.exists():
        raise ValueError(f"`tensorboard` needs the folder {str(path)!r}, got a link to nothing; "
                         "remove it or choose another --out")
    if path.exists() and not path.is_dir():
        raise ValueError(f"`tensorboard` needs the folder {str(path)!r}, got a file; remove it "
                         "or choose another --out")
    if path.is_dir() and not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"`tensorboard` needs a writable folder {str(path)!r}, got one this user "
                         "cannot write to")


def _check_token(token: str) -> str:
    if not isinstance(token, str) or not token or not token.replace("-", "").isalnum():
        raise ValueError(f"`token` must be a non-empty string of letters, digits and '-', "
                         f"got {token!r}")
    return token


def event_files(logdir: str | os.PathLike[str], token: str) -> list[Path]:
    """The event files in ``logdir`` written under ``token`` (by one run directory)."""
    path = Path(logdir)
    if not path.is_dir():
        return []
    return sorted(path.glob(f"events.out.tfevents.*.gradzip-{_check_token(token)}"))


def clear_events(logdir: str | os.PathLike[str], token: str) -> None:
    """Remove the event files of ``logdir`` written under ``token`` and no others (a run's
    events are rewritten whole from its records when it resumes or starts over; other runs'
    and other tools' files in a shared folder stay)."""
    for file in event_files(logdir, token):
        with contextlib.suppress(OSError):
            file.unlink()


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


class EventSink:
    """Writes records (as they go to ``metrics.jsonl``) to a TensorBoard event file.

    Args:
        logdir: the event folder (created; event files written earlier under ``token`` are
            removed first, since the records given to this sink are the whole history).
        token: marks this sink's file (``.gradzip-<token>``), so that only files written
            under it are ever removed.

    Raises:
        ValueError: the tensorboard package is missing, the folder cannot be used, or the
            token is malformed.
    """

    def __init__(self, logdir: str | os.PathLike[str], token: str) -> None:
        summary_writer = require_tensorboard()
        check_events_dir(logdir)
        clear_events(logdir, token)
        self.logdir = Path(logdir)
        self._writer = summary_writer(log_dir=str(self.logdir),
                                      filename_suffix=f".gradzip-{token}")
        self._levels: set[str] = set()
        self._closed = False

    def write(self, record: dict[str, Any]) -> None:
        """Log one record's numbers (records of other kinds are ignored)."""
        kind = record.get("kind")
        if kind == "epoch":
            at, tags = int(record["epoch"]), _EPOCH_TAGS
        elif kind == "step":
            at, tags = int(record["step"]), _STEP_TAGS
        else:
            return
        for key, tag in tags.items():
            value = _number(record.get(key))
            if value is not None:
                self._writer.add_scalar(tag, value, at)
        levels = record.get("levels")
        if kind == "epoch" and isinstance(levels, dict) and levels:
            # A level seen before but absent now is logged as 0, so every curve is continuous.
            self._levels.update(str(v) for v in levels.values())
            for level in sorted(self._levels):
                share = sum(str(v) == level for v in levels.values()) / len(levels)
                self._writer.add_scalar(f"levels/{level}", share, at)
        if kind == "epoch":
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file (idempotent)."""
        if not self._closed:
            self._closed = True
            self._writer.close()


def write_events(records: Iterable[dict[str, Any]], logdir: str | os.PathLike[str]) -> Path:
    """Write the event file of a finished run's records (``read_metrics(dir, kind=None)``),
    replacing only the one an earlier call wrote there.

    Returns:
        ``logdir``.

    Raises:
        ValueError: the tensorboard package is missing or the folder cannot be used.
    """
    sink = EventSink(logdir, COMPARE_TOKEN)
    try:
        for record in records:
            sink.write(record)
    finally:
        sink.close()
    return Path(logdir)
