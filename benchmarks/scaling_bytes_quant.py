"""Wire bytes per worker and step of the quantisers as the number of workers grows.

Every configuration reduces one step of a model of ``--tensors`` tensors of ``--side`` x
``--side`` entries in a simulated group of ``W`` workers (one process) and reads the engine's
byte meter: wire bytes one worker sends in the step (the call header included), over the fp32
payload of the model (``4 * entries``). The quantisers run twice: with ``exchange=allgather``
(every worker's message all-gathered, the form before the sharded exchange existed) and with
``exchange=auto`` (the sharded exchange, the all-gather or dense, per tensor, whichever the byte
formulas say is cheapest). ``none`` (an fp32 ring all-reduce) is the yardstick.

Targets, for every quantiser with ``auto``: the fraction at the largest ``W`` within
``MAX_GROWTH`` times the fraction at ``W = 8``, and never above ``none``'s at the same ``W``.

Outputs: ``NAME.json`` (one row per spec and ``W``: wire and payload bytes per worker, the
fraction, the exchange forms per tensor) and ``NAME.md`` (the table and the verdicts).

Usage::

    python -m benchmarks.scaling_bytes_quant                       # W = 2 8 32 128 512
    python -m benchmarks.scaling_bytes_quant --workers 2 8 --side 64   # seconds
"""

from __future__ import annotations

import argparse
import gc
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import gradzip
from gradzip.bench.table import format_table

from ._common import RESULTS

#: The fraction at the largest W over the fraction at W = 8, at most.
MAX_GROWTH = 1.5
QUANTISERS = ["qsgd", "sign", "binmean", "binmean:bits=2", "scatterq"]


def specs(quantisers: Sequence[str]) -> list[tuple[str, str, str]]:
    """``(label, spec, exchange)`` of every configuration, ``none`` first."""
    out = [("none", "none", "ring")]
    for name in quantisers:
        if name == "scatterq":  # always sharded: its own rule
            out.append((name, name, "sharded"))
            continue
        joiner = "," if ":" in name else ":"
        for exchange in ("allgather", "auto"):
            out.append((f"{name} ({exchange})", f"{name}{joiner}exchange={exchange}", exchange))
    return out


def measure(spec: str, workers: int, tensors: int, side: int, seed: int = 0) -> dict[str, Any]:
    """Wire and payload bytes per worker of one step of ``spec`` among ``workers``."""
    shapes = {f"t{i}": torch.Size([side, side]) for i in range(tensors)}
    engine = gradzip.Engine(shapes, spec, collective=gradzip.SimulatedGroup(workers))
    gen = torch.Generator().manual_seed(seed)
    engine.reduce({n: torch.randn(workers, *s, generator=gen) for n, s in shapes.items()})
    fp32 = 4 * tensors * side * side
    stats = engine.stats
    report = engine.compressor.report(engine.compressor_state)
    return {"spec": spec, "workers": workers, "wire_bytes": stats["wire_bytes"][0],
            "payload_bytes": stats["payload_bytes"][0], "fp32_bytes": fp32,
            "fraction": stats["wire_bytes"][0] / fp32, "exchange": report.get("exchange")}


def verdicts(rows: Sequence[dict[str, Any]], largest: int) -> list[str]:
    """One line per ``auto`` quantiser: met or missed, with the numbers."""
    by = {(r["label"], r["workers"]): r["fraction"] for r in rows}
    lines = []
    for label in sorted({r["label"] for r in rows}):
        if "allgather" in label or label == "none" or (label, 8) not in by:
            continue
        top, eight, ring = by[(label, largest)], by[(label, 8)], by[("none", largest)]
        growth = top / eight
        ok = growth <= MAX_GROWTH and top <= ring
        lines.append(f"- {label}: W={largest} {top:.3f} vs W=8 {eight:.3f} ({growth:.2f}x, "
                     f"target <= {MAX_GROWTH}x), dense ring {ring:.3f}: "
                     f"{'met' if ok else 'missed'}")
    return lines


def table(rows: Sequence[dict[str, Any]], workers: Sequence[int]) -> str:
    """Fraction of the fp32 payload per spec (rows) and W (columns)."""
    labels = list(dict.fromkeys(r["label"] for r in rows))
    by = {(r["label"], r["workers"]): r for r in rows}
    out = []
    for label in labels:
        line: dict[str, Any] = {"label": label}
        for w in workers:
            row = by.get((label, w))
            line[str(w)] = None if row is None else f"{row['fraction']:.3f}"
        out.append(line)
    return format_table(out, [("label", "spec"), *((str(w), f"W={w}") for w in workers)])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 8, 32, 128, 512])
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--side", type=int, default=256)
    parser.add_argument("--quantisers", nargs="+", default=QUANTISERS)
    parser.add_argument("--out", type=Path, default=RESULTS / "scaling_bytes_quant")
    args = parser.parse_args(argv)
    if any(w < 1 for w in args.workers) or args.tensors < 1 or args.side < 1:
        parser.error("`--workers`, `--tensors` and `--side` must be >= 1")
    rows = []
    for workers in args.workers:
        for label, spec, exchange in specs(args.quantisers):
            row = measure(spec, workers, args.tensors, args.side)
            rows.append({"label": label, "exchange_asked": exchange, **row})
            print(f"W={workers:4d} {label:22s} {row['fraction']:.4f} {row['exchange']}", flush=True)
            gc.collect()
    text = table(rows, args.workers)
    lines = verdicts(rows, max(args.workers)) if 8 in args.workers else []
    setting = (f"{args.tensors} tensors of {args.side}x{args.side}, one step, simulated group; "
               "wire bytes per worker as a fraction of the fp32 payload")
    report = "\n".join([setting, "", text, "", *lines]) + "\n"
    print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(
        {"setting": setting, "tensors": args.tensors, "side": args.side, "rows": rows,
         "verdicts": lines}, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
