"""``gradzip bench``: time the kernels and the DDP hooks on this machine.

Usage::

    gradzip bench micro [--json] [--numel N ...] [--repeat R] [--threads T] [--heap warm|default]
                        [--compressors SPEC ...]
    gradzip bench hooks [--json] [--workers 2 4] [--steps N] [--rounds R] [--configs CFG ...]

``micro`` times compression and decoding of every compressor on one tensor (see
:mod:`gradzip.bench.micro` for exactly what is timed); ``hooks`` times DDP training steps in
gloo processes on this machine (:mod:`gradzip.bench.hooks`). Without ``--json`` each prints a
Markdown table; with ``--json`` one JSON object per row, one row per line, as soon as it is
measured. The figures are this machine's: the project's own targets, and whether a run meets
them, are the business of the scripts under ``benchmarks/`` (see BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gradzip._cli_parser import OneLineParser
from gradzip.bench.common import HEAP_MODES, environment
from gradzip.bench.hooks import HOOK_CONFIGS, HookRow, run_hooks
from gradzip.bench.micro import DEFAULT_NUMELS, MICRO_SPECS, MicroRow, run_micro
from gradzip.bench.table import hooks_table, micro_table

__all__ = ["Notes", "main", "parser"]

#: Given the rows of one run, lines to print below its table as a Markdown list (for example a
#: benchmark script's verdicts on its targets). Called with the :class:`MicroRow` list of
#: ``micro`` or the :class:`HookRow` list of ``hooks``.
Notes = Callable[[Sequence[Any]], Sequence[str]]


def parser() -> argparse.ArgumentParser:
    """The ``gradzip bench`` argument parser (subcommands ``micro`` and ``hooks``).

    Returns:
        A fresh parser; its ``which`` attribute names the subcommand.
    """
    out = OneLineParser(prog="gradzip bench", description=__doc__.split("\n\n")[0])
    sub = out.add_subparsers(dest="which", required=True)
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
    return out


def _emit_json(row: MicroRow | HookRow) -> None:
    print(json.dumps(row.as_dict()), flush=True)


def _print_notes(rows: Sequence[Any], notes: Notes | None) -> None:
    lines = list(notes(rows)) if notes is not None else []
    if lines:
        print()
    for line in lines:
        print(f"- {line}")


def _run_micro(args: argparse.Namespace, notes: Notes | None) -> None:
    threads = args.threads if args.threads is not None else torch.get_num_threads()
    env = environment(threads)
    rows = run_micro(args.numel, args.compressors, repeat=args.repeat, workers=args.workers,
                     threads=threads, heap=args.heap, on_row=_emit_json if args.json else None)
    if args.json:
        return
    print(micro_table(rows, env, workers=args.workers, repeat=args.repeat, heap=args.heap))
    _print_notes(rows, notes)


def _run_hooks(args: argparse.Namespace, notes: Notes | None) -> None:
    env = environment(args.threads or 0)
    rows = run_hooks(args.workers, args.configs, model=args.model, width=args.width,
                     batch=args.batch, steps=args.steps, rounds=args.rounds, warmup=args.warmup,
                     threads=args.threads, timeout=args.timeout,
                     on_row=_emit_json if args.json else None)
    if args.json:
        return
    print(hooks_table(rows, env))
    _print_notes(rows, notes)


def main(argv: Sequence[str] | None = None, *, notes: Notes | None = None) -> int:
    """Run ``gradzip bench`` with ``argv`` (the arguments after ``bench``).

    Args:
        argv: e.g. ``["micro", "--json", "--numel", "1000000"]``; ``None`` reads ``sys.argv``.
        notes: lines to print as a list below the table (not with ``--json``); the
            ``benchmarks/`` scripts pass their verdicts here.

    Returns:
        The exit status (0 on success, 2 on invalid arguments).
    """
    args = parser().parse_args(list(argv) if argv is not None else sys.argv[1:])
    try:
        if args.which == "micro":
            _run_micro(args, notes)
        else:
            _run_hooks(args, notes)
    except (TypeError, ValueError) as err:
        print(f"gradzip bench: error: {err}", file=sys.stderr)
        return 2
    return 0
