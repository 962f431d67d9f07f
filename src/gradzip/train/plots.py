"""Plots of finished runs: the metric against bytes sent, and against epochs.

Uses matplotlib's object API (no pyplot, no display needed). Runs with Accordion get their
critical intervals shaded in their colour on the per-epoch panel, darker where a larger share
of the model ran at the gentle level.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["critical_spans", "plot_runs"]

log = logging.getLogger(__name__)


def critical_spans(history: Sequence[dict[str, Any]]) -> list[tuple[float, float, float]]:
    """``(start_epoch, end_epoch, fraction)`` for every epoch in which Accordion ran some
    tensor at its critical (gentle) level; adjacent epochs with the same fraction are merged.

    Args:
        history: epoch records (``epoch`` numbered from 1). ``critical_fraction`` (the share
            of tensor-steps at the critical level) or, for the batch-size controller,
            ``batch_critical_fraction`` (the share of rounds at the small batch).

    Returns:
        Sorted, non-overlapping spans; empty for runs without Accordion.
    """
    spans: list[tuple[float, float, float]] = []
    for rec in history:
        frac = rec.get("critical_fraction", rec.get("batch_critical_fraction"))
        if not frac:
            continue
        start, end = float(rec["epoch"]) - 1, float(rec["epoch"])
        if spans and spans[-1][1] == start and spans[-1][2] == frac:
            spans[-1] = (spans[-1][0], end, frac)
        else:
            spans.append((start, end, float(frac)))
    return spans


def plot_runs(
    runs: Sequence[tuple[str, Sequence[dict[str, Any]]]],
    path: str | os.PathLike[str],
    metric: str = "accuracy",
    title: str | None = None,
) -> Path | None:
    """Write a two-panel PNG: metric vs cumulative bytes sent per worker, and vs epoch.

    Args:
        runs: ``(label, epoch records)`` per run.
        path: the PNG to write.
        metric: ``"accuracy"`` or ``"perplexity"`` (a key of the records).
        title: figure title.

    Returns:
        The path written, or None when matplotlib is not installed.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        log.warning("matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    fig = Figure(figsize=(12, 4.8), layout="constrained")
    ax_bytes, ax_epoch = fig.subplots(1, 2)
    scale = 100.0 if metric == "accuracy" else 1.0
    ylabel = "test accuracy (%)" if metric == "accuracy" else f"validation {metric}"
    shaded_label_done = False
    for i, (label, history) in enumerate(runs):
        rows = [r for r in history if r.get(metric) is not None]
        if not rows:
            continue
        color = f"C{i % 10}"
        ys = [r[metric] * scale for r in rows]
        ax_bytes.plot([r["wire_bytes"] / 2**20 for r in rows], ys, marker=".", color=color,
                      label=label)
        ax_epoch.plot([r["epoch"] for r in rows], ys, marker=".", color=color, label=label)
        for start, end, frac in critical_spans(rows):
            # Darker where more of the model was at the gentle level.
            ax_epoch.axvspan(start, end, color=color, alpha=0.05 + 0.25 * frac, lw=0,
                             label=None if shaded_label_done else "critical share (Accordion)")
            shaded_label_done = True
    ax_bytes.set_xscale("log")
    ax_bytes.set_xlabel("MiB sent per worker (cumulative, log scale)")
    ax_epoch.set_xlabel("epoch")
    for ax in (ax_bytes, ax_epoch):
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if metric == "perplexity":
            ax.set_yscale("log")
    ax_bytes.set_title(f"{metric} vs communication")
    ax_epoch.set_title(f"{metric} vs epoch (shaded: Accordion's critical intervals)")
    ax_epoch.legend(fontsize="small", loc="lower right" if metric == "accuracy" else "upper right")
    if title:
        fig.suptitle(title)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out
