"""The summary of ``benchmarks/auto_netem.py``: one row per run, one line per (link, method)
over the seeds, and the verdicts of ``auto`` against the static methods.

Targets, per link (``auto`` is every method whose key starts with ``auto``; the others are the
static configurations):

* ``auto``'s mean time to the target within :data:`WITHIN_BEST` of the best static method's;
* where per-step ``none`` is the best static method, ``auto`` at most :data:`OVER_NONE` slower;
* on a changing link, ``auto`` strictly faster than every static method;
* quality: ``auto``'s final perplexity within the static runs' spread over the seeds (only
  when the runs were not stopped at the target, else "not measured").

A method that misses the target in any seed has no mean time and never wins. Kept apart from
the launcher so it can be recomputed from a results file
(``python -m benchmarks._auto_netem_report RESULTS.json [TARGET]``) and tested without a lab.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from ._outer_netem_report import summarize

#: ``auto``'s time to target at most this many times the best static method's.
WITHIN_BEST = 1.1
#: ... and at most this many times ``none``'s where ``none`` is the best.
OVER_NONE = 1.05

#: The run fields a row keeps besides the summary's.
RUN_FIELDS = ("seed", "link", "link_changes", "auto_levels")


def is_auto(method: str) -> bool:
    """Whether ``method`` is ``auto`` (the method under test) rather than a static one."""
    return method.startswith("auto")


def synchronised(run: dict[str, Any]) -> dict[str, Any]:
    """``run`` with only the evaluations of parameters every worker holds: under
    ``--auto-outer``, after the switch (``switched_at``, with ``H`` = ``outer_steps``) those
    at ``switched_at + k H``, or, where ``--auto-outer-follow`` changed H, at ``outer_since +
    k H`` (the step the H in force started at); between synchronisations each worker
    evaluates its own."""
    if "evaluations" not in run:
        return run
    kept = [e for e in run["evaluations"] if e.get("switched_at") is None
            or (e["step"] - e.get("outer_since", e["switched_at"])) % e["outer_steps"] == 0]
    return {**run, "evaluations": kept}


def rows_of(runs: list[dict[str, Any]], target: float, workers: int) -> list[dict[str, Any]]:
    """One row per run: :func:`~benchmarks._outer_netem_report.summarize` plus the seed, the
    link's label, the link changes made and ``auto``'s levels."""
    out = []
    for run in runs:
        row = summarize(synchronised(run), target, workers)
        row.update({k: run[k] for k in RUN_FIELDS if k in run})
        out.append(row)
    return out


def _spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def per_method(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (link, method), over the seeds: time to target (mean, min, max; ``None`` when any
    seed failed or missed it), steps to target, final perplexity, seconds per step."""
    out = []
    keys = list(dict.fromkeys((r["link"], r["method"]) for r in rows))
    for link, method in keys:
        mine = [r for r in rows if (r["link"], r["method"]) == (link, method)]
        ok = [r for r in mine if "error" not in r]
        times = [r["seconds_to_target"] for r in ok]
        reached = len(ok) == len(mine) and all(t is not None for t in times)
        out.append({
            "link": link, "method": method, "label": mine[0]["label"], "seeds": len(mine),
            "failed": len(mine) - len(ok),
            "missed": sum(t is None for t in times),
            "seconds_to_target": _spread(times) if reached else None,
            "steps_to_target": _spread([r["steps_to_target"] for r in ok]) if reached else None,
            "final_perplexity": _spread([r["final_perplexity"] for r in ok]) if ok else None,
            "seconds_per_step": _spread([r["seconds_per_step"] for r in ok]) if ok else None,
            "stopped_at_target": any(r["stopped_at_target"] for r in ok),
        })
    return out


def _mean_time(entry: dict[str, Any] | None) -> float | None:
    return entry["seconds_to_target"]["mean"] if entry and entry["seconds_to_target"] else None


def verdicts(methods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (link, auto method): its time against the best static one's and ``none``'s, whether
    it beats every static one on a changing link, and its quality against the static runs'."""
    out = []
    for link in dict.fromkeys(m["link"] for m in methods):
        mine = [m for m in methods if m["link"] == link]
        static = [m for m in mine if not is_auto(m["method"])]
        timed = [m for m in static if _mean_time(m) is not None]
        best = min(timed, key=_mean_time, default=None)
        none = next((m for m in static if m["method"] == "none"), None)
        changing = "@" in link
        finals = [m["final_perplexity"] for m in static if m["final_perplexity"]]
        for auto in (m for m in mine if is_auto(m["method"])):
            t = _mean_time(auto)
            v: dict[str, Any] = {
                "link": link, "method": auto["method"], "changing": changing,
                "best_static": best and best["method"], "seconds_to_target": t,
                "best_static_seconds": _mean_time(best),
                "vs_best": t / _mean_time(best) if t and best else None,
            }
            v["met_within_best"] = bool(v["vs_best"] is not None and v["vs_best"] <= WITHIN_BEST)
            if best is not None and best["method"] == "none":
                v["vs_none"] = t / _mean_time(none) if t else None
                v["met_over_none"] = bool(v["vs_none"] is not None and v["vs_none"] <= OVER_NONE)
            if changing:
                v["met_faster_than_every_static"] = bool(
                    t is not None and len(timed) == len(static)
                    and all(t < _mean_time(m) for m in static))
            if auto["stopped_at_target"] or any(m["stopped_at_target"] for m in static):
                v["quality"] = "not measured (runs stopped at the target)"
            elif auto["final_perplexity"] and finals:
                low = min(f["min"] for f in finals)
                high = max(f["max"] for f in finals)
                v["quality"] = ("within" if low <= auto["final_perplexity"]["mean"] <= high
                                else "outside") + f" the static runs' [{low:.1f}, {high:.1f}]"
            out.append(v)
    return out


def build(meta: dict[str, Any], runs: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """The results document: meta, rows, per-method lines, verdicts and the runs."""
    workers = int(meta.get("args", {}).get("workers", 2))
    rows = rows_of(runs, target, workers)
    methods = per_method(rows)
    return {"meta": {**meta, "target_perplexity": target}, "rows": rows, "methods": methods,
            "verdicts": verdicts(methods), "runs": runs}


def _fmt(spread: dict[str, float] | None, fmt: str) -> str:
    if spread is None:
        return "-"
    if spread["min"] == spread["max"]:
        return format(spread["mean"], fmt)
    return f"{spread['mean']:{fmt}} ({spread['min']:{fmt}}-{spread['max']:{fmt}})"


def _yes(flag: bool) -> str:
    return "met" if flag else "**missed**"


def markdown(doc: dict[str, Any]) -> str:
    """The per-method table and the verdict lines, in Markdown."""
    target = doc["meta"]["target_perplexity"]
    lines = [f"Target: validation perplexity <= {target:g}. Means over the seeds (min-max).", "",
             "| link (Mbit/s) | method | seeds | time to target (s) | steps to target | "
             "s per step | final ppl |",
             "|---|---|---|---|---|---|---|"]
    for m in doc["methods"]:
        missed = f" ({m['missed']} missed, {m['failed']} failed)" if m["missed"] or m[
            "failed"] else ""
        lines.append(f"| {m['link']} | {m['label']} | {m['seeds']}{missed} | "
                     f"{_fmt(m['seconds_to_target'], '.1f')} | "
                     f"{_fmt(m['steps_to_target'], '.0f')} | "
                     f"{_fmt(m['seconds_per_step'], '.3f')} | "
                     f"{_fmt(m['final_perplexity'], '.1f')} |")
    lines.append("")
    for v in doc["verdicts"]:
        ratio = "-" if v["vs_best"] is None else f"{v['vs_best']:.2f}x"
        text = (f"* {v['link']} Mbit/s, {v['method']}: {ratio} the best static "
                f"({v['best_static']}); within {WITHIN_BEST:g}x: {_yes(v['met_within_best'])}")
        if "met_over_none" in v:
            vs = "-" if v["vs_none"] is None else f"{v['vs_none']:.2f}x"
            text += f"; `none` is best: {vs} its time, <= {OVER_NONE:g}x: {_yes(v['met_over_none'])}"
        if v["changing"]:
            text += (f"; faster than every static method: "
                     f"{_yes(v['met_faster_than_every_static'])}")
        if "quality" in v:
            text += f"; quality {v['quality']}"
        lines.append(text)
    return "\n".join(lines)


def write_outputs(out: Path, meta: dict[str, Any], runs: list[dict[str, Any]],
                  target: float) -> dict[str, Any]:
    """Write ``out`` (JSON) and ``out`` with ``.md`` (the table); return the document."""
    doc = build(meta, runs, target)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc) + "\n", encoding="utf-8")  # one line: the runs are large
    out.with_suffix(".md").write_text(markdown(doc) + "\n", encoding="utf-8")
    return doc


def merge(out: Path, parts: list[Path]) -> dict[str, Any]:
    """Write ``out`` from the runs of several results files of the same task and target (for
    example one per seed, or passes added later); the first file's meta is kept, with every
    part's under ``parts``.

    Raises:
        ValueError: the parts' targets or workers differ, or a (seed, link, method) repeats.
    """
    docs = [json.loads(p.read_text(encoding="utf-8")) for p in parts]
    targets = {d["meta"]["target_perplexity"] for d in docs}
    workers = {d["meta"]["args"]["workers"] for d in docs}
    if len(targets) != 1 or len(workers) != 1:
        raise ValueError(f"`parts` must share one target and worker count, got targets "
                         f"{sorted(targets)} and workers {sorted(workers)}")
    runs = [r for d in docs for r in d["runs"]]
    keys = [(r["seed"], r["link"], r["method"]) for r in runs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"`parts` must not repeat a (seed, link, method), got {keys}")
    meta = {**docs[0]["meta"], "parts": [{"file": p.name, "meta": d["meta"]}
                                         for p, d in zip(parts, docs, strict=True)]}
    return write_outputs(out, meta, runs, targets.pop())


def main(argv: list[str] | None = None) -> int:
    """Print the tables of a results file, for its own target or the one given; or, with
    ``--merge OUT PART...``, write ``OUT`` from several results files."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) >= 3 and args[0] == "--merge":
        print(markdown(merge(Path(args[1]), [Path(a) for a in args[2:]])))
        return 0
    if not args or args[0] == "--merge":
        print("usage: python -m benchmarks._auto_netem_report RESULTS.json [TARGET]\n"
              "       python -m benchmarks._auto_netem_report --merge OUT.json PART.json ...",
              file=sys.stderr)
        return 2
    doc = json.loads(Path(args[0]).read_text(encoding="utf-8"))
    target = float(args[1]) if len(args) > 1 else doc["meta"]["target_perplexity"]
    print(markdown(build(doc["meta"], doc["runs"], target)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
