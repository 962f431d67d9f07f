"""The Markdown tables ``gradzip bench`` prints: one for the kernels, one for the DDP hooks.

Each table comes with a one-line HTML comment above it saying under what conditions the figures
were taken (torch version, threads, cores, load), so that a pasted table carries its context.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gradzip.bench.hooks import HookRow
from gradzip.bench.micro import MicroRow

__all__ = ["HOOK_COLUMNS", "MICRO_COLUMNS", "format_table", "hooks_table", "micro_table"]

#: ``(row key, header)`` pairs of the kernel table, in display order.
MICRO_COLUMNS = (
    ("compressor", "compressor"), ("numel", "numel"), ("layout", "layout"),
    ("compress_ms", "compress ms"), ("decode_ms", "decode ms"), ("clone_ms", "clone ms"),
    ("compress_over_clone", "compress/clone"), ("baseline_ms", "baseline ms"),
    ("baseline_over_compress", "baseline/compress"), ("select_ms", "select op ms"),
    ("baseline_decode_ms", "baseline decode ms"), ("density", "density"),
)
#: ``(row key, header)`` pairs of the DDP hook table, in display order.
HOOK_COLUMNS = (
    ("workers", "workers"), ("config", "configuration"), ("ms_per_step", "ms/step"),
    ("ratio_to_nohook", "vs no hook"), ("cpu_ms_per_step", "CPU ms/step"),
    ("cpu_ratio_to_nohook", "CPU vs no hook"),
)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    """Rows as a Markdown table.

    Args:
        rows: dicts holding the columns' keys (a missing key shows as ``-``).
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


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1e3


def micro_table(rows: Sequence[MicroRow], env: dict[str, Any], *, workers: int, repeat: int,
                heap: str) -> str:
    """The kernel table (times in milliseconds) under its comment line.

    Args:
        rows: what :func:`~gradzip.bench.micro.run_micro` returned.
        env: :func:`~gradzip.bench.common.environment` of the run.
        workers, repeat: the run's group size and timed repetitions.
        heap: the heap mode asked for (the rows' own mode is shown when there are rows).

    Returns:
        The comment line and the table, without a trailing newline.
    """
    table = []
    for row in rows:
        d = row.as_dict()
        for key in ("compress", "decode", "clone", "baseline", "select", "baseline_decode"):
            d[f"{key}_ms"] = _ms(d[f"{key}_seconds"])
        table.append(d)
    comment = (f"<!-- torch {env['torch']}, {env['threads']} threads, {env['cpus']} cpus, "
               f"load average {env['load_average']}, {workers} workers, "
               f"median of {repeat}, heap {rows[0].heap if rows else heap} -->")
    return comment + "\n" + format_table(table, MICRO_COLUMNS)


def hooks_table(rows: Sequence[HookRow], env: dict[str, Any]) -> str:
    """The DDP hook table (times in milliseconds per step) under its comment line.

    Args:
        rows: what :func:`~gradzip.bench.hooks.run_hooks` returned (at least one row).
        env: :func:`~gradzip.bench.common.environment` of the run.

    Returns:
        The comment line and the table, without a trailing newline.
    """
    table = [dict(r.as_dict(), ms_per_step=r.seconds_per_step * 1e3,
                  cpu_ms_per_step=r.cpu_seconds_per_step * 1e3) for r in rows]
    first = rows[0]
    comment = (f"<!-- torch {env['torch']}, {env['cpus']} cpus, load average "
               f"{env['load_average']}, {first.model} ({first.parameters} parameters), batch "
               f"{first.batch_per_worker}/worker, threads/worker "
               f"{sorted({r.threads_per_worker for r in rows})}, "
               f"{first.steps_per_round} steps x {first.rounds} rounds -->")
    return comment + "\n" + format_table(table, HOOK_COLUMNS)
