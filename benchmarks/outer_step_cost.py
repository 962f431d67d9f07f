"""The step cost of synchronising less often: how many inner steps H = 10 needs to reach what
H = 30 and H = 100 reach in the run's full length.

The cost model prices time per step; a larger H also makes each step worth less, so pricing H
on time alone over-rewards rare synchronisation (`--auto-outer-follow` moved from H = 10 to 30
on a link where that lost time). This script measures that worth on the two tasks of
``outer_sweep.py``, with the library's default outer settings at each H
(:func:`~gradzip.outer_defaults`): for each seed, H = 10 is trained with its model evaluated
after every synchronisation, H = 30 and H = 100 are trained for the same number of inner
steps and evaluated at the end, and the step at which H = 10's curve first reaches each final
metric (linear between evaluations) gives the **step cost** ``steps / that step``: 1.2 means
H needs 1.2 inner steps for what H = 10 does in one. A final metric that H = 10 never reaches
gives a cost below 1 (H = 10 reached it at the end only by extrapolation) and is reported as
such.

Writes ``--out`` (default ``benchmarks/results/outer_step_cost.json``) and prints a table.

    python -m benchmarks.outer_step_cost --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradzip import Outer, SimulatedGroup

from .outer_sweep import CORPUS, CNNTask, Grid, LMTask, replicas

HERE = Path(__file__).resolve().parent
#: The reference H (every other H's cost is relative to it) and the H measured against it.
REFERENCE = 10
OTHERS = (30, 100)


def curve(task: Any, grid: Grid, h: int, seed: int, *, every_sync: bool) -> list[tuple[int, float]]:
    """``(inner step, metric)`` after every synchronisation (``every_sync``) or at the end only:
    the training of ``outer_sweep.train_one`` with the default outer settings."""
    models, inner, gens = replicas(task, grid, seed)
    first = models[0]
    outer = Outer(models, "none", inner_steps=h, collective=SimulatedGroup(len(models)),
                  inner_optimizers=inner)
    points = []
    for step in range(1, grid.steps + 1):
        for model, opt, gen in zip(models, inner, gens, strict=True):
            opt.zero_grad(set_to_none=True)
            task.loss(model, task.batch_of(gen)).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        outer.step()
        if (every_sync and step % h == 0) or step == grid.steps:
            # Right after a synchronisation every replica holds the averaged model.
            points.append((step, float(task.evaluate(first)["metric"])))
    return points


def steps_to_reach(points: list[tuple[int, float]], value: float) -> float | None:
    """The first inner step at which the curve is at or below ``value`` (linear between
    evaluations, the curve taken as 0 steps' worth before its first point); ``None`` if never."""
    before: tuple[int, float] | None = None
    for step, metric in points:
        if metric <= value:
            if before is None or before[1] == metric:
                return float(step)
            s0, m0 = before
            return s0 + (step - s0) * (m0 - value) / (m0 - metric)
        before = (step, metric)
    return None


def measure(tasks: list[str], seeds: list[int], grid: Grid, corpus: Path) -> list[dict[str, Any]]:
    rows = []
    for name in tasks:
        task = LMTask(grid, corpus) if name == "lm" else CNNTask(grid)
        for seed in seeds:
            start = time.perf_counter()
            ref = curve(task, grid, REFERENCE, seed, every_sync=True)
            for h in OTHERS:
                final = curve(task, grid, h, seed, every_sync=False)[-1][1]
                reached = steps_to_reach(ref, final)
                rows.append({"task": name, "seed": seed, "h": h, "steps": grid.steps,
                             "final": final, "reference_final": ref[-1][1],
                             "reference_steps_to_reach": reached,
                             "cost": grid.steps / reached if reached else None})
            print(f"{name} seed {seed}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return rows


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for name in sorted({r["task"] for r in rows}):
        for h in OTHERS:
            costs = [r["cost"] for r in rows if r["task"] == name and r["h"] == h]
            known = [c for c in costs if c is not None]
            out.append({"task": name, "h": h, "seeds": len(costs),
                        "cost_mean": statistics.fmean(known) if known else None,
                        "cost_min": min(known) if known else None,
                        "cost_max": max(known) if known else None,
                        "never_reached": len(costs) - len(known)})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", nargs="+", default=["lm", "cnn"], choices=["lm", "cnn"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--corpus", type=Path, default=CORPUS,
                   help="WikiText-2's test.txt and valid.txt (for the lm task)")
    p.add_argument("--out", type=Path, default=HERE / "results" / "outer_step_cost.json")
    args = p.parse_args(argv)
    if args.steps < max(OTHERS):
        p.error(f"--steps must be >= {max(OTHERS)}, got {args.steps}")
    torch.set_num_threads(1)
    grid = Grid(steps=args.steps)
    rows = measure(args.tasks, args.seeds, grid, args.corpus)
    table = summary(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": {"command": " ".join(sys.argv), "steps": args.steps,
                                             "reference_h": REFERENCE, "torch": torch.__version__},
                                    "rows": rows, "summary": table}, indent=1) + "\n")
    for t in table:
        print(f"{t['task']} H={t['h']}: step cost mean {t['cost_mean']}, range "
              f"[{t['cost_min']}, {t['cost_max']}], never reached {t['never_reached']} of {t['seeds']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
