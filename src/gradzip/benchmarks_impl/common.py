"""Timing and reporting helpers shared by the benchmarks."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["environment", "format_table", "median_seconds"]


def median_seconds(fn: Callable[[], object], repeat: int, warmup: int = 1) -> float:
    """Median wall-clock seconds of ``fn()`` over ``repeat`` calls, after ``warmup`` calls.

    Args:
        fn: the work to time (its result is dropped before the next call).
        repeat: timed calls (>= 1).
        warmup: untimed calls first (page faults, lazy initialisation, caches).

    Returns:
        The median duration in seconds.
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def environment(threads: int) -> dict[str, Any]:
    """What a reader needs to judge a figure: versions, threads, cores and load right now."""
    try:
        load = [round(v, 2) for v in os.getloadavg()]
    except OSError:  # pragma: no cover - not on every platform
        load = None
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": threads,
        "cpus": os.cpu_count(),
        "load_average": load,
        "machine": platform.machine(),
    }


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    """Rows as a Markdown table.

    Args:
        rows: dicts holding the columns' keys.
        columns: ``(key, header)`` pairs, in display order.

    Returns:
        The table, one line per row, without a trailing newline.
    """
    cells = [[_cell(row.get(key)) for key, _ in columns] for row in rows]
    headers = [header for _, header in columns]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(headers)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells:
        lines.append("| " + " | ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) + " |")
    return "\n".join(lines)
