"""``gradzip plan``: the cost model on the command line (a table and one line naming the choice)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from gradzip.plan.candidates import QUALITIES, Candidate, default_candidates
from gradzip.plan.model import Setting
from gradzip.plan.planner import Plan, parse_count, plan
from gradzip.plan.step_cost import outer_step_cost
from gradzip.plan.timing import ENV_VAR, TimingCache, timing_key
from gradzip.plan.traffic import count_layout

__all__ = ["EPILOG", "add_parser", "model_shapes", "run"]

EPILOG = f"""\
Predicts, for each candidate (none, fp16/bf16, PowerSGD ranks 1-8, Top-k, the hard threshold,
QSGD, sign, and outer-step DiLoCo at H = 10, 30, 100 with an fp32 or 8-bit exchange), the wire
bytes and collective calls per step, the link time (alpha-beta: one round trip per ring hop, as
gloo waits for the receiver before each send, plus bytes at the bandwidth), the compression time and the step time, then names its choice. Bytes come
from running each compressor once in the simulator on the model's shapes. Compression times
are measured once on this machine and cached (${ENV_VAR} or --timings names the file).

examples:
  gradzip plan --params 25M --workers 8 --bandwidth-mbit 20 --rtt-ms 50 --step-ms 80
  gradzip plan --model resnet18 --workers 4 --bandwidth-mbit 1000 --step-ms 120 --json
  gradzip plan --params 3.9M --workers 2 --bandwidth-mbit 150 --step-ms 90 \\
      --quality lossless,gentle          # never aggressive compression nor outer steps
"""

#: DDP's default bucket size, MiB.
DDP_BUCKET_MB = 25.0


def add_parser(sub: Any) -> None:
    """Add the ``plan`` subcommand to ``sub`` (an argparse subparsers object)."""
    p = sub.add_parser("plan", help="predict each compressor's step time and choose one",
                       description="The cost model: bytes, calls, link and step time per "
                                   "candidate, and a choice.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", metavar="COUNT",
                      help="parameter count, e.g. 25M, 1.2G, 900000 (laid out as 512x512 "
                           "matrices)")
    what.add_argument("--model", metavar="NAME",
                      help="a model of the runner (gradzip list), e.g. resnet18 or "
                           "transformer:dim=64,layers=2")
    p.add_argument("--classes", type=int, default=10,
                   help="the model's classes (its vocabulary for lstm/transformer; default 10)")
    p.add_argument("--workers", type=int, required=True, help="data-parallel workers W (>= 2)")
    p.add_argument("--bandwidth-mbit", type=float, required=True,
                   help="each worker's link, Mbit/s each way")
    p.add_argument("--rtt-ms", type=float, default=0.0, help="round-trip time, ms (default 0)")
    p.add_argument("--step-ms", type=float, required=True,
                   help="compute time of one step without communication, ms")
    p.add_argument("--bucket-cap-mb", type=float, default=DDP_BUCKET_MB,
                   help="DDP's bucket size, MiB (default 25): sets the number of buckets")
    p.add_argument("--sync", action="store_true",
                   help="no overlap of communication with the backward pass")
    p.add_argument("--quality", default=",".join(QUALITIES),
                   help="quality classes allowed, comma-separated, among "
                        f"{', '.join(QUALITIES)} (default: all)")
    p.add_argument("--margin", type=float, default=0.05,
                   help="how much faster a more lossy class must be to be chosen (0.05)")
    p.add_argument("--timings", metavar="FILE", default=None,
                   help=f"the compression-time cache (default ${ENV_VAR} or "
                        "~/.cache/gradzip/plan-timings.json)")
    p.add_argument("--no-measure", action="store_true",
                   help="do not measure missing compression times (they count as 0)")
    p.add_argument("--json", action="store_true", help="print JSON")


def model_shapes(spec: str, classes: int) -> dict[str, tuple[int, ...]]:
    """The parameter shapes of a runner model (``resnet18``, ``transformer:dim=64``)."""
    from gradzip.train.tasks.base import new_model

    model = new_model(spec, classes, seed=0)
    return {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}


def _qualities(text: str) -> tuple[str, ...]:
    items = tuple(q.strip() for q in text.split(",") if q.strip())
    bad = [q for q in items if q not in QUALITIES]
    if bad or not items:
        raise ValueError(f"`--quality` must be a comma-separated list among "
                         f"{', '.join(QUALITIES)}, got {text!r}")
    return items


def build_plan(args: argparse.Namespace) -> Plan:
    """The plan of a parsed command line.

    Raises:
        TypeError, ValueError: an invalid option, naming it.
    """
    if args.model is not None:
        shapes, count = model_shapes(args.model, args.classes), None
        total = sum(math.prod(s) for s in shapes.values())
    else:
        shapes, count = None, parse_count(args.params)
        total = count
    if not (args.bucket_cap_mb > 0 and math.isfinite(args.bucket_cap_mb)):
        raise ValueError(f"`--bucket-cap-mb` must be > 0, got {args.bucket_cap_mb!r}")
    buckets = max(1, math.ceil(4 * total / (args.bucket_cap_mb * 2**20)))
    setting = Setting(workers=args.workers, bandwidth_mbit=args.bandwidth_mbit,
                      rtt_ms=args.rtt_ms, step_ms=args.step_ms, buckets=buckets,
                      overlap=not args.sync)
    qualities = _qualities(args.quality)
    cache = TimingCache(args.timings)
    layout = shapes if shapes is not None else count_layout(count)  # type: ignore[arg-type]
    missing = {c.spec for c in default_candidates() if cache.get(timing_key(c.spec, layout)) is None}
    if missing and not args.no_measure:
        print(f"gradzip plan: measuring the compression time of {len(missing)} compressor(s) "
              f"on this machine, once (cached in {cache.path})", file=sys.stderr, flush=True)
    return plan(setting, shapes=shapes, params=count, qualities=qualities, margin=args.margin,
                timings=cache, measure=not args.no_measure)


def table(result: Plan) -> str:
    """The plan as a text table, the considered classes and one line naming the choice."""
    s = result.setting
    none = next((p for p in result.predictions if p.candidate.name == "none"), None)
    head = ("candidate", "quality", "spec", "H (outer lr, momentum)", "kB/step", "calls/step", "link ms/exch",
            "exposed ms", "compress ms", "step ms", "step cost", "vs none")
    rows = []
    for p in result.predictions:
        c = p.candidate
        mark = "* " if p is result.choice else "  "
        speed = f"{none.step_ms / p.step_ms:.2f}x" if none is not None else "-"
        rows.append((mark + c.name, c.quality, c.spec, _outer_cell(c),
                     f"{p.wire_bytes_per_step / 1e3:,.1f}", f"{p.calls_per_step:.3g}",
                     f"{p.comm_ms:.1f}", f"{p.exposed_comm_ms:.1f}",
                     "-" if p.compress_ms is None else f"{p.compress_ms:.1f}",
                     f"{p.step_ms:.1f}",
                     f"x{outer_step_cost(c.outer_steps):.2f}" if c.outer_steps else "-", speed))
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = [f"{result.params:,} parameters, {s.workers} workers, {s.bandwidth_mbit:g} Mbit/s, "
             f"rtt {s.rtt_ms:g} ms, compute {s.step_ms:g} ms/step, {s.buckets} bucket(s), "
             f"overlap {'on' if s.overlap and s.buckets > 1 else 'off'}"]
    for r in [head, *rows]:
        lines.append("  ".join(v.ljust(w) if i < 3 else v.rjust(w)
                               for i, (v, w) in enumerate(zip(r, widths, strict=True))))
    if any(p.candidate.outer_steps for p in result.predictions):
        lines.append("step cost: inner steps an outer candidate needs for what H=10 does in one "
                     "(measured); outer candidates are compared at step ms times it")
    if any(p.compress_ms is None for p in result.predictions):
        lines.append("compress ms '-': not measured, counted as 0")
    lines.append(f"considered: {', '.join(result.considered)}")
    lines.append(f"choice: {result.reason}")
    return "\n".join(lines)


def _outer_cell(c: Candidate) -> str:
    """``"30 (0.7, 0.9)"`` for an outer-step candidate (its H and Nesterov settings), else ``-``."""
    if not c.outer_steps:
        return "-"
    return f"{c.outer_steps} ({c.outer_lr:g}, {c.outer_momentum:g})"


def run(args: argparse.Namespace) -> int:
    """Run ``gradzip plan``; returns the exit status."""
    result = build_plan(args)
    print(json.dumps(result.as_dict(), indent=1) if args.json else table(result))
    return 0
