"""Wire bytes per worker per step in real gloo processes, against the simulator, as W grows.

For each worker count ``W`` (``--workers``, default 2 4 8), ``W`` processes join a gloo group
on 127.0.0.1 (:func:`gradzip.comm.run_processes`) and each runs one engine per spec over
``--steps`` steps of ``--tensors`` tensors of ``--side`` x ``--side`` (random normal gradients,
drawn from one seed so that every process and the simulator see the same numbers). Each rank
records its engine's wire bytes of every step; the same spec then runs in a simulated group of
``W`` workers in this process, and the two must be equal, byte for byte, on every rank and
step (the byte meter counts what the collectives carry, so a mismatch means the real exchange
and the simulated one differ).

The specs are the sparsifiers (Top-k 1%, the hard threshold with a 1% budget, ``chunktopk``)
and the quantisers (QSGD, Sign), each with ``exchange=sharded``, ``exchange=allgather`` and
``auto`` (the engine's choice), shared-support Top-k 1% (``sharedtopk``: two all-reduces),
and ``none`` (an fp32 ring all-reduce) as the yardstick. The
per-worker figure is the mean over the steps after the first (the threshold's first step
calibrates lambda) as a fraction of the fp32 payload (``4 * entries``). Flatness: the byte
formula of every summing exchange (the fp32 ring's, the sharded ones and the shared support's) depends on ``W`` only
through the factor ``2 (W-1) / W`` (a worker sends ``(W-1)/W`` of a message in each of two
phases); for every sharded or shared-support spec, the fraction divided by that factor may vary over ``W`` by at
most ``FORMULA_SLACK`` (part rounding and headers).

Outputs: ``NAME.json`` (per spec and ``W``: each rank's bytes per step, real and simulated,
the forms, the fraction) and ``NAME.md`` (the table and the verdicts), both in ``--results``.

Usage::

    nice python -m benchmarks.scaling_bytes_procs                      # W = 2 4 8
    nice python -m benchmarks.scaling_bytes_procs --all-workers        # W = 2 ... 8
    python -m benchmarks.scaling_bytes_procs --workers 2 3 --side 32 --only topk sign --name smoke
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import gradzip
from gradzip.bench.table import format_table
from gradzip.comm import run_processes
from gradzip.compressors.sharded_sparse import exchange_forms

from ._common import RESULTS

#: Largest over smallest per-worker fraction of a sharded spec across the worker counts, each
#: divided by the ring factor ``2 (W-1) / W`` of the byte formula.
FORMULA_SLACK = 1.1
#: ``name -> base spec``; each runs with the three exchanges (``none`` alone, as yardstick).
BASES = {
    "topk": "topk:ratio=0.01",
    "threshold": "threshold:budget=0.01",
    "chunktopk": "chunktopk:chunk=4096,k=64,bits=2",
    "qsgd": "qsgd",
    "sign": "sign",
}
EXCHANGES = ("sharded", "allgather", "auto")
#: ``name -> spec`` of compressors with one exchange only, each run once.
SINGLE = {"sharedtopk": "sharedtopk:ratio=0.01"}
#: Labels of the exchanges whose bytes sum across workers (checked for flatness).
SUMMING = ("sharded", "shared support")


def specs(only: Sequence[str] | None = None) -> list[tuple[str, str]]:
    """``(label, spec)`` of every configuration, ``none`` first; ``only`` names bases."""
    out = [("none (ring)", "none")]
    for name, base in BASES.items():
        if only is not None and name not in only:
            continue
        for exchange in EXCHANGES:
            joiner = "," if ":" in base else ":"
            spec = base if exchange == "auto" else f"{base}{joiner}exchange={exchange}"
            out.append((f"{name} ({exchange})", spec))
    for name, spec in SINGLE.items():
        if only is None or name in only:
            out.append((f"{name} (shared support)", spec))
    return out


def shapes_of(tensors: int, side: int) -> dict[str, torch.Size]:
    """``tensors`` tensors of ``side`` x ``side``."""
    return {f"layer{i}.weight": torch.Size([side, side]) for i in range(tensors)}


def grads_of(shapes: dict[str, torch.Size], workers: int, step: int) -> dict[str, torch.Tensor]:
    """Every worker's gradients of ``step`` (``[workers, *shape]``), the same in every process."""
    gen = torch.Generator().manual_seed(1000 + step)
    return {n: torch.randn(workers, *s, generator=gen) for n, s in shapes.items()}


def forms_of(engine: gradzip.Engine, shapes: dict[str, torch.Size], workers: int) -> dict[str, int]:
    """Tensors per exchange form the engine's compressor took (``{"dense": n}`` without one);
    for the threshold's sized form, whose form follows each step's counts, tensor-calls per
    form over the run."""
    compressor = engine.compressor
    report = compressor.report(engine.compressor_state).get("exchange")
    if report is not None:  # the quantisers' forms, or the threshold's tensor-calls per form
        return {k: v for k, v in report.items() if v}
    counts: dict[str, int] = {}
    if hasattr(compressor, "exchange_for"):  # the sparsifiers whose forms follow from shapes
        for form in exchange_forms(compressor, shapes, workers).values():
            counts[form] = counts.get(form, 0) + 1
        return counts
    if hasattr(compressor, "sends_sparse"):  # shared support, or dense where cheaper
        for shape in shapes.values():
            form = "shared" if compressor.sends_sparse(shape.numel()) else "dense"
            counts[form] = counts.get(form, 0) + 1
        return counts
    return {"dense": len(shapes)}


def _per_step(cumulative: Sequence[Sequence[int]]) -> list[list[int]]:
    """``[step][rank]`` cumulative wire bytes -> ``[rank][step]`` bytes of each step."""
    ranks = len(cumulative[0])
    return [[cumulative[s][r] - (cumulative[s - 1][r] if s else 0) for s in range(len(cumulative))]
            for r in range(ranks)]


def _proc_worker(rank: int, world_size: int, spec_list: list[str], tensors: int, side: int,
                 steps: int) -> dict[str, Any]:
    """One rank in the gloo group: every spec's wire bytes per step and forms."""
    shapes = shapes_of(tensors, side)
    out: dict[str, Any] = {}
    for spec in spec_list:
        engine = gradzip.Engine(shapes, spec)  # the world process group
        cumulative = []
        for step in range(steps):
            engine.reduce({n: g[rank] for n, g in grads_of(shapes, world_size, step).items()})
            cumulative.append([engine.stats["wire_bytes"][0]])
        out[spec] = {"bytes": _per_step(cumulative)[0], "forms": forms_of(engine, shapes, world_size)}
    return out


def simulate(spec: str, workers: int, tensors: int, side: int, steps: int) -> dict[str, Any]:
    """The same run in a simulated group: each rank's wire bytes per step and the forms."""
    shapes = shapes_of(tensors, side)
    engine = gradzip.Engine(shapes, spec, collective=gradzip.SimulatedGroup(workers))
    cumulative = []
    for step in range(steps):
        engine.reduce(grads_of(shapes, workers, step))
        cumulative.append(list(engine.stats["wire_bytes"]))
    return {"bytes": _per_step(cumulative), "forms": forms_of(engine, shapes, workers)}


def measure(workers: int, spec_list: Sequence[tuple[str, str]], tensors: int, side: int,
            steps: int, timeout: float = 600.0) -> list[dict[str, Any]]:
    """Every spec at ``workers`` real processes and simulated: one row per spec."""
    per_rank = run_processes(_proc_worker, workers, [s for _, s in spec_list], tensors, side,
                             steps, timeout=timeout)
    fp32 = 4 * tensors * side * side
    rows = []
    for label, spec in spec_list:
        sim = simulate(spec, workers, tensors, side, steps)
        real = [per_rank[r][spec]["bytes"] for r in range(workers)]
        real_forms = [per_rank[r][spec]["forms"] for r in range(workers)]
        equal = real == sim["bytes"] and all(f == sim["forms"] for f in real_forms)
        later = [sum(b[1:]) / (steps - 1) for b in real]  # mean per step after the first
        rows.append({"label": label, "spec": spec, "workers": workers, "real_bytes": real,
                     "sim_bytes": sim["bytes"], "forms": sim["forms"], "real_forms": real_forms,
                     "equal": equal, "wire_bytes_per_step": max(later), "fp32_bytes": fp32,
                     "fraction": max(later) / fp32})
    return rows


def _ring(workers: int) -> float:
    """The factor ``2 (W-1) / W`` by which a summing exchange's per-worker bytes follow ``W``."""
    return 2 * (workers - 1) / workers


def verdicts(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Equality over all rows, and flatness in W of every sharded spec (forced or chosen)."""
    unequal = [f"{r['label']} W={r['workers']}" for r in rows if not r["equal"]]
    lines = [f"- real == simulated on every rank and step: "
             f"{'yes, all ' + str(len(rows)) + ' configurations' if not unequal else 'NO: ' + ', '.join(unequal)}"]
    for label in dict.fromkeys(r["label"] for r in rows):
        mine = [r for r in rows if r["label"] == label]
        if not any(word in label for word in SUMMING) or len(mine) < 2:
            continue
        fracs = {r["workers"]: r["fraction"] for r in mine}
        growth = max(fracs.values()) / min(fracs.values())
        # Any exchange that sums across W workers sends (W-1)/W of its message twice, as the
        # fp32 ring does: the byte formula's only dependence on W. Divided by that factor the
        # per-worker bytes must stay flat, up to part rounding and headers (FORMULA_SLACK).
        scaled = {w: f * w / (2 * (w - 1)) for w, f in fracs.items()}
        spread = max(scaled.values()) / min(scaled.values())
        ok = spread <= FORMULA_SLACK
        lines.append(f"- {label}: per-worker fraction {min(fracs.values()):.4f} to "
                     f"{max(fracs.values()):.4f} over W={min(fracs)}..{max(fracs)} ({growth:.2f}x;"
                     f" the ring factor 2(W-1)/W grows {_ring(max(fracs)) / _ring(min(fracs)):.2f}x);"
                     f" over that factor {spread:.3f}x, target <= {FORMULA_SLACK}x: "
                     f"{'flat' if ok else 'NOT flat'}")
    return lines


def table(rows: Sequence[dict[str, Any]], workers: Sequence[int]) -> str:
    """Fraction of the fp32 payload per spec (rows) and W (columns); ``*`` marks a mismatch."""
    by = {(r["label"], r["workers"]): r for r in rows}
    out = []
    for label in dict.fromkeys(r["label"] for r in rows):
        line: dict[str, Any] = {"label": label}
        for w in workers:
            row = by.get((label, w))
            line[str(w)] = (None if row is None
                            else f"{row['fraction']:.4f}" + ("" if row["equal"] else " *"))
        out.append(line)
    return format_table(out, [("label", "spec (exchange)"), *((str(w), f"W={w}") for w in workers)])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--all-workers", action="store_true", help="W = 2, 3, ..., 8")
    parser.add_argument("--tensors", type=int, default=4)
    parser.add_argument("--side", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="steps per run (>= 2)")
    parser.add_argument("--only", nargs="+", default=None, choices=sorted([*BASES, *SINGLE]),
                        help="compressors to run besides `none` (default: all)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per worker count")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--name", default="scaling_bytes_procs")
    args = parser.parse_args(argv)
    workers = list(range(2, 9)) if args.all_workers else args.workers
    if any(w < 2 for w in workers):
        parser.error(f"--workers must be >= 2, got {workers}")
    if args.steps < 2:
        parser.error(f"--steps must be >= 2, got {args.steps}")
    if args.tensors < 1 or args.side < 1:
        parser.error(f"--tensors and --side must be >= 1, got {args.tensors} and {args.side}")
    spec_list = specs(args.only)
    rows: list[dict[str, Any]] = []
    for w in workers:
        for row in measure(w, spec_list, args.tensors, args.side, args.steps, args.timeout):
            rows.append(row)
            print(f"W={w} {row['label']:24s} {row['fraction']:.4f} equal={row['equal']} "
                  f"{row['forms']}", flush=True)
    setting = (f"{args.tensors} tensors of {args.side}x{args.side}, {args.steps} steps, W real "
               "gloo processes on 127.0.0.1 against a simulated group of W; wire bytes per worker "
               "per step after the first (the largest over ranks) as a fraction of the fp32 payload")
    report = "\n".join([setting, "", table(rows, workers), "", *verdicts(rows)]) + "\n"
    print(report)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / f"{args.name}.json").write_text(json.dumps(
        {"setting": setting, "tensors": args.tensors, "side": args.side, "steps": args.steps,
         "workers": workers, "rows": rows, "verdicts": verdicts(rows)}, indent=1) + "\n")
    (args.results / f"{args.name}.md").write_text(report)
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
