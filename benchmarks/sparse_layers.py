"""Where a sparsifier's entries go: per tensor, the share of its entries that Top-k and the hard
threshold send, at the same density, in one of the claims grid's settings (BENCHMARKS.md
section 4).

Top-k sends the same fraction of every tensor; the hard threshold sends every entry of the whole
model whose magnitude (gradient plus residual) reaches one constant, so the tensors with the
largest entries take most of its budget. This script trains the setting's model with each
compressor for ``--epochs`` epochs (simulated workers, one process) and counts, per tensor and
step, the entries each worker sent, together with the tensor's relative compression error
``sqrt(sum ||e||^2 / sum ||x||^2)`` (``x``: gradient plus residual, ``e``: what stays unsent).

An entry counts as sent where the compressor left no residual for it and its input was not
zero: both compressors zero the residual of every entry they send, and an entry whose input is
zero is never sent by either (Top-k at these densities, the threshold because lambda > 0). A
tensor that a compressor reduced dense (its sparse message would cost more) counts as sent
whole.

Outputs: ``NAME.json`` (per compressor and tensor: numel, entries sent and offered, density,
share of all entries sent, compression error) and a table on stdout.

Usage::

    python -m benchmarks.sparse_layers --setting smoke --density 0.05          # seconds
    python -m benchmarks.sparse_layers --setting wikitext2-lstm --density 0.01 \\
        --text-data wikitext-2-partial.tar.gz --epochs 1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from gradzip.bench.table import format_table
from gradzip.compressors.base import Compressor, Job
from gradzip.spec import compressor_from_spec
from gradzip.train.loop import TrainLoop
from gradzip.train.runner import RunConfig, resolve_config
from gradzip.train.tasks import get_task

from ._claims_plan import SETTINGS
from .claims import data_options

HERE = Path(__file__).resolve().parent


class Tally:
    """Per tensor: entries sent and offered (summed over workers and steps), and the squared
    norms of the compressor's input and of what it left unsent."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[str, float]] = {}

    def add(self, jobs: Sequence[Job]) -> None:
        """Count one ``reduce`` call's jobs (after the compressor filled them)."""
        for job in jobs:
            row = self.rows.setdefault(job.name, {"numel": job.numel, "sent": 0,
                                                   "offered": 0, "error_sq": 0.0,
                                                   "input_sq": 0.0})
            x = job.tensor
            row["offered"] += x.numel()
            row["input_sq"] += float(x.double().square().sum())
            if job.decoded is x:  # reduced dense (dense_reduce): every entry sent
                row["sent"] += x.numel()
                continue
            e = job.leftover()
            row["sent"] += int(((e == 0) & (x != 0)).sum())
            row["error_sq"] += float(e.double().square().sum())


def counting(compressor: Compressor, tally: Tally) -> Compressor:
    """``compressor`` unchanged, except that every ``reduce`` also counts into ``tally``."""
    base = type(compressor)

    class Counting(base):  # type: ignore[misc, valid-type]
        def reduce(self, jobs: Sequence[Job], state: Any, comm: Any, ctx: Any) -> None:
            super().reduce(jobs, state, comm, ctx)
            tally.add(jobs)

    Counting.__name__ = Counting.__qualname__ = base.__name__
    fields = {f.name: getattr(compressor, f.name) for f in dataclasses.fields(compressor)}
    return Counting(**fields)


def measure(cfg: RunConfig) -> dict[str, Any]:
    """Train ``cfg`` (sim launcher) and return the per-tensor tally of its compressor."""
    task = get_task(cfg.task)
    loop = TrainLoop(cfg, task, task.load(cfg), rank=0, progress=False)
    tally = Tally()
    loop.setup(lambda c, _spe: counting(compressor_from_spec(c.compressor), tally))
    history, _stats, _seconds = loop.run(None)
    total_sent = sum(r["sent"] for r in tally.rows.values()) or 1
    tensors = []
    for name, r in tally.rows.items():
        tensors.append({
            "name": name, "numel": int(r["numel"]), "sent": int(r["sent"]),
            "offered": int(r["offered"]), "density": r["sent"] / r["offered"],
            "share_of_sent": r["sent"] / total_sent,
            "compression_error": (math.sqrt(r["error_sq"] / r["input_sq"])
                                  if r["input_sq"] > 0 else 0.0),
        })
    metric = task.metric
    return {"compressor": cfg.compressor, "epochs": cfg.epochs,
            "final": history[-1].get(metric) if history else None, "metric": metric,
            "density": sum(r["sent"] for r in tally.rows.values())
            / max(1, sum(r["offered"] for r in tally.rows.values())),
            "tensors": sorted(tensors, key=lambda t: -t["numel"])}


def table(results: list[dict[str, Any]]) -> str:
    """Markdown: one row per tensor, density and share of the entries sent per compressor."""
    columns = [("tensor", "tensor"), ("numel", "numel"), ("share", "share of entries")]
    for k, r in enumerate(results):
        columns += [(("density", k), f"{r['compressor']}: density"),
                    (("sent", k), "share of sent"), (("error", k), "error")]
    total = sum(t["numel"] for t in results[0]["tensors"])
    rows: list[dict[Any, Any]] = []
    for i, t in enumerate(results[0]["tensors"]):
        row: dict[Any, Any] = {"tensor": t["name"], "numel": f"{t['numel']:,}",
                               "share": f"{t['numel'] / total:.1%}"}
        for k, r in enumerate(results):
            u = r["tensors"][i]
            row.update({("density", k): f"{u['density']:.2%}",
                        ("sent", k): f"{u['share_of_sent']:.1%}",
                        ("error", k): f"{u['compression_error']:.2f}"})
        rows.append(row)
    last: dict[Any, Any] = {"tensor": "all", "numel": f"{total:,}", "share": "100%"}
    for k, r in enumerate(results):
        last.update({("density", k): f"{r['density']:.2%}", ("sent", k): "100%",
                     ("error", k): ""})
    return format_table([*rows, last], columns)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setting", default="smoke", help=f"one of {', '.join(SETTINGS)}")
    p.add_argument("--density", type=float, default=0.01,
                   help="Top-k ratio and threshold budget (default 0.01)")
    p.add_argument("--epochs", type=int, default=1, help="epochs of each run (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cifar-data", default=None, help="CIFAR-10 archive or tree")
    p.add_argument("--root", default="runs/claims",
                   help="where the claims grid keeps its data (decoded CIFAR-10 cache, "
                        "WikiText-2 layout); default runs/claims")
    p.add_argument("--text-data", default=None, help="wikitext-2-partial archive or folder")
    p.add_argument("--out", default=None,
                   help="JSON file (default results/sparse_layers-SETTING-DENSITY.json)")
    args = p.parse_args(argv)
    if args.setting not in SETTINGS:
        raise SystemExit(f"--setting must be one of {', '.join(SETTINGS)}, got {args.setting!r}")
    if not 0 < args.density <= 1:
        raise SystemExit(f"--density must be in (0, 1], got {args.density}")
    if args.epochs < 1:
        raise SystemExit(f"--epochs must be >= 1, got {args.epochs}")
    setting = SETTINGS[args.setting]
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as work:
        # Static compressors only: the setting's Accordion options (eta, its interval) act on
        # nothing here, and a run refuses options that act on nothing.
        base = {k: v for k, v in setting.base.items() if k not in ("eta", "interval_epochs")}
        options: dict[str, Any] = {**base, "epochs": args.epochs, "seed": args.seed,
                                   "out": str(Path(work) / "run"), "threads": 1}
        # The grid's own data layout (its decoded CIFAR-10 cache, WikiText-2 trained on
        # test.txt), under --root.
        options.update(data_options(setting, args, Path(args.root)))
        results = []
        for spec in (f"topk:ratio={args.density:g}", f"threshold:budget={args.density:g}"):
            cfg = resolve_config(RunConfig.from_dict({**options, "compressor": spec}))
            results.append(measure(cfg))
            print(f"{spec}: {results[-1]['metric']} {results[-1]['final']}, density "
                  f"{results[-1]['density']:.4f}", file=sys.stderr, flush=True)
    out = Path(args.out) if args.out else (
        HERE / "results" / f"sparse_layers-{args.setting}-{args.density:g}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"setting": args.setting, "density": args.density,
                               "epochs": args.epochs, "seed": args.seed, "runs": results},
                              indent=1) + "\n", encoding="utf-8")
    print(table(results))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
