"""What a comparison table shows, over several seeds (``gradzip demo`` prints it under its table).

Computed from the grid's rows (:func:`gradzip.train.compare.run_grid`), nothing assumed about the
runs. Rows that differ only in their seed (labels ``"name [seed=N]"``) are one method: its mean
and the range over the seeds. The summary names the methods no other method beats on both the
mean metric and the mean bytes sent, and for each Accordion method, where it lands against its
two levels run statically, seed by seed. A straight line between the static levels (the metric
against the bytes sent) is what splitting the steps between the two levels buys whatever their
timing; Accordion is worth its rule when it lands above that line, and the summary says so only
when it does on every seed. A table whose runs are no better than chance gets no verdict.
"""

from __future__ import annotations

import re
from statistics import fmean
from typing import Any

from gradzip.train.metrics import format_bytes

__all__ = ["accordion_verdict", "by_method", "efficient", "format_methods", "summary_line"]

#: Metrics where a lower value is better.
LOWER_IS_BETTER = ("perplexity", "loss")

_SEED_SUFFIX = re.compile(r" \[seed=(-?\d+)\]$")


def _better(a: float, b: float, lower: bool) -> bool:
    return a < b if lower else a > b


def _format(value: float, metric: str) -> str:
    return f"{100 * value:.1f}%" if metric == "accuracy" else f"{value:.2f}"


def _seed_word(n: int) -> str:
    return "one seed" if n == 1 else f"{n} seeds"


def by_method(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per method: the grid rows that differ only in their seed, merged.

    A row's method is its label without a trailing ``" [seed=N]"`` (what a grid over ``seed``
    appends). Unfinished rows (``final`` None) are left out of the means.

    Args:
        rows: grid rows with ``label``, ``final``, ``metric``, ``bytes_sent_per_worker``,
            ``compressor`` and optionally ``accordion``, ``seed``, ``compression`` and
            ``wall_seconds``.

    Returns:
        In order of first appearance, rows with the method's ``label``, ``compressor``,
        ``accordion`` and ``metric``; ``final`` and ``bytes_sent_per_worker`` the means over its
        finished seeds (``final`` None when none finished); ``finals`` and ``sent``, per seed
        (``{seed: value}``); ``compression`` and ``wall_seconds`` the means.
    """
    methods: dict[str, dict[str, Any]] = {}
    for row in rows:
        label = str(row["label"])
        match = _SEED_SUFFIX.search(label)
        name = label[:match.start()] if match else label
        seed = int(match.group(1)) if match else int(row.get("seed") or 0)
        method = methods.setdefault(name, {
            "label": name, "compressor": row["compressor"], "accordion": row.get("accordion") or "",
            "metric": row["metric"], "finals": {}, "sent": {}, "_compression": [], "_wall": [],
        })
        if row.get("final") is None:
            continue
        method["finals"][seed] = float(row["final"])
        method["sent"][seed] = int(row["bytes_sent_per_worker"])
        if row.get("compression"):
            method["_compression"].append(float(row["compression"]))
        if row.get("wall_seconds") is not None:
            method["_wall"].append(float(row["wall_seconds"]))
    merged = []
    for method in methods.values():
        done = bool(method["finals"])
        method["final"] = fmean(method["finals"].values()) if done else None
        method["bytes_sent_per_worker"] = fmean(method["sent"].values()) if done else 0.0
        method["compression"] = fmean(method.pop("_compression")) if method["_compression"] \
            else None
        walls = method.pop("_wall")
        method["wall_seconds"] = fmean(walls) if walls else None
        merged.append(method)
    return merged


def format_methods(methods: list[dict[str, Any]]) -> str:
    """A fixed-width table of :func:`by_method` rows: the mean metric, its range over the seeds,
    the mean bytes sent per worker, the compression and the mean wall time of one run."""
    if not methods:
        return "(no runs)"
    metric = methods[0]["metric"]
    scale = 100.0 if metric == "accuracy" else 1.0

    def spread(m: dict[str, Any]) -> str:
        values = list(m["finals"].values())
        if len(values) < 2:
            return "-"
        return f"{scale * min(values):.1f}-{scale * max(values):.1f}"

    header = [f"run ({_seed_word(max(len(m['finals']) for m in methods))})", metric, "range",
              "sent/worker", "vs dense", "wall s"]
    body = [[m["label"], "-" if m["final"] is None else _format(m["final"], metric), spread(m),
             format_bytes(round(m["bytes_sent_per_worker"])),
             f"{m['compression']:.1f}x" if m["compression"] else "-",
             "-" if m["wall_seconds"] is None else f"{m['wall_seconds']:.1f}"] for m in methods]
    widths = [max(len(row[c]) for row in [header, *body]) for c in range(len(header))]
    lines = []
    for n, row in enumerate([header, *body]):
        lines.append("  ".join([row[0].ljust(widths[0])]
                               + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def efficient(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows that no other row beats on both the metric and the bytes sent per worker (at
    least as good on both, strictly better on one), cheapest first.

    Args:
        rows: rows with ``final`` (None rows are left out), ``metric`` and
            ``bytes_sent_per_worker`` (grid rows, or :func:`by_method` rows for the means).

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


def _range(values: list[float], digits: int, unit: str) -> str:
    mean = fmean(values)
    if len(values) == 1:
        return f"{mean:+.{digits}f}{unit}"
    return f"{mean:+.{digits}f}{unit} (seeds {min(values):+.{digits}f} to {max(values):+.{digits}f})"


def accordion_verdict(method: dict[str, Any], methods: list[dict[str, Any]]) -> str | None:
    """Where an Accordion method lands against its gentle level run alone (the method whose
    ``compressor`` is its ``accordion`` spec) and the straight line between its two static
    levels at the same bytes, seed by seed.

    Args:
        method: a :func:`by_method` row with ``accordion`` set.
        methods: every :func:`by_method` row of the table.

    Returns:
        One clause, or None when the table has no static gentle level or no seed that all the
        methods compared finished. Above or below the line is a verdict only when every seed
        says the same.
    """
    static = {m["compressor"]: m for m in methods if not m.get("accordion") and m["finals"]}
    gentle, aggressive = static.get(method["accordion"]), static.get(method["compressor"])
    if gentle is None:
        return None
    seeds = sorted(set(method["finals"]) & set(gentle["finals"]))
    if not seeds:
        return None
    metric = method["metric"]
    lower = metric in LOWER_IS_BETTER
    scale = 100.0 if metric == "accuracy" else 1.0
    unit = " points" if metric == "accuracy" else ""
    digits = 1 if metric == "accuracy" else 2
    diffs = [scale * (method["finals"][s] - gentle["finals"][s]) for s in seeds]
    ratio = fmean(method["sent"][s] / max(gentle["sent"][s], 1) for s in seeds)
    text = (f"{method['label']} {_format(fmean(method['finals'][s] for s in seeds), metric)}: "
            f"{_range(diffs, digits, unit)} against {gentle['label']} at {ratio:.2f}x its bytes")
    if aggressive is None:
        return text
    offs = []
    for s in sorted(set(seeds) & set(aggressive["finals"])):
        b0, b1 = aggressive["sent"][s], gentle["sent"][s]
        if b1 == b0:
            continue
        at = (method["sent"][s] - b0) / (b1 - b0)
        line = aggressive["finals"][s] + at * (gentle["finals"][s] - aggressive["finals"][s])
        off = scale * (method["finals"][s] - line)
        offs.append(-off if lower else off)
    if not offs:
        return text
    line_name = f"the line from {aggressive['label']} to {gentle['label']} at equal bytes"
    if len(offs) == 1:
        verdict = "one seed: not a verdict"
    elif all(o > 0 for o in offs):
        verdict = "above on every seed: its timing beats a plain split of the steps"
    elif all(o < 0 for o in offs):
        verdict = "below on every seed: no better than a plain split of the steps"
    else:
        verdict = "the seeds disagree: no verdict"
    return f"{text}, {_range(offs, digits, unit)} against {line_name} ({verdict})"


def _at_chance(value: float, chance: float, lower: bool) -> bool:
    return value >= chance if lower else value <= chance


def summary_line(rows: list[dict[str, Any]], *, chance: float | None = None) -> str:
    """What the table of ``rows`` shows, in one line.

    Args:
        rows: grid rows (:func:`gradzip.train.compare.run_grid`), all of one metric; rows that
            differ only in their seed are one method (:func:`by_method`).
        chance: the metric a guess reaches (``1 / classes`` for accuracy, the vocabulary size
            for perplexity), or None. When a method's mean is no better than it, the line
            gives no verdict: the runs were too short to compare anything.

    Returns:
        ``"summary: ..."``: the methods no other method beats on both the mean metric and the
        mean bytes (best first), and each Accordion method against its static levels
        (:func:`accordion_verdict`); or why there is no verdict.

    Raises:
        TypeError: ``rows`` is not a list of dicts, or ``chance`` is not a number.
        ValueError: ``rows`` is empty or mixes metrics, or ``chance`` is not positive.
    """
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise TypeError(f"`rows` must be a list of dicts, got {type(rows).__name__}")
    if not rows:
        raise ValueError("`rows` must hold at least one row, got an empty list")
    if chance is not None:
        if isinstance(chance, bool) or not isinstance(chance, (int, float)):
            raise TypeError(f"`chance` must be a number or None, got {type(chance).__name__}")
        if not chance > 0:
            raise ValueError(f"`chance` must be > 0, got {chance}")
    metrics = sorted({r["metric"] for r in rows})
    if len(metrics) != 1:
        raise ValueError(f"`rows` must share one metric, got {metrics}")
    metric = metrics[0]
    lower = metric in LOWER_IS_BETTER
    methods = by_method(rows)
    front = efficient(methods)
    if not front:
        return "summary: no run finished"
    if chance is not None:
        weak = [m for m in methods if m["final"] is not None
                and _at_chance(m["final"], chance, lower)]
        if weak:
            names = ", ".join(f"{m['label']} {_format(m['final'], metric)}" for m in weak)
            return (f"summary: no verdict: {names} no better than chance "
                    f"({_format(chance, metric)}); the runs are too short to compare methods")
    seeds = max(len(m["finals"]) for m in methods)
    best_first = sorted(front, key=lambda m: m["final"], reverse=not lower)
    head = "best for their bytes (no other run is both better and cheaper"
    head += f", means of {seeds} seeds): " if seeds > 1 else "; one seed): "
    parts = ["summary: " + head
             + ", ".join(f"{m['label']} {_format(m['final'], metric)}" for m in best_first)]
    for method in methods:
        if method.get("accordion"):
            verdict = accordion_verdict(method, methods)
            if verdict is not None:
                parts.append(verdict)
    return "; ".join(parts)
