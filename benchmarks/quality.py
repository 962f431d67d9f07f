"""Quality per byte: final accuracy (or loss) against bytes sent, over a grid of compressors.

Runs the grid of ``benchmarks/quality_cifar10.toml`` (CIFAR-10, ResNet-8, 4 simulated workers,
PowerSGD / top-k / hard threshold and Accordion over each, two seeds) and of
``benchmarks/quality_logreg.toml`` (logistic regression, 20 workers, top-k vs hard threshold),
through the runner's Python API (:func:`gradzip.train.compare.load_grid`, :func:`~gradzip.train.
runner.run`), several runs at a time in separate processes. Finished runs are reused, so an
interrupted benchmark resumes. Writes, under ``--results``:

* ``quality_<part>_runs.csv``: one row per run (label, seed, final metric, bytes, ...);
* ``quality_<part>.csv`` and ``.json``: one row per configuration, seeds aggregated (mean,
  spread = max - min), Accordion's critical intervals, the verdicts against the papers' claims;
* ``quality_<part>.png``: accuracy vs bytes (CIFAR-10) or test loss vs bytes (logreg).

CIFAR-10 runs read a class-balanced subset of an ImageFolder copy (``--source``: a directory
with ``train/<class>/*`` and ``test/<class>/*``, or a ``.tar.gz`` of one), built once as a tree
of symlinks under ``--subset-dir``.

Usage::

    python benchmarks/quality.py --jobs 2                        # both parts
    python benchmarks/quality.py --part logreg
    python benchmarks/quality.py --part cifar10 --set epochs=2 --train-per-class 50
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import csv
import json
import logging
import multiprocessing
import os
import platform
import re
import statistics
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import torch

from gradzip.train.compare import Grid, load_grid, run_grid
from gradzip.train.metrics import read_metrics, read_summary
from gradzip.train.runner import RunConfig, resolve_config, run

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the shared helpers sit beside this file (also when imported)
    sys.path.append(str(HERE))

from _overrides import parse_sets  # noqa: E402

log = logging.getLogger(__name__)

CONFIGS = {"cifar10": HERE / "quality_cifar10.toml", "logreg": HERE / "quality_logreg.toml"}
#: (Accordion row, its gentle level's static row), compared for the papers' claim.
ACCORDION_PAIRS = (
    ("accordion powersgd r1<->r4", "powersgd r4"),
    ("accordion topk 1%<->10%", "topk 10%"),
    ("accordion threshold 1%<->10%", "threshold budget 10%"),
)
#: (hard-threshold row, the top-k row with the same budget).
THRESHOLD_PAIRS = (("threshold budget 1%", "topk 1%"), ("threshold budget 10%", "topk 10%"))


# -- data -------------------------------------------------------------------------------
def make_subset(source: Path, dest: Path, train_per_class: int, test_per_class: int) -> Path:
    """A class-balanced ImageFolder subset of ``source`` as symlinks: the first N files of
    every class (sorted names). ``source`` may be a ``.tar.gz`` (unpacked next to ``dest``)."""
    source = source.expanduser()
    if source.is_file():
        unpacked = dest.parent / (source.name.split(".")[0] + "-unpacked")
        if not unpacked.is_dir():
            with tarfile.open(source, "r:*") as tar:
                tar.extractall(unpacked, filter="data")
        source = unpacked
    roots = [p.parent for p in source.rglob("train") if (p.parent / "test").is_dir()]
    if not roots:
        raise ValueError(f"`source` must hold train/<class>/ and test/<class>/, got {source}")
    root = sorted(roots, key=lambda p: len(p.parts))[0]
    for split, count in (("train", train_per_class), ("test", test_per_class)):
        for cls_dir in sorted(p for p in (root / split).iterdir() if p.is_dir()):
            out = dest / split / cls_dir.name
            out.mkdir(parents=True, exist_ok=True)
            wanted = sorted(p for p in cls_dir.iterdir() if p.is_file())[:count]
            names = {p.name for p in wanted}
            for stale in out.iterdir():  # a re-run with fewer images per class
                if stale.name not in names:
                    stale.unlink()
            for file in wanted:
                link = out / file.name
                if not link.exists():
                    link.symlink_to(file.resolve())
    return dest


def make_logreg_file(path: Path, n: int = 10000, d: int = 500, density: float = 0.2,
                     flip_prob: float = 0.05, seed: int = 0) -> Path:
    """Write a generated binary problem in LIBSVM format (sparse features; madelon's feature
    count, as in the hard-threshold paper's logistic-regression sets): labels are the sign of a
    random linear function of the features, each flipped with probability ``flip_prob``.
    An existing file is kept."""
    if path.is_file():
        return path
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen) * (torch.rand(n, d, generator=gen) < density)
    w = torch.randn(d, generator=gen)
    y = torch.sign(x @ w + 1e-12)
    flip = torch.rand(n, generator=gen) < flip_prob
    y[flip] = -y[flip]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for i in range(n):
            cols = torch.nonzero(x[i]).flatten().tolist()
            items = " ".join(f"{j + 1}:{float(x[i, j]):.4g}" for j in cols)
            fh.write(f"{int(y[i])} {items}\n")
    os.replace(tmp, path)
    return path


# -- running ----------------------------------------------------------------------------
def _finished(cfg: RunConfig) -> bool:
    summary = read_summary(cfg.out)
    if summary is None:
        return False
    return RunConfig.from_stored(summary.get("config", {})).result_key() == cfg.result_key()


def _run_one(cfg_dict: dict[str, Any]) -> tuple[str, float]:
    """Run one configuration unless finished (in a worker process); (out dir, seconds)."""
    cfg = resolve_config(RunConfig.from_dict(cfg_dict))
    start = time.perf_counter()
    if not _finished(cfg):
        run(cfg)
    return cfg.out, time.perf_counter() - start


def run_parallel(grid: Grid, jobs: int) -> None:
    """Run every run of ``grid`` with up to ``jobs`` processes at a time (skipping finished)."""
    for r in grid.runs:
        resolve_config(r.config)  # configuration errors before any process starts
    todo = [r.config.to_dict() for r in grid.runs]
    if jobs <= 1:
        for i, d in enumerate(todo, 1):
            out, sec = _run_one(d)
            print(f"[{i}/{len(todo)}] {out}: {sec:.1f} s", file=sys.stderr, flush=True)
        return
    ctx = multiprocessing.get_context("spawn")
    with futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        pending = [pool.submit(_run_one, d) for d in todo]
        for i, fut in enumerate(futures.as_completed(pending), 1):
            out, sec = fut.result()
            print(f"[{i}/{len(todo)}] {out}: {sec:.1f} s", file=sys.stderr, flush=True)


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
    """Per-run rows of :func:`run_grid`, with the final test loss and Accordion's decisions."""
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


def benchmark(part: str, config: Path, results: Path, overrides: dict[str, Any],
              out: str | None, jobs: int, tag: str | None = None,
              png: bool = True) -> dict[str, Any]:
    """Run one grid and write its result files (``quality_<tag>*``, tag defaulting to the
    part); returns the JSON document written."""
    tag = tag or part
    start = time.perf_counter()
    grid = load_grid(str(config), overrides=overrides, out=out)
    run_parallel(grid, jobs)
    rows = run_rows(run_grid(grid, stream=None))  # all finished: tabulates, writes compare.png
    metric = "accuracy" if part == "cifar10" else "test_loss"
    agg = aggregate(rows)
    results.mkdir(parents=True, exist_ok=True)
    write_csv(results / f"quality_{tag}_runs.csv", rows)
    write_csv(results / f"quality_{tag}.csv", agg)
    if png:
        plot(results / f"quality_{tag}.png", part, rows, agg)
    doc = {
        "part": part, "config": str(config), "overrides": overrides,
        "command": " ".join(["python", *sys.argv]),
        "wall_seconds": time.perf_counter() - start,  # small when every run was reused
        "run_seconds_total": sum(r["wall_seconds"] for r in rows),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "torch": torch.__version__, "python": platform.python_version()},
        "rows": agg, "verdicts": verdicts(agg, metric),
    }
    (results / f"quality_{tag}.json").write_text(json.dumps(doc, indent=2) + "\n",
                                                  encoding="utf-8")
    return doc


def markdown(doc: dict[str, Any]) -> str:
    """The aggregated rows as a Markdown table (as pasted into BENCHMARKS.md)."""
    acc = doc["part"] == "cifar10"
    head = "| run | " + ("test accuracy % (mean, spread)" if acc else "test loss (mean, spread)")
    lines = [head + " | MiB sent/worker | vs dense | critical intervals found (forced) "
                    "| gentle share of tensor-steps |", "|---|---:|---:|---:|---:|---:|"]
    for r in doc["rows"]:
        m, sp = ((100 * r["final_accuracy_mean"], 100 * r["final_accuracy_spread"]) if acc
                 else (r["final_test_loss_mean"], r["final_test_loss_spread"]))
        crit = ("- | -" if r["critical_found"] is None
                else f"{r['critical_found']:.1f} ({r['critical_forced']:.1f}) of "
                     f"{r['decision_points']:.0f} | {100 * r['critical_step_share']:.0f}%")
        lines.append(f"| {r['label']} | {m:.{2 if acc else 4}f} ({sp:.{2 if acc else 4}f}) | "
                     f"{r['bytes_sent_per_worker'] / 2**20:.2f} | {r['compression']:.1f}x | "
                     f"{crit} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=("cifar10", "logreg", "all"), default="all")
    p.add_argument("--cifar10-config", type=Path, default=CONFIGS["cifar10"])
    p.add_argument("--logreg-config", type=Path, default=CONFIGS["logreg"])
    p.add_argument("--source", type=Path, default=Path("~/.cache/cifar10"),
                   help="CIFAR-10 ImageFolder tree or .tar.gz (default ~/.cache/cifar10)")
    p.add_argument("--subset-dir", type=Path,
                   default=Path("~/.cache/gradzip-quality/cifar10-3k").expanduser())
    p.add_argument("--train-per-class", type=int, default=300)
    p.add_argument("--test-per-class", type=int, default=200)
    p.add_argument("--logreg-data", default="generated",
                   help="logreg data: 'generated' (a 500-feature, 10,000-example LIBSVM file "
                        "written under --subset-dir's parent), 'builtin' (the task's 100-feature "
                        "problem; results tagged logreg_builtin, no plot) or a LIBSVM file")
    p.add_argument("--results", type=Path, default=HERE / "results")
    p.add_argument("--out", default=None, help="run directories root (default: the file's)")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time, one process each")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a run option of every run (JSON values)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    overrides: dict[str, Any] = {"threads": args.threads,
                                 **parse_sets(args.set, option_names=True)}
    parts = ("cifar10", "logreg") if args.part == "all" else (args.part,)
    for part in parts:
        extra = dict(overrides)
        if part == "cifar10" and "data" not in extra:
            extra["data"] = str(make_subset(args.source, args.subset_dir.expanduser(),
                                            args.train_per_class, args.test_per_class))
        tag, png = part, True
        if part == "logreg" and "data" not in extra:
            if args.logreg_data == "builtin":
                tag, png = "logreg_builtin", False
            elif args.logreg_data == "generated":
                target = args.subset_dir.expanduser().parent / "logreg-d500.svm"
                extra["data"] = str(make_logreg_file(target))
            else:
                extra["data"] = args.logreg_data
        config = args.cifar10_config if part == "cifar10" else args.logreg_config
        out = None if args.out is None else str(Path(args.out) / tag)
        doc = benchmark(part, config, args.results, extra, out, args.jobs, tag, png)
        print(markdown(doc))
        print(json.dumps({"part": part, "wall_seconds": round(doc["wall_seconds"], 1),
                          "verdicts": doc["verdicts"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
