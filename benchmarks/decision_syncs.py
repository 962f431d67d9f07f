"""Host reads per step of an adaptive compressor behind the DDP hook, decision steps included.

    python -m benchmarks.decision_syncs [--out DIR] [--steps N] [--buckets B] [--lr-decay F]
                                        [--only SCHEME ...]

``op_counts.py`` counts the ops and host syncs of a few steady steps; a controller's decision
steps fall between them. This script takes every step of a short run: the ResNet-18 of
``op_counts.py`` (CIFAR variant, 62 tensors, DDP in ``--buckets`` buckets, one gloo process,
the hook inline on the decision path CUDA tensors take, as ``op_counts.py`` sets it up) and
counts, per step, the host reads a CUDA run would make:

* the profiler's syncing ops (:data:`op_counts.HOST_SYNC_OPS`: a scalar read, ``nonzero``...);
* calls of ``Tensor.tolist()``, which sync on CUDA but show no op on the CPU (the controller's
  norms are read so).

With ``--lr-decay F`` the hook is given the optimizer, whose learning rate is multiplied by
``F`` before every step: a smooth schedule, which Accordion records every step (and tests for
a drop). The target (host syncs per step): at most one per decision step for Accordion, none in its
other steps; the first step (whose residuals and window sums are made on the host) is shown
but not judged. Results: ``decision_syncs.json`` and ``decision_syncs.md`` in ``--out``
(default ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

import gradzip
from benchmarks import op_counts
from gradzip.control import Accordion
from gradzip.ops.branches import device_forms

RESULTS = Path(__file__).resolve().parent / "results"
#: Schemes of ``op_counts.SCHEMES`` whose decisions are counted.
SCHEMES = [f"gradzip:{op_counts.ACCORDION}", f"gradzip-fused:{op_counts.ACCORDION}"]


@contextmanager
def counting_tolist() -> Iterator[list[int]]:
    """``Tensor.tolist`` counted while inside (``box[0]``, reset by the caller)."""
    box = [0]
    original = torch.Tensor.tolist

    def counted(self: torch.Tensor) -> Any:
        box[0] += 1
        return original(self)

    torch.Tensor.tolist = counted  # type: ignore[method-assign]
    try:
        yield box
    finally:
        torch.Tensor.tolist = original  # type: ignore[method-assign]


def count_steps(scheme: str, steps: int, buckets: int,
                lr_decay: float | None = None) -> list[dict[str, Any]]:
    """Per step of ``scheme``: host syncs seen by the profiler, ``tolist`` reads, and whether
    a decision was taken in it; with ``lr_decay``, the optimizer (given to the hook) has its
    learning rate multiplied by it before every step (a smooth schedule, no drop)."""
    model_fn, input_fn = op_counts.MODELS["resnet18"]
    torch.manual_seed(0)
    inputs = input_fn()
    cap_mb = op_counts._bucket_cap_mb(model_fn, inputs, buckets)
    kind, spec = op_counts.SCHEMES[scheme]
    torch.manual_seed(0)
    model = model_fn()
    trained = DistributedDataParallel(model, bucket_cap_mb=cap_mb)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    engine = op_counts.register_hook(trained, kind, spec,
                                     optimizer=opt if lr_decay is not None else None).engine
    rows = []
    with device_forms(), counting_tolist() as lists:
        for step in range(steps):
            decided = Accordion.counts(engine)["decisions"]
            if lr_decay is not None:
                opt.param_groups[0]["lr"] *= lr_decay
            lists[0] = 0
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                opt.zero_grad(set_to_none=False)
                trained(inputs).float().pow(2).mean().backward()
                opt.step()
            syncs = sum(1 for ev in prof.events() if ev.name in op_counts.HOST_SYNC_OPS)
            reads = lists[0]
            rows.append({"step": step, "profiler_syncs": syncs, "tolist_reads": reads,
                         "host_syncs": syncs + reads,
                         "decision": Accordion.counts(engine)["decisions"] > decided})
    return rows


def verdicts(per_scheme: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Most host syncs in a decision step (<= 1) and in any other step after the first (0)."""
    out = []
    for scheme, rows in per_scheme.items():
        later = rows[1:]
        decisions = [r["host_syncs"] for r in later if r["decision"]]
        others = [r["host_syncs"] for r in later if not r["decision"]]
        if decisions:
            out.append({"target": f"{scheme}: host syncs in a decision step <= 1",
                        "value": max(decisions), "met": max(decisions) <= 1})
        if others:
            out.append({"target": f"{scheme}: host syncs in other steps == 0",
                        "value": max(others), "met": max(others) == 0})
    return out


def table(per_scheme: dict[str, list[dict[str, Any]]]) -> str:
    lines = ["| scheme | steps | decision steps | host syncs in the first step | "
             "in each decision step | in each other step |", "|---|---:|---:|---:|---|---|"]
    for scheme, rows in per_scheme.items():
        later = rows[1:]
        dec = sorted({r["host_syncs"] for r in later if r["decision"]})
        other = sorted({r["host_syncs"] for r in later if not r["decision"]})
        lines.append(f"| `{scheme}` | {len(rows)} | {sum(r['decision'] for r in later)} | "
                     f"{rows[0]['host_syncs']} | {', '.join(map(str, dec)) or '-'} | "
                     f"{', '.join(map(str, other)) or '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None, log: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--buckets", type=int, default=4)
    parser.add_argument("--lr-decay", type=float, default=None, metavar="FACTOR",
                        help="give the hook the optimizer and multiply its learning rate by "
                             "FACTOR (0.9 < FACTOR < 1: no drop) before every step")
    parser.add_argument("--only", action="append", default=None, metavar="SCHEME",
                        help=f"count only these schemes (repeatable): {', '.join(SCHEMES)}")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.buckets < 1:
        parser.error(f"--steps must be >= 2 and --buckets >= 1, got {args.steps} and "
                     f"{args.buckets}")
    if args.lr_decay is not None and not 0.9 < args.lr_decay < 1:
        parser.error(f"--lr-decay must be in (0.9, 1), got {args.lr_decay}")
    for name in args.only or []:
        if name not in SCHEMES:
            parser.error(f"--only must be one of {SCHEMES}, got {name!r}")
    op_counts._init_group()
    per_scheme = {s: count_steps(s, args.steps, args.buckets, args.lr_decay)
                  for s in args.only or SCHEMES}
    found = verdicts(per_scheme)
    meta = {"torch": torch.__version__, "gradzip": gradzip.__version__, "steps": args.steps,
            "lr_decay": args.lr_decay,
            "buckets": args.buckets, "model": "resnet18 (CIFAR)", "command": " ".join(sys.argv)}
    args.out.mkdir(parents=True, exist_ok=True)
    name = "decision_syncs" if args.lr_decay is None else "decision_syncs_lr"
    (args.out / f"{name}.json").write_text(json.dumps(
        {"meta": meta, "steps": per_scheme, "verdicts": found}, indent=1) + "\n")
    text = table(per_scheme) + "\n\n" + op_counts.verdict_table(found) + "\n"
    (args.out / f"{name}.md").write_text(text)
    log(text)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    raise SystemExit(main())
