"""Collectives per step of a two-level controller whose levels share one exchange.

    python -m benchmarks.level_calls [--out DIR] [--workers 4] [--width 8] [--steps 60]
                                     [--spec SPEC] [--name level_calls]

Accordion (and a level schedule) reduces each call's tensors at their level. Where both levels
are PowerSGD differing only in rank, or PowerSGD and ``none``, a call holding tensors at both
levels exchanges them together (``gradzip.compressors.powersgd.reduce_together``): two
all-reduces, where the levels apart took two each (one for ``none``, or for a level whose
tensors all travel dense). This runs the same training signal through the simulator twice, with the
joint exchange and with it switched off, and reports collective calls and bytes per step, the
share of calls that held both levels, and whether the two runs' averages agree bit for bit.

Model: the ResNet-18 of ``host_time.py`` (62 tensors) at ``--width``, one call per step (the
whole model), random gradients whose scale jumps every third step (so that per-layer decisions
differ). Results: ``NAME.json`` and ``NAME.md`` in ``--out`` (default
``benchmarks/results/``; ``--name`` default ``level_calls``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

import gradzip
from benchmarks.host_time import _model_fn
from gradzip.compressors.powersgd import PowerSGD

RESULTS = Path(__file__).resolve().parent / "results"
SPEC = "accordion(steady=powersgd:rank=1,critical=powersgd:rank=4,eta=0.5,interval=10)"


def run(shapes: dict[str, torch.Size], workers: int, steps: int, joint: bool,
        spec: str = SPEC) -> dict[str, Any]:
    """``steps`` simulated steps of ``spec``; the joint exchange on or off."""
    calls = {"both": 0, "all": 0}
    original = PowerSGD.shares_exchange
    levels = gradzip.Accordion._run_levels

    def counted(self: Any, jobs: Any, state: Any, comm: Any, ctx: Any) -> None:
        level = state["controller"]["level"]
        kinds = {level[j.name] == "steady" for j in jobs}
        calls["all"] += 1
        calls["both"] += int(len(kinds) == 2)
        levels(self, jobs, state, comm, ctx)

    gradzip.Accordion._run_levels = counted  # type: ignore[method-assign]
    if not joint:
        PowerSGD.shares_exchange = lambda self, other: False  # type: ignore[method-assign]
    try:
        engine = gradzip.Engine(shapes, spec, collective=gradzip.SimulatedGroup(workers))
        g = torch.Generator().manual_seed(0)
        outs = []
        for step in range(steps):
            scale = 1 + 3 * (step % 3 == 0)
            outs.append(engine.reduce({n: torch.randn(workers, *s, generator=g) * scale
                                       for n, s in shapes.items()}))
    finally:
        PowerSGD.shares_exchange = original  # type: ignore[method-assign]
        gradzip.Accordion._run_levels = levels  # type: ignore[method-assign]
    stats = engine.stats
    return {"collective_calls_per_step": stats["collective_calls"] / steps,
            "wire_bytes_per_step": stats["wire_bytes"][0] / steps,
            "payload_bytes_per_step": stats["payload_bytes"][0] / steps,
            "calls_with_both_levels": calls["both"], "calls": calls["all"], "outs": outs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--spec", default=SPEC, help="an Accordion spec (default: %(default)s)")
    p.add_argument("--name", default="level_calls", help="the result files' name")
    args = p.parse_args(argv)
    if args.workers < 1 or args.width < 1 or args.steps < 1:
        p.error(f"--workers, --width and --steps must be >= 1, got {args.workers}, "
                f"{args.width}, {args.steps}")
    torch.set_num_threads(1)
    shapes = {n: p.shape for n, p in _model_fn(args.width)().named_parameters()}
    try:
        spec = gradzip.compressor_from_spec(args.spec)
    except (TypeError, ValueError) as exc:
        p.error(f"--spec: {exc}")
    if not isinstance(spec, gradzip.Accordion):
        p.error(f"--spec must be an Accordion spec, got {args.spec!r}")
    joint = run(shapes, args.workers, args.steps, joint=True, spec=args.spec)
    apart = run(shapes, args.workers, args.steps, joint=False, spec=args.spec)
    same = all(torch.equal(a[n], b[n]) for a, b in zip(joint.pop("outs"), apart.pop("outs"),
                                                         strict=True) for n in shapes)
    result = {"spec": args.spec, "workers": args.workers, "width": args.width, "steps": args.steps,
              "joint": joint, "apart": apart, "same_bits": same}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"`{args.spec}`, {args.workers} simulated workers, ResNet-18 width {args.width}, "
             f"{args.steps} steps of one call; calls with tensors at both levels: "
             f"{joint['calls_with_both_levels']} of {joint['calls']}; averages the same bit for "
             f"bit: {'yes' if same else 'NO'}", "",
             "| levels exchanged | collective calls / step | payload bytes / step | wire bytes / step |",
             "|---|---:|---:|---:|"]
    for name, row in (("together", joint), ("apart", apart)):
        lines.append(f"| {name} | {row['collective_calls_per_step']:.2f} | "
                     f"{row['payload_bytes_per_step']:,.0f} | {row['wire_bytes_per_step']:,.0f} |")
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
