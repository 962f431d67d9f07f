"""One line that says what a comparison table shows (``gradzip demo`` prints it under its table).

Computed from the grid's rows (:func:`gradzip.train.compare.run_grid`), nothing assumed about the
runs: which runs no other run beats on both the metric and the bytes sent, and for each
Accordion run, where it lands against its two levels run statically. A straight line between
the static levels (the metric against the bytes sent) is what splitting the steps between the
two levels buys whatever their timing; Accordion is worth its rule when it lands above that line.
"""

from __future__ import annotations

from typing import Any

#: Metrics where a lower value is better.
LOWER_IS_BETTER = ("perplexity", "loss")


def _better(a: float, b: float, lower: bool) -> bool:
    return a < b if lower else a > b


def _format(value: float, metric: str) -> str:
    return f"{100 * value:.1f}%" if metric == "accuracy" else f"{value:.2f}"


def efficient(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows that no other row beats on both the metric and the bytes sent per worker (at
    least as good on both, strictly better on one), cheapest first.

    Args:
        rows: grid rows with ``final`` (None rows are left out), ``metric`` and
            ``bytes_sent_per_worker``.

    Returns:
        The efficient rows, by bytes sent.
    """
    done = [r for r in rows if r.get("final") is not None]
    if not done:
        return []
    lower = done[0]["metric"] in LOWER_IS_BETTER

    def beats(a: dict[str, Any], b: dict[str, Any]) -> bool:
        not_worse = a["final"] == b["final"] or _better(a["final"], b["final"], lower)
        cheaper = a["bytes_sent_per_worker"] <= b["bytes_sent_per_worker"]
        strictly = (_better(a["final"], b["final"], lower)
                    or a["bytes_sent_per_worker"] < b["bytes_sent_per_worker"])
        return not_worse and cheaper and strictly

    front = [r for r in done if not any(beats(o, r) for o in done if o is not r)]
    return sorted(front, key=lambda r: r["bytes_sent_per_worker"])


def accordion_verdict(row: dict[str, Any], rows: list[dict[str, Any]]) -> str | None:
    """Where an Accordion row lands against its gentle level run alone (the row whose
    ``compressor`` is its ``accordion`` spec) and the straight line between its two static
    levels at the same bytes; None when the table has no static gentle level."""
    static = {r["compressor"]: r for r in rows
              if not r.get("accordion") and r.get("final") is not None}
    gentle, aggressive = static.get(row["accordion"]), static.get(row["compressor"])
    if gentle is None or row.get("final") is None:
        return None
    metric = row["metric"]
    scale = 100.0 if metric == "accuracy" else 1.0
    unit = " points" if metric == "accuracy" else ""
    digits = 1 if metric == "accuracy" else 2
    diff = scale * (row["final"] - gentle["final"])
    ratio = row["bytes_sent_per_worker"] / max(gentle["bytes_sent_per_worker"], 1)
    text = (f"{row['label']} {_format(row['final'], metric)}: {diff:+.{digits}f}{unit} against "
            f"{gentle['label']} at {ratio:.2f}x its bytes")
    if aggressive is not None:
        b0, b1 = aggressive["bytes_sent_per_worker"], gentle["bytes_sent_per_worker"]
        if b1 != b0:
            at = (row["bytes_sent_per_worker"] - b0) / (b1 - b0)
            line = aggressive["final"] + at * (gentle["final"] - aggressive["final"])
            off = scale * (row["final"] - line)
            if metric in LOWER_IS_BETTER:
                off = -off
            side = "above" if off > 0 else "below" if off < 0 else "on"
            gain = ("its timing beats" if off > 0 else "no better than")
            text += (f", {abs(off):.{digits}f}{unit} {side} the line from {aggressive['label']} to "
                     f"{gentle['label']} at equal bytes ({gain} a plain split of the steps)")
    return text


def summary_line(rows: list[dict[str, Any]]) -> str:
    """What the table of ``rows`` shows, in one line.

    Args:
        rows: grid rows (:func:`gradzip.train.compare.run_grid`), all of one metric.

    Returns:
        ``"summary: ..."``: the runs no other run beats on both metric and bytes (best metric
        first), and each Accordion run against its static levels (:func:`accordion_verdict`).

    Raises:
        TypeError: ``rows`` is not a list of dicts.
        ValueError: ``rows`` is empty or mixes metrics.
    """
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise TypeError(f"`rows` must be a list of dicts, got {type(rows).__name__}")
    if not rows:
        raise ValueError("`rows` must hold at least one row, got an empty list")
    metrics = sorted({r["metric"] for r in rows})
    if len(metrics) != 1:
        raise ValueError(f"`rows` must share one metric, got {metrics}")
    front = efficient(rows)
    if not front:
        return "summary: no run finished"
    lower = metrics[0] in LOWER_IS_BETTER
    best_first = sorted(front, key=lambda r: r["final"], reverse=not lower)
    parts = ["summary: best for their bytes (no other run is both better and cheaper): "
             + ", ".join(f"{r['label']} {_format(r['final'], metrics[0])}" for r in best_first)]
    for row in rows:
        if row.get("accordion"):
            verdict = accordion_verdict(row, rows)
            if verdict is not None:
                parts.append(verdict)
    return "; ".join(parts)
