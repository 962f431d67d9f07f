"""Wire bytes per worker per step as the number of workers grows, for the sparsifiers before
(``exchange=allgather``) and after (``exchange=auto``, which picks the sharded exchange where
it costs less), shared-support Top-k (``sharedtopk``: block scores and the chosen blocks'
values, both all-reduced), with ``none`` (a dense fp32 ring all-reduce) as the yardstick.

A simulated group of ``W`` workers reduces 8 tensors of 256 x 256 (``--tensors``) (random normal gradients,
one seed) for ``--steps`` steps through the engine (error feedback on); the figure is the
mean wire bytes per worker per step over the steps after the first (the hard threshold's
first step calibrates lambda), as a fraction of the fp32 payload (``4 * entries``). Byte
counts are exact (the collectives' own accounting); only the threshold's all-gather form
depends on the data.

Outputs: ``NAME.json`` (per spec and ``W``: the fraction, the bytes and each tensor's form)
and ``NAME.md`` (the table), both in ``--results``.

Usage::

    python -m benchmarks.scaling_bytes                                   # W = 2 ... 512
    python -m benchmarks.scaling_bytes --workers 2 8 --steps 3 --name smoke
    python -m benchmarks.scaling_bytes --workers 512 --tensors 1 --steps 2 --name w512
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import gradzip
from gradzip.compressors.sharded_sparse import exchange_forms

from ._common import RESULTS

TENSORS = 8
#: (label, spec) rows of the table: each sparsifier before and after, and the yardstick.
SPECS = [
    ("none (ring)", "none"),
    ("topk 1%, all-gather", "topk:ratio=0.01,exchange=allgather"),
    ("topk 1%, auto", "topk:ratio=0.01"),
    ("threshold budget 1%, all-gather", "threshold:budget=0.01,exchange=allgather"),
    ("threshold budget 1%, auto", "threshold:budget=0.01"),
    ("chunktopk (SparseLoCo), all-gather", "chunktopk:chunk=4096,k=64,bits=2,exchange=allgather"),
    ("chunktopk (SparseLoCo), auto", "chunktopk:chunk=4096,k=64,bits=2"),
    ("shared-support Top-k 1%", "sharedtopk:ratio=0.01"),
]
WORKERS = [2, 8, 32, 128, 512]


def shapes_of(tensors: int) -> dict[str, torch.Size]:
    """``tensors`` tensors of 256 x 256."""
    return {f"layer{i}.weight": torch.Size([256, 256]) for i in range(tensors)}


def measure(spec: str, workers: int, steps: int, tensors: int = TENSORS) -> dict[str, Any]:
    """One spec at ``workers`` simulated workers: wire bytes per worker per step (mean over
    the steps after the first) and its fraction of the fp32 payload."""
    shapes = shapes_of(tensors)
    engine = gradzip.Engine(shapes, spec, collective=gradzip.SimulatedGroup(workers))
    gen = torch.Generator().manual_seed(0)
    after_first = 0
    for step in range(steps):
        grads = {n: torch.randn(workers, *s, generator=gen) for n, s in shapes.items()}
        engine.reduce(grads)
        del grads
        if step == 0:
            after_first = engine.stats["wire_bytes"][0]
    wire = (engine.stats["wire_bytes"][0] - after_first) / (steps - 1)
    payload = 4 * sum(s.numel() for s in shapes.values())
    compressor = engine.compressor
    taken = compressor.report(engine.compressor_state).get("exchange")
    if taken is not None:  # forms that follow each step's counts (the threshold's sized form)
        forms = sorted(f for f, n in taken.items() if n)
    elif hasattr(compressor, "exchange_for"):
        forms = sorted(set(exchange_forms(compressor, shapes, workers).values()))
    elif hasattr(compressor, "sends_sparse"):  # shared support, or dense where cheaper
        forms = sorted({"shared" if compressor.sends_sparse(s.numel()) else "dense"
                        for s in shapes.values()})
    else:
        forms = ["dense"]
    del engine
    gc.collect()
    return {"spec": spec, "workers": workers, "tensors": tensors, "wire_bytes_per_step": wire,
            "fraction": wire / payload, "forms": forms}


def table(rows: list[dict[str, Any]], workers: Sequence[int]) -> str:
    """The markdown table: one row per spec, one column per worker count."""
    lines = ["| spec | " + " | ".join(f"W={w}" for w in workers) + " |",
             "|---|" + "---|" * len(workers)]
    for label, spec in SPECS:
        cells = []
        for w in workers:
            row = next((r for r in rows if r["spec"] == spec and r["workers"] == w), None)
            cells.append("-" if row is None else f"{row['fraction']:.3g}")
        lines.append(f"| {label} (`{spec}`) | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=WORKERS)
    parser.add_argument("--steps", type=int, default=4, help="steps per run (>= 2)")
    parser.add_argument("--tensors", type=int, default=TENSORS,
                        help="tensors of 256 x 256 (fewer for many workers: each tensor's form "
                             "and bytes do not depend on the others)")
    parser.add_argument("--only", nargs="+", default=None, help="specs to run (default: all)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--name", default="scaling_bytes")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps must be >= 2, got {args.steps}")
    if any(w < 1 for w in args.workers):
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if args.tensors < 1:
        parser.error(f"--tensors must be >= 1, got {args.tensors}")
    rows = []
    for w in args.workers:
        for label, spec in SPECS:
            if args.only is not None and spec not in args.only:
                continue
            row = measure(spec, w, args.steps, args.tensors)
            rows.append(row)
            print(f"W={w:4d} {label:38s} {row['fraction']:.4f} {row['forms']}", flush=True)
    args.results.mkdir(parents=True, exist_ok=True)
    meta = {"shapes": {n: list(s) for n, s in shapes_of(args.tensors).items()}, "steps": args.steps,
            "measure": "mean wire bytes per worker per step after the first / (4 * entries)"}
    (args.results / f"{args.name}.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    text = table(rows, args.workers)
    (args.results / f"{args.name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
