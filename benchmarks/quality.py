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

The rows, the verdicts, the plot and the Markdown table are made by ``_quality_report.py``
beside this file.

Usage::

    python -m benchmarks.quality --jobs 2                        # both parts
    python -m benchmarks.quality --part logreg
    python -m benchmarks.quality --part cifar10 --set epochs=2 --train-per-class 50
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import json
import logging
import multiprocessing
import os
import platform
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import torch

from gradzip.train.compare import Grid, load_grid, run_grid
from gradzip.train.metrics import read_summary
from gradzip.train.runner import RunConfig, resolve_config, run

from ._overrides import parse_sets
from ._quality_report import (
    aggregate,
    markdown,
    plot,
    run_rows,
    verdicts,
    write_csv,
)

HERE = Path(__file__).resolve().parent

log = logging.getLogger(__name__)

CONFIGS = {"cifar10": HERE / "quality_cifar10.toml", "logreg": HERE / "quality_logreg.toml"}


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
        run(cfg, resume=True)  # an interrupted run continues (a re-run over it is refused)
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
