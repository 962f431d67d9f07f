"""Run records: ``metrics.jsonl`` (one JSON object per line) and ``summary.json``.

``metrics.jsonl`` holds one record per epoch (``"kind": "epoch"``), with ``log_every`` one per
N optimizer steps (``"kind": "step"``) and with ``eval_every`` an evaluation every N optimizer
steps (``"kind": "eval"``: test metrics, byte counters, ``train_seconds``: the run's seconds
so far less its evaluations). Byte counters are cumulative and per worker:
the maximum over workers of what each worker sent (``wire``) or said (``payload``), so
"bytes sent per worker" is the cost of the busiest worker.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gradzip.train.rundir import atomic_write_text

__all__ = [
    "MetricsWriter", "format_bytes", "progress_bar", "read_metrics", "read_summary",
    "record_line", "versions",
]

log = logging.getLogger(__name__)


def versions() -> dict[str, str]:
    """Versions of the software a run used."""
    from gradzip import __version__

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "gradzip": __version__,
        "platform": platform.platform(),
    }


def _plain(value: Any) -> Any:
    """JSON-safe copy: tensors and numpy scalars to numbers, tuples to lists, NaN to None."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, torch.Tensor):
        return _plain(value.tolist())
    if isinstance(value, np.generic):
        return _plain(value.item())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Path):
        return str(value)
    return value


def record_line(record: dict[str, Any]) -> str:
    """``record`` as its line of ``metrics.jsonl`` (JSON-safe, newline-terminated)."""
    return json.dumps(_plain(record), sort_keys=False) + "\n"


class MetricsWriter:
    """Appends records to ``DIR/metrics.jsonl`` and writes ``DIR/summary.json`` at the end.

    The runner creates a writer only once the run is known to be valid and ``DIR`` to be its
    own (a refused run touches nothing). A new writer removes a stale ``summary.json`` (so a
    directory never pairs new metrics with an old summary) and replaces ``metrics.jsonl``
    atomically: by an empty file, or, when resuming, by the records the checkpoint covers
    (read and checked beforehand by the run directory's plan). Records are then appended
    and flushed.

    Args:
        out_dir: the run's output directory (created if missing).
        kept: the records to start with (whole lines), empty for a run starting afresh.
        sinks: objects with ``write(record)`` and ``close()`` that receive every record too
            (the TensorBoard mirror).

    Raises:
        ValueError: ``kept`` is not whole lines.
    """

    def __init__(self, out_dir: str | os.PathLike[str], *, kept: str = "",
                 sinks: list[Any] | None = None) -> None:
        if not isinstance(kept, str) or (kept and not kept.endswith("\n")):
            raise ValueError(f"`kept` must be whole records ending in a newline, got "
                             f"{kept[-40:]!r}")
        self.out_dir = Path(out_dir)
        self.metrics_path = self.out_dir / "metrics.jsonl"
        self.summary_path = self.out_dir / "summary.json"
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.summary_path.unlink(missing_ok=True)
        atomic_write_text(self.metrics_path, kept)
        self._fh = self.metrics_path.open("ab")
        self.sinks = list(sinks or [])

    @property
    def position(self) -> int:
        """The length of ``metrics.jsonl`` so far (every record written is flushed)."""
        return self._fh.tell()

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (flushed, so a crashed run keeps its history)."""
        plain = _plain(record)
        self._fh.write((json.dumps(plain, sort_keys=False) + "\n").encode("utf-8"))
        self._fh.flush()
        for sink in self.sinks:
            sink.write(plain)

    def write_json(self, name: str, obj: Any) -> Path:
        """Write ``obj`` as ``DIR/name`` (atomically)."""
        return atomic_write_text(self.out_dir / name, json.dumps(_plain(obj), indent=2) + "\n")

    def finish(self, summary: dict[str, Any]) -> Path:
        """Close the metrics file and write ``summary.json`` last (its presence marks a
        finished run)."""
        self.close()
        return self.write_json("summary.json", summary)

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()
        for sink in self.sinks:
            sink.close()


def read_metrics(out_dir: str | os.PathLike[str], kind: str | None = "epoch") -> list[dict[str, Any]]:
    """Records of ``DIR/metrics.jsonl`` (only those of ``kind`` unless it is None)."""
    path = Path(out_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
    return [r for r in rows if kind is None or r.get("kind") == kind]


def read_summary(out_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """``DIR/summary.json``, or None when the run did not finish."""
    path = Path(out_dir) / "summary.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        log.warning("ignoring unreadable %s", path)
        return None


def format_bytes(n: float | None) -> str:
    """``1536 -> '1.5 KiB'``."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, *args: Any, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, enabled: bool, desc: str) -> Any:
    """A tqdm bar, or a stand-in doing nothing when disabled or tqdm is missing."""
    if not enabled:
        return _NoBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, leave=False)
