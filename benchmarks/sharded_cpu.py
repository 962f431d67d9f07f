"""CPU time of the sparsifiers' exchange forms in the simulator, as the number of workers grows.

    python -m benchmarks.sharded_cpu [--out DIR] [--workers 8 32] [--steps N] [--repeats R]

The sharded exchange (``exchange="sharded"``) sends O(k) bytes per worker whatever the number
of workers, but does more arithmetic per worker than the all-gather: it splits each worker's
selection among the owners, and each owner sums what it received and selects again. In the
simulator every worker's arithmetic runs in one process, so the CPU time of one engine step
is what ``W`` workers' arithmetic costs together; divided by ``W`` it is one worker's.

Model: the byte table's (``scaling_bytes.py``): 8 matrices of 256 x 256 and 8 biases of 256.
Each configuration runs ``--steps`` steps after one warm-up step, ``--repeats`` times; the
figure is the fastest repeat's mean step, in CPU seconds of this process on one thread (other
processes on the machine do not count). Results: ``sharded_cpu.json`` and ``sharded_cpu.md``
in ``--out`` (default ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

import gradzip

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {**{f"w{i}": (256, 256) for i in range(8)}, **{f"b{i}": (256,) for i in range(8)}}
SPECS = ["topk:ratio=0.01", "threshold:budget=0.01", "chunktopk:chunk=4096,k=64"]
FORMS = ("allgather", "sharded")


def step_seconds(spec: str, workers: int, steps: int, repeats: int) -> float:
    """CPU seconds of one simulated engine step of ``spec`` with ``workers`` workers."""
    best = float("inf")
    for _ in range(repeats):
        engine = gradzip.Engine({n: torch.zeros(s) for n, s in SHAPES.items()}, spec,
                                collective=gradzip.SimulatedGroup(workers))
        gen = torch.Generator().manual_seed(0)
        grads = [{n: torch.randn((workers, *s), generator=gen) for n, s in SHAPES.items()}
                 for _ in range(steps + 1)]
        engine.reduce(grads[0])  # residuals and state made
        start = time.process_time()
        for g in grads[1:]:
            engine.reduce(g)
        best = min(best, (time.process_time() - start) / steps)
    return best


def measure(workers: list[int], steps: int, repeats: int) -> list[dict[str, Any]]:
    rows = []
    for w in workers:
        for spec in SPECS:
            times = {form: step_seconds(f"{spec},exchange={form}", w, steps, repeats)
                     for form in FORMS}
            rows.append({"spec": spec, "workers": w,
                         **{f"{form}_ms": 1e3 * t for form, t in times.items()},
                         "sharded_over_allgather": times["sharded"] / times["allgather"]})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| spec | W | all-gather (ms per step, all workers) | sharded | sharded / all-gather |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| `{r['spec']}` | {r['workers']} | {r['allgather_ms']:.1f} | "
                     f"{r['sharded_ms']:.1f} | {r['sharded_over_allgather']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--workers", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if min(args.workers) < 2 or args.steps < 1 or args.repeats < 1:
        parser.error(f"--workers must be >= 2, --steps and --repeats >= 1, got "
                     f"{args.workers}, {args.steps}, {args.repeats}")
    torch.set_num_threads(1)
    rows = measure(args.workers, args.steps, args.repeats)
    meta = {"torch": torch.__version__, "gradzip": gradzip.__version__, "threads": 1,
            "shapes": "8 x (256, 256) + 8 x (256,)", "steps": args.steps,
            "repeats": args.repeats, "command": "python -m benchmarks.sharded_cpu " +
            " ".join(sys.argv[1:])}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sharded_cpu.json").write_text(json.dumps({"meta": meta, "rows": rows},
                                                          indent=1) + "\n")
    text = table(rows) + "\n"
    (args.out / "sharded_cpu.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
