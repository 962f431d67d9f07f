"""The quality benchmark's results (``quality.py``): per-run rows with Accordion's decisions,
seeds aggregated per configuration, the verdicts against the papers' claims, and the CSV
files, plot and Markdown table written from them. ``quality.py`` imports it from beside
itself."""

from __future__ import annotations

import csv
import json
import re
import statistics
from pathlib import Path
from typing import Any

from gradzip.train.metrics import read_metrics, read_summary

#: (Accordion row, its gentle level's static row), compared for the papers' claim.
ACCORDION_PAIRS = (
    ("accordion powersgd r1<->r4", "powersgd r4"),
    ("accordion topk 1%<->10%", "topk 10%"),
    ("accordion threshold 1%<->10%", "threshold budget 10%"),
)
#: (hard-threshold row, the top-k row with the same budget).
THRESHOLD_PAIRS = (("threshold budget 1%", "topk 1%"), ("threshold budget 10%", "topk 10%"))


# -- summarising ------------------------------------------------------------------------
def base_label(label: str) -> str:
    """``"topk 1% [seed=0]"`` -> ``"topk 1%"``."""
    return re.sub(r"\s*\[[^\]]*\]$", "", label)


def critical_info(out: str) -> dict[str, Any]:
    """Accordion's decisions of one run: decision intervals, intervals in which the rule found
    a critical regime (a norm change >= eta), intervals forced critical (start, LR drop), and
    the share of tensor-steps run at the gentle level."""
    path = Path(out) / "accordion_decisions.json"
    summary = read_summary(out) or {}
    counts = summary.get("accordion_counts")
    if counts is None or not path.is_file():
        return {}
    records = json.loads(path.read_text(encoding="utf-8"))
    points: dict[int, list[dict[str, Any]]] = {}
    for rec in records:
        points.setdefault(rec["decision"], []).append(rec)
    found = sum(any(r["level"] == "critical" and r["reason"] == "norm_change" for r in recs)
                for recs in points.values())
    forced = sum(any(r["reason"] in ("first", "lr_drop") for r in recs) for recs in points.values())
    crit, steady = counts.get("critical_steps", 0), counts.get("steady_steps", 0)
    return {"decision_points": len(points), "critical_found": found, "critical_forced": forced,
            "critical_step_share": crit / (crit + steady) if crit + steady else None}


def run_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-run rows of :func:`gradzip.train.compare.run_grid`, with the final test loss and
    Accordion's decisions."""
    out = []
    for r in rows:
        summary = read_summary(r["out"]) or {}
        info = critical_info(r["out"])
        out.append({
            "label": base_label(r["label"]), "seed": r["seed"], "compressor": r["compressor"],
            "accordion": r["accordion"], "epochs": r["epochs"], "steps": r["steps"],
            "final_accuracy": r["final"] if r["metric"] == "accuracy" else None,
            "final_test_loss": summary.get("final_test_loss"),
            "bytes_sent_per_worker": r["bytes_sent_per_worker"],
            "dense_bytes_per_worker": r["dense_bytes_per_worker"],
            "compression": r["compression"], "wall_seconds": r["wall_seconds"],
            "critical_found": info.get("critical_found"),
            "critical_forced": info.get("critical_forced"),
            "decision_points": info.get("decision_points"),
            "critical_step_share": info.get("critical_step_share"),
            "out": r["out"],
        })
    return out


def _mean(values: list[Any]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def aggregate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per configuration: seeds aggregated (mean and spread = max - min)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r["label"], []).append(r)
    dense = _mean([r["dense_bytes_per_worker"] for r in rows])
    out = []
    for label, rs in groups.items():
        row: dict[str, Any] = {"label": label, "compressor": rs[0]["compressor"],
                               "accordion": rs[0]["accordion"], "seeds": len(rs)}
        for key in ("final_accuracy", "final_test_loss"):
            vals = [r[key] for r in rs if r[key] is not None]
            row[f"{key}_mean"] = _mean(vals)
            row[f"{key}_spread"] = (max(vals) - min(vals)) if vals else None
        sent = _mean([r["bytes_sent_per_worker"] for r in rs])
        row["bytes_sent_per_worker"] = sent
        row["compression"] = (dense / sent) if sent and dense else None
        for key in ("critical_found", "critical_forced", "decision_points", "critical_step_share"):
            row[key] = _mean([r[key] for r in rs])
        row["wall_seconds_mean"] = _mean([r["wall_seconds"] for r in rs])
        out.append(row)
    return out


def verdicts(agg: list[dict[str, Any]], metric: str) -> list[dict[str, Any]]:
    """The papers' claims checked on the aggregated rows (pairs absent from the grid skipped).

    Accordion: mean accuracy within 0.3 points of its gentle level's, at <= 0.6x its bytes.
    Hard threshold: mean metric at least top-k's (accuracy >=, or test loss <=) at no more bytes.
    """
    by = {r["label"]: r for r in agg}
    key = "final_accuracy_mean" if metric == "accuracy" else "final_test_loss_mean"
    out = []
    for acc, gentle in ACCORDION_PAIRS:
        if acc in by and gentle in by and by[acc][key] is not None:
            a, g = by[acc], by[gentle]
            gap = 100 * (g[key] - a[key])
            ratio = a["bytes_sent_per_worker"] / g["bytes_sent_per_worker"]
            out.append({"claim": f"{acc} vs {gentle}", "accuracy_gap_points": gap,
                        "bytes_ratio": ratio, "met": bool(gap <= 0.3 and ratio <= 0.6)})
    for thr, topk in THRESHOLD_PAIRS:
        if thr in by and topk in by and by[thr][key] is not None:
            t, k = by[thr], by[topk]
            better = t[key] >= k[key] if metric == "accuracy" else t[key] <= k[key]
            ratio = t["bytes_sent_per_worker"] / k["bytes_sent_per_worker"]
            out.append({"claim": f"{thr} vs {topk}", "difference": t[key] - k[key],
                        "metric": key, "bytes_ratio": ratio,
                        "met": bool(better and ratio <= 1.0)})
    return out


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def plot(path: Path, part: str, rows: list[dict[str, Any]], agg: list[dict[str, Any]]) -> Path:
    """CIFAR-10: final accuracy (mean, seed range) vs bytes; logreg: test loss vs bytes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig = Figure(figsize=(8.0, 4.2), dpi=90)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    colours = {}
    if part == "logreg":
        for r in rows:
            history = read_metrics(r["out"])
            xs = [h["wire_bytes"] / 2**20 for h in history]
            ys = [h["test_loss"] for h in history]
            line = ax.plot(xs, ys, marker=".", color=colours.get(r["label"]),
                           label=r["label"] if r["label"] not in colours else None)[0]
            colours.setdefault(r["label"], line.get_color())
        ax.set_ylabel("test loss")
        ax.set_xlabel("cumulative MiB sent per worker (log)")
    else:
        for r in agg:
            vals = [x["final_accuracy"] for x in rows if x["label"] == r["label"]]
            mean, mib = 100 * r["final_accuracy_mean"], r["bytes_sent_per_worker"] / 2**20
            ax.errorbar([mib], [mean], yerr=[[mean - 100 * min(vals)], [100 * max(vals) - mean]],
                        fmt="o", capsize=3, label=r["label"])
        ax.set_ylabel("final test accuracy, % (mean, seed range)")
        ax.set_xlabel("MiB sent per worker over training (log)")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(f"quality per byte: {part}")
    fig.tight_layout()
    fig.savefig(path)
    return path


def markdown(doc: dict[str, Any]) -> str:
    """The aggregated rows as a Markdown table (as pasted into BENCHMARKS.md), in the layout of
    ``gradzip.bench``'s tables."""
    from gradzip.bench.table import format_table  # imports torch: only when a table is made

    acc = doc["part"] == "cifar10"
    columns = [("run", "run"),
               ("metric", "test accuracy % (mean, spread)" if acc else "test loss (mean, spread)"),
               ("mib", "MiB sent/worker"), ("vs", "vs dense"),
               ("found", "critical intervals found (forced)"),
               ("share", "gentle share of tensor-steps")]
    cells = []
    for r in doc["rows"]:
        m, sp = ((100 * r["final_accuracy_mean"], 100 * r["final_accuracy_spread"]) if acc
                 else (r["final_test_loss_mean"], r["final_test_loss_spread"]))
        found = critical = "-"
        if r["critical_found"] is not None:
            found = (f"{r['critical_found']:.1f} ({r['critical_forced']:.1f}) of "
                     f"{r['decision_points']:.0f}")
            critical = f"{100 * r['critical_step_share']:.0f}%"
        cells.append({"run": r["label"], "metric": f"{m:.{2 if acc else 4}f} ({sp:.{2 if acc else 4}f})",
                      "mib": f"{r['bytes_sent_per_worker'] / 2**20:.2f}",
                      "vs": f"{r['compression']:.1f}x", "found": found, "share": critical})
    return format_table(cells, columns)
