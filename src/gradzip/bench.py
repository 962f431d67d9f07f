"""``gradzip bench``: the kernel and DDP-hook benchmarks.

Usage::

    gradzip bench micro [--json] [--numel N ...] [--repeat R] [--threads T] [--heap warm|default]
                        [--compressors SPEC ...]
    gradzip bench hooks [--json] [--workers 2 4] [--steps N] [--rounds R] [--configs CFG ...]

``micro`` times compression and decoding of every compressor on one tensor (see
:mod:`gradzip.benchmarks_impl.micro` for exactly what is timed); ``hooks`` times DDP training
steps in gloo processes on this machine (:mod:`gradzip.benchmarks_impl.hooks`). Without
``--json`` each prints a Markdown table and a verdict for every target; with ``--json`` one JSON
object per row, one row per line, as soon as it is measured.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

import torch

from gradzip.benchmarks_impl.common import HEAP_MODES, environment, format_table
from gradzip.benchmarks_impl.hooks import HOOK_CONFIGS, HookRow, run_hooks
from gradzip.benchmarks_impl.micro import DEFAULT_NUMELS, MICRO_SPECS, MicroRow, run_micro

__all__ = ["HookRow", "MicroRow", "hook_verdicts", "main", "micro_verdicts"]

log = logging.getLogger(__name__)

#: Targets: threshold compress / clone, torch.topk / TopK compress, built-in / PowerSGD compress,
#: gradzip none / no hook, gradzip PowerSGD / built-in PowerSGD (per step).
THRESHOLD_MAX_OVER_CLONE = 2.0
TOPK_MIN_SPEEDUP = 3.0
POWERSGD_MIN_SPEEDUP = 1.0
NONE_MAX_OVERHEAD = 1.05
POWERSGD_MAX_OVER_BUILTIN = 1.0
#: The kernel targets are stated for tensors of 1M entries and more.
TARGET_MIN_NUMEL = 1_000_000

_MICRO_COLUMNS = (
    ("compressor", "compressor"), ("numel", "numel"), ("layout", "layout"),
    ("compress_ms", "compress ms"), ("decode_ms", "decode ms"), ("clone_ms", "clone ms"),
    ("compress_over_clone", "compress/clone"), ("baseline_ms", "baseline ms"),
    ("baseline_over_compress", "baseline/compress"), ("select_ms", "select op ms"),
    ("baseline_decode_ms", "baseline decode ms"), ("density", "density"),
)
_HOOK_COLUMNS = (
    ("workers", "workers"), ("config", "configuration"), ("ms_per_step", "ms/step"),
    ("ratio_to_nohook", "vs no hook"), ("cpu_ms_per_step", "CPU ms/step"),
    ("cpu_ratio_to_nohook", "CPU vs no hook"),
)


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1e3


def micro_verdicts(rows: Sequence[MicroRow]) -> list[str]:
    """One line per kernel target and size (from 1M entries): met or missed, with the ratio."""
    lines = []
    for row in rows:
        if row.numel < TARGET_MIN_NUMEL:
            continue
        d = row.as_dict()
        if row.compressor.startswith("threshold"):
            ratio = d["compress_over_clone"]
            ok = ratio <= THRESHOLD_MAX_OVER_CLONE
            lines.append(f"threshold compress <= {THRESHOLD_MAX_OVER_CLONE:g}x clone at "
                         f"{row.numel}: {'met' if ok else 'MISSED'} ({ratio:.2f}x)")
        elif row.compressor.startswith("topk") and d["baseline_over_compress"] is not None:
            ratio = d["baseline_over_compress"]
            ok = ratio >= TOPK_MIN_SPEEDUP
            sel = row.baseline_seconds / row.select_seconds if row.select_seconds else None
            extra = f"; select op alone {sel:.2f}x" if sel is not None else ""
            lines.append(f"topk compress >= {TOPK_MIN_SPEEDUP:g}x faster than torch.topk at "
                         f"{row.numel}: {'met' if ok else 'MISSED'} ({ratio:.2f}x{extra})")
        elif row.compressor.startswith("powersgd") and d["baseline_over_compress"] is not None:
            ratio = d["baseline_over_compress"]
            ok = ratio >= POWERSGD_MIN_SPEEDUP
            lines.append(f"powersgd compress no slower than the built-in's math at {row.numel}: "
                         f"{'met' if ok else 'MISSED'} (built-in / gradzip = {ratio:.2f})")
    return lines


def hook_verdicts(rows: Sequence[HookRow]) -> list[str]:
    """One line per DDP target and world size: met or missed, with the measured ratio."""
    lines = []
    by_key = {(r.workers, r.config): r for r in rows}
    for world in sorted({r.workers for r in rows}):
        none = by_key.get((world, "gradzip:none"))
        if none is not None and none.ratio_to_nohook is not None:
            ok = none.ratio_to_nohook <= NONE_MAX_OVERHEAD
            lines.append(f"gradzip none within 5% of no hook, {world} workers: "
                         f"{'met' if ok else 'MISSED'} ({none.ratio_to_nohook:.3f}x; CPU time "
                         f"{none.cpu_ratio_to_nohook:.3f}x)")
        ours = next((r for (w, c), r in by_key.items()
                     if w == world and c.startswith("gradzip:powersgd")), None)
        theirs = next((r for (w, c), r in by_key.items()
                       if w == world and c.startswith("builtin-powersgd")), None)
        if ours is not None and theirs is not None and ours.ratio_to_nohook and theirs.ratio_to_nohook:
            ratio = ours.ratio_to_nohook / theirs.ratio_to_nohook
            cpu = (ours.cpu_ratio_to_nohook or 0) / (theirs.cpu_ratio_to_nohook or 1)
            ok = ratio <= POWERSGD_MAX_OVER_BUILTIN
            lines.append(f"gradzip powersgd no slower than the built-in hook, {world} workers: "
                         f"{'met' if ok else 'MISSED'} (gradzip / built-in = {ratio:.3f}; "
                         f"CPU time {cpu:.3f})")
    return lines


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gradzip bench", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="which", required=True)
    micro = sub.add_parser("micro", help="kernel timings in one process")
    micro.add_argument("--json", action="store_true", help="one JSON object per row")
    micro.add_argument("--numel", type=int, nargs="+", default=list(DEFAULT_NUMELS))
    micro.add_argument("--repeat", type=int, default=5, help="timed repetitions (median)")
    micro.add_argument("--threads", type=int, default=None,
                       help="torch threads (default: as many as cores)")
    micro.add_argument("--workers", type=int, default=4, help="messages decoded and averaged")
    micro.add_argument("--compressors", nargs="+", default=list(MICRO_SPECS), metavar="SPEC")
    micro.add_argument("--heap", choices=HEAP_MODES, default="warm",
                       help="freed memory is reused (warm), or buffers of 32 MiB and more are "
                            "fresh pages as with glibc's defaults (default)")
    hooks = sub.add_parser("hooks", help="DDP step time per hook over gloo")
    hooks.add_argument("--json", action="store_true", help="one JSON object per row")
    hooks.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    hooks.add_argument("--steps", type=int, default=10, help="steps per configuration per round")
    hooks.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median)")
    hooks.add_argument("--warmup", type=int, default=3)
    hooks.add_argument("--batch", type=int, default=32, help="samples per worker")
    hooks.add_argument("--model", default="resnet8")
    hooks.add_argument("--width", type=int, default=16)
    hooks.add_argument("--threads", type=int, default=None,
                       help="torch threads per process (default: cores / workers)")
    hooks.add_argument("--timeout", type=float, default=1800.0)
    hooks.add_argument("--configs", nargs="+", default=list(HOOK_CONFIGS), metavar="CFG")
    return parser


def _emit_json(row: Any) -> None:
    print(json.dumps(row.as_dict()), flush=True)


def _run_micro(args: argparse.Namespace) -> None:
    threads = args.threads if args.threads is not None else torch.get_num_threads()
    env = environment(threads)
    rows = run_micro(args.numel, args.compressors, repeat=args.repeat, workers=args.workers,
                     threads=threads, heap=args.heap, on_row=_emit_json if args.json else None)
    if args.json:
        return
    table = []
    for row in rows:
        d = row.as_dict()
        for key in ("compress", "decode", "clone", "baseline", "select", "baseline_decode"):
            d[f"{key}_ms"] = _ms(d[f"{key}_seconds"])
        table.append(d)
    print(f"<!-- torch {env['torch']}, {env['threads']} threads, {env['cpus']} cpus, "
          f"load average {env['load_average']}, {args.workers} workers, "
          f"median of {args.repeat}, heap {rows[0].heap if rows else args.heap} -->")
    print(format_table(table, _MICRO_COLUMNS))
    print()
    for line in micro_verdicts(rows):
        print(f"- {line}")


def _run_hooks(args: argparse.Namespace) -> None:
    env = environment(args.threads or 0)
    rows = run_hooks(args.workers, args.configs, model=args.model, width=args.width,
                     batch=args.batch, steps=args.steps, rounds=args.rounds, warmup=args.warmup,
                     threads=args.threads, timeout=args.timeout,
                     on_row=_emit_json if args.json else None)
    if args.json:
        return
    table = [dict(r.as_dict(), ms_per_step=r.seconds_per_step * 1e3,
                  cpu_ms_per_step=r.cpu_seconds_per_step * 1e3) for r in rows]
    first = rows[0]
    print(f"<!-- torch {env['torch']}, {env['cpus']} cpus, load average {env['load_average']}, "
          f"{first.model} ({first.parameters} parameters), batch {first.batch_per_worker}/worker, "
          f"threads/worker {sorted({r.threads_per_worker for r in rows})}, "
          f"{first.steps_per_round} steps x {first.rounds} rounds -->")
    print(format_table(table, _HOOK_COLUMNS))
    print()
    for line in hook_verdicts(rows):
        print(f"- {line}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``gradzip bench`` with ``argv`` (the arguments after ``bench``).

    Args:
        argv: e.g. ``["micro", "--json", "--numel", "1000000"]``; ``None`` reads ``sys.argv``.

    Returns:
        The exit status (0 on success, 2 on invalid arguments).
    """
    args = _parser().parse_args(list(argv) if argv is not None else sys.argv[1:])
    try:
        if args.which == "micro":
            _run_micro(args)
        else:
            _run_hooks(args)
    except (TypeError, ValueError) as err:
        print(f"gradzip bench: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
