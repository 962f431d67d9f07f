"""The summary of ``benchmarks/outer_netem.py``: one row per (link, method), the speedups, the
verdicts against the targets, a paper estimate of what a round-trip delay adds, and the
Markdown table.

Kept apart from the launcher so it can be computed again from a results file
(``python -m benchmarks._outer_netem_report RESULTS.json``) and tested without a lab.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

#: The best outer mode at least this many times faster to the target than the best per-step
#: method ...
MIN_SPEEDUP_VS_BEST_PER_STEP = 3.0
#: ... and than per-step ``none``.
MIN_SPEEDUP_VS_NONE = 10.0
#: The round trip of the paper estimate, in seconds (each sequential hop costs half of it).
RTT_SECONDS = 0.1


def hops_per_sync(method: str, workers: int) -> int:
    """Sequential transfers of one synchronisation (one collective call, bucketed): a ring
    all-reduce 2 (W - 1), an all-gather W - 1, PowerSGD two all-reduces, the 8-bit exchange an
    all-to-all plus a ring all-gather (taken as 2 (W - 1)).

    Raises:
        ValueError: ``workers`` < 2.
    """
    if workers < 2:
        raise ValueError(f"`workers` must be >= 2, got {workers}")
    ring = workers - 1
    if method in ("topk1", "sparseloco30"):
        return ring  # an all-gather of every worker's message
    if method == "powersgd4":
        return 4 * ring  # P and Q, each all-reduced
    return 2 * ring


def _first_at_target(evals: list[dict[str, Any]], target: float, h: int) -> dict[str, Any] | None:
    for rec in evals:
        # An outer mode counts only evaluations at synchronisations (identical parameters).
        if (not h or rec["step"] % h == 0) and rec["perplexity"] <= target:
            return rec
    return None


def summarize(record: dict[str, Any], target: float, workers: int = 4) -> dict[str, Any]:
    """One table row from one run's record (``outer_netem.run_one``).

    Args:
        record: the run: method, link, its evaluations (step, perplexity, train_seconds,
            wire_bytes, rounds), load averages, kernel byte counts.
        target: the validation perplexity to reach.
        workers: the number of workers (for the hop count of the delay estimate).

    Returns:
        The row; ``seconds_to_target`` None when the run never reached the target.
    """
    head = {k: record[k] for k in ("method", "label", "bandwidth_mbit", "outer_steps")}
    if "error" in record:
        return {**head, "error": record["error"]}
    evals = sorted(record["evaluations"], key=lambda r: (r["step"], r["kind"] != "epoch"))
    last, h = evals[-1], record["outer_steps"]
    hit = _first_at_target(evals, target, h)
    per_sync = hops_per_sync(record["method"], workers) * RTT_SECONDS / 2
    row = {
        **head,
        "steps_run": last["step"], "syncs_run": last["rounds"],
        "seconds_per_step": last["train_seconds"] / last["step"],
        "bytes_per_worker": last["wire_bytes"],
        "bytes_per_worker_per_sync": last["wire_bytes"] / max(last["rounds"], 1),
        "final_perplexity": last["perplexity"],
        "best_perplexity": min(r["perplexity"] for r in evals),
        "stopped_at_target": record.get("stopped_at_target", False),
        "kernel_tx_bytes_max": max(record.get("kernel_tx_bytes") or [0]),
        "loadavg_before": record["loadavg_before"][0], "loadavg_after": record["loadavg_after"][0],
        "wall_seconds": record["wall_seconds"],
        "rtt_seconds_per_sync": per_sync,
        "steps_to_target": None, "seconds_to_target": None, "syncs_to_target": None,
        "bytes_to_target": None, "seconds_to_target_with_rtt": None,
    }
    if hit is not None:
        row.update(steps_to_target=hit["step"], seconds_to_target=hit["train_seconds"],
                   syncs_to_target=hit["rounds"], bytes_to_target=hit["wire_bytes"],
                   seconds_to_target_with_rtt=hit["train_seconds"] + hit["rounds"] * per_sync)
    return row


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num and den else None


def speedups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per link: the best outer mode's and the best per-step method's times to target, and
    the verdicts against the two targets (a missing time is a missed target).

    Also sets each row's ``speedup_vs_none``.
    """
    out = []
    for rate in sorted({r["bandwidth_mbit"] for r in rows}):
        mine = [r for r in rows if r["bandwidth_mbit"] == rate and "error" not in r]
        none = next((r["seconds_to_target"] for r in mine if r["method"] == "none"), None)
        for r in mine:
            r["speedup_vs_none"] = _ratio(none, r["seconds_to_target"])
        reached = [r for r in mine if r["seconds_to_target"] is not None]
        outer = min((r for r in reached if r["outer_steps"]), default=None,
                    key=lambda r: r["seconds_to_target"])
        step = min((r for r in reached if not r["outer_steps"]), default=None,
                   key=lambda r: r["seconds_to_target"])
        vs_step = _ratio(step and step["seconds_to_target"], outer and outer["seconds_to_target"])
        vs_none = _ratio(none, outer and outer["seconds_to_target"])
        out.append({
            "bandwidth_mbit": rate,
            "best_outer": outer and outer["method"], "best_per_step": step and step["method"],
            "speedup_vs_best_per_step": vs_step, "speedup_vs_none": vs_none,
            "met_vs_best_per_step": bool(vs_step and vs_step >= MIN_SPEEDUP_VS_BEST_PER_STEP),
            "met_vs_none": bool(vs_none and vs_none >= MIN_SPEEDUP_VS_NONE),
        })
    return out


def build(meta: dict[str, Any], runs: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """The results document: meta, rows, per-link speedups and verdicts, and the runs."""
    workers = int(meta.get("args", {}).get("workers", 4))
    rows = [summarize(r, target, workers) for r in runs]
    return {"meta": {**meta, "target_perplexity": target}, "rows": rows,
            "speedups": speedups(rows), "runs": runs}


def _num(value: float | None, fmt: str, none: str = "-") -> str:
    return none if value is None else format(value, fmt)


def markdown(doc: dict[str, Any]) -> str:
    """The results table and the verdict lines, in Markdown."""
    target = doc["meta"]["target_perplexity"]
    lines = [f"Target: validation perplexity <= {target:g}.", "",
             "| link | method | s per inner step | syncs to target (run) | MB/worker to target "
             "(run) | time to target | speedup vs none | + 100 ms RTT (estimate) | final ppl "
             "(step) | load before / after |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        link = f"{r['bandwidth_mbit']:g} Mbit/s"
        if "error" in r:
            lines.append(f"| {link} | {r['label']} | failed: {r['error']} |" + " |" * 7)
            continue
        mb = r["bytes_to_target"] and r["bytes_to_target"] / 1e6
        lines.append(
            f"| {link} | {r['label']} | {r['seconds_per_step']:.3f} | "
            f"{_num(r['syncs_to_target'], 'd', 'not reached')} ({r['syncs_run']}) | "
            f"{_num(mb, '.2f')} ({r['bytes_per_worker'] / 1e6:.2f}) | "
            f"{_num(r['seconds_to_target'], '.1f')} s | "
            f"{_num(r['speedup_vs_none'], '.2f')}x | "
            f"{_num(r['seconds_to_target_with_rtt'], '.1f')} s | "
            f"{r['final_perplexity']:.1f} ({r['steps_run']}) | "
            f"{r['loadavg_before']:.2f} / {r['loadavg_after']:.2f} |")
    lines.append("")
    for s in doc["speedups"]:
        lines.append(
            f"* {s['bandwidth_mbit']:g} Mbit/s: best outer {s['best_outer']} against best "
            f"per-step {s['best_per_step']}: {_num(s['speedup_vs_best_per_step'], '.2f')}x "
            f"(target {MIN_SPEEDUP_VS_BEST_PER_STEP:g}x: "
            f"{'met' if s['met_vs_best_per_step'] else 'missed'}); against per-step none: "
            f"{_num(s['speedup_vs_none'], '.2f')}x (target {MIN_SPEEDUP_VS_NONE:g}x: "
            f"{'met' if s['met_vs_none'] else 'missed'})")
    return "\n".join(lines)


def write_outputs(out: Path, meta: dict[str, Any], runs: list[dict[str, Any]],
                  target: float) -> dict[str, Any]:
    """Write ``out`` (JSON) and ``out`` with ``.md`` (the table); return the document."""
    doc = build(meta, runs, target)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    out.with_suffix(".md").write_text(markdown(doc) + "\n", encoding="utf-8")
    return doc


def main(argv: list[str] | None = None) -> int:
    """Recompute the rows and tables of a results file for other targets: the first becomes
    the document's target, the others are kept under ``other_targets``; ``--write`` rewrites
    the file and its ``.md`` (one table per target), else the tables are printed."""
    args = sys.argv[1:] if argv is None else argv
    write = "--write" in args
    args = [a for a in args if a != "--write"]
    if not args:
        print("usage: python -m benchmarks._outer_netem_report RESULTS.json [TARGET ...] "
              "[--write]", file=sys.stderr)
        return 2
    path = Path(args[0])
    doc = json.loads(path.read_text(encoding="utf-8"))
    targets = [float(a) for a in args[1:]] or [doc["meta"]["target_perplexity"]]
    if any(not t > 1 for t in targets):
        print(f"targets must be > 1 (perplexities), got {targets}", file=sys.stderr)
        return 2
    docs = [build(doc["meta"], doc["runs"], t) for t in targets]
    text = "\n\n".join(markdown(d) for d in docs)
    if not write:
        print(text)
        return 0
    first = docs[0]
    first["other_targets"] = {f"{d['meta']['target_perplexity']:g}": {
        "rows": d["rows"], "speedups": d["speedups"]} for d in docs[1:]}
    path.write_text(json.dumps(first, indent=1) + "\n", encoding="utf-8")
    path.with_suffix(".md").write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
