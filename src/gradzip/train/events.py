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
``step/loss``, ``step/lr``, ``step/wire_bytes``  step records
==========================  =====================================================

Needs the ``tensorboard`` package (``pip install 'gradzip[tensorboard]'``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["EVENTS_DIR", "EventSink", "clear_events", "require_tensorboard", "write_events"]

#: Folder of a run directory holding its event files.
EVENTS_DIR = "tensorboard"

_EPOCH_TAGS = {
    "train_loss": "loss/train", "test_loss": "loss/test", "accuracy": "accuracy",
    "perplexity": "perplexity", "lr": "lr", "wire_bytes": "bytes/wire",
    "epoch_wire_bytes": "bytes/epoch_wire", "compression": "compression/rate",
    "payload_fraction": "compression/payload_fraction", "density": "density",
    "critical_fraction": "accordion/critical_fraction", "global_batch": "batch/global",
    "batch_critical_fraction": "batch/critical_fraction",
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
            "`tensorboard` needs the tensorboard package: pip install 'gradzip[tensorboard]' "
            "(or pip install tensorboard)"
        ) from None
    return SummaryWriter


def clear_events(logdir: str | os.PathLike[str]) -> None:
    """Remove the event files of ``logdir`` (only those: a run's events are rewritten whole
    from its records when it starts over or resumes)."""
    path = Path(logdir)
    if not path.is_dir():
        return
    for file in path.glob("events.out.tfevents.*"):
        with contextlib.suppress(OSError):
            file.unlink()


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


class EventSink:
    """Writes records (as they go to ``metrics.jsonl``) to a TensorBoard event file.

    Args:
        logdir: the event folder (created; existing event files are removed first, since the
            records given to this sink are the whole history).

    Raises:
        ValueError: the tensorboard package is missing.
    """

    def __init__(self, logdir: str | os.PathLike[str]) -> None:
        summary_writer = require_tensorboard()
        clear_events(logdir)
        self.logdir = Path(logdir)
        self._writer = summary_writer(log_dir=str(self.logdir))
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
    """Write the event file of a finished run's records (``read_metrics(dir, kind=None)``).

    Returns:
        ``logdir``.

    Raises:
        ValueError: the tensorboard package is missing.
    """
    sink = EventSink(logdir)
    try:
        for record in records:
            sink.write(record)
    finally:
        sink.close()
    return Path(logdir)
