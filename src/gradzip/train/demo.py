"""``gradzip demo``: the ``demo`` preset run over several seeds, one table of means and ranges,
one summary line and a plot.

One seed is not enough to rank these methods on the digits task: PowerSGD rank 1 alone ends
anywhere between about a third and nine tenths of the test images right, depending on the
seed (which also draws the train/test split). The demo therefore runs every method on
``seeds`` seeds and its summary speaks of the means, and of Accordion against the line
between its levels only when every seed agrees (:mod:`gradzip.train.demo_summary`).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from gradzip.train.compare import Grid, GridRun, load_grid, run_grid
from gradzip.train.data import load_digits
from gradzip.train.demo_summary import by_method, format_methods, summary_line
from gradzip.train.metrics import read_metrics
from gradzip.train.plots import plot_runs

__all__ = ["chance_level", "demo_grid", "run_demo"]


def demo_grid(seeds: int, overrides: dict[str, Any] | None = None,
              out: str | None = None) -> Grid:
    """The ``demo`` preset's runs, each on seeds ``0 .. seeds - 1``.

    Args:
        seeds: how many seeds per method, >= 1.
        overrides: option values applied to every run (``epochs``, ``limit_train``).
        out: the output root (default: the preset's, ``gradzip-demo``).

    Returns:
        The grid: labels ``"<method> [seed=N]"``, each run in ``<out>/<method>-seedN``.

    Raises:
        TypeError, ValueError: ``seeds`` is not an integer >= 1, or an invalid override.
    """
    if isinstance(seeds, bool) or not isinstance(seeds, int):
        raise TypeError(f"`seeds` must be an integer, got {type(seeds).__name__}")
    if seeds < 1:
        raise ValueError(f"`seeds` must be >= 1, got {seeds}")
    grid: Grid | None = None
    runs: list[list[GridRun]] = []
    for seed in range(seeds):
        # The seed draws the model's initialisation, the shuffling and the train/test split.
        one = load_grid("demo", overrides={**(overrides or {}), "seed": seed}, out=out)
        grid = grid or one
        runs.append([GridRun(f"{r.label} [seed={seed}]",
                             dataclasses.replace(r.config, out=f"{r.config.out}-seed{seed}"))
                     for r in one.runs])
    assert grid is not None  # seeds >= 1
    # Method by method, so that the table's rows and the status lines keep the preset's order.
    grid.runs = [per_seed[i] for i in range(len(runs[0])) for per_seed in runs]
    return grid


def chance_level(task: str) -> float | None:
    """The accuracy a guess reaches on the demo's task (``1 / classes`` of the embedded
    digits), or None for another task (its data may need a download to count classes)."""
    if task != "digits":
        return None
    return 1.0 / load_digits().num_classes


def run_demo(*, out: str, seeds: int, overrides: dict[str, Any] | None = None,
             progress: bool = False, stream: TextIO | None = sys.stderr) -> int:
    """Run the demo and print its table, summary line and files.

    Args:
        out: the output root.
        seeds: seeds per method (>= 1).
        overrides: option values applied to every run.
        progress: progress bars inside each run.
        stream: where one status line per run goes (None: silent).

    Returns:
        0.

    Raises:
        TypeError, ValueError: invalid ``seeds`` or overrides.
    """
    grid = demo_grid(seeds, overrides, out)
    first = grid.runs[0].config
    methods = len(grid.runs) // seeds
    print(f"gradzip demo: task {first.task}, {first.workers} simulated workers, {methods} "
          f"methods x {seeds} seed{'s' if seeds > 1 else ''} = {len(grid.runs)} runs of "
          f"{first.epochs} epoch{'s' if first.epochs != 1 else ''}", flush=True)
    start = time.perf_counter()
    rows = run_grid(grid, force=True, progress=progress, stream=stream)
    print(format_methods(by_method(rows)))
    print(summary_line(rows, chance=chance_level(first.task)))
    print(f"total {time.perf_counter() - start:.1f} s; runs in {grid.out}/")
    files = rows[0]["_files"]
    # The demo's plot: one curve per method, its first seed (every seed's curve is in
    # compare.png beside it).
    plot = plot_runs([(r["label"].rsplit(" [seed=", 1)[0], read_metrics(r["out"]))
                      for r in rows if r["seed"] == rows[0]["seed"]],
                     Path(grid.out) / "demo.png", metric=rows[0]["metric"],
                     title=f"{grid.name} (seed {rows[0]['seed']})")
    print(f"plot: {plot} (all seeds: {files['plot']})" if plot is not None
          else "plot: (matplotlib not installed)")
    return 0
