"""CPU and wall time per training step of DDP hooks on loopback, for one or more source trees.

Runs ``benchmarks/netem_steps_worker.py`` (the same model, configurations and interleaved
rounds as the emulated-link benchmark, ``benchmarks/netem_steps.py``) in 2 gloo processes on
``127.0.0.1``, with no network emulation and no root: what it measures is the hook's CPU cost
beside the backward pass (every worker has one thread), not the link. Each ``--src`` is a
``src`` folder put first on ``PYTHONPATH`` (e.g. the main checkout's and a branch's), run in
turn, ``--repeats`` times alternating, so two versions of gradzip can be compared side by side:
per configuration the median ms per step (wall, slowest rank) and CPU ms per step (process
time, mean over ranks, every thread of the process counted), and the median per-round ratios
to native DDP and to the no-DDP floor timed in the same processes.

On a shared machine the absolute figures are noisy; the per-round ratios less so.

Example (about a minute per source tree on 2 quiet cores):
    python -m benchmarks.loopback_steps --src /work/main/src src --rounds 8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gradzip.bench.table import format_table
from gradzip.comm.launch import free_port

from . import netem_steps
from ._common import ROOT, module_command, package_env

DEFAULT_CONFIGS = ("floor", "ddp", "torch-fp16", "torch-powersgd-r4", "gradzip-none",
                   "gradzip-fp16", "gradzip-powersgd-r4")


def run_once(src: str, args: argparse.Namespace, result: Path) -> dict[str, Any]:
    """Both ranks of the worker with ``src`` first on ``PYTHONPATH``; the rank-0 record."""
    env = {**package_env({**os.environ, "PYTHONPATH": ""}, str(Path(src).resolve())),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "GLOO_SOCKET_IFNAME": "lo",
           "OMP_NUM_THREADS": "1"}
    argv = [*module_command("netem_steps_worker"), "--configs", *args.configs, "--gradzip-modes",
            "default", "--rounds", str(args.rounds), "--steps", str(args.steps), "--warmup",
            str(args.warmup), "--width", str(args.width), "--batch-size", str(args.batch_size),
            "--bucket-cap-mb", str(args.bucket_cap_mb), "--result", str(result)]
    procs = [subprocess.Popen(argv, env={**env, "RANK": str(r)}) for r in range(2)]
    codes = [p.wait(timeout=args.timeout) for p in procs]
    if any(codes):
        raise RuntimeError(f"a worker failed with {src}: exit codes {codes}")
    return json.loads(result.read_text())


def rows_of(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The benchmark's rows plus CPU-time ratios to native DDP and the floor."""
    rows, _ = netem_steps.summarise(record)
    cpu = netem_steps.rank_mean(record["ranks"], "cpu_seconds")
    for row in rows:
        c = row["config"]
        row["cpu_vs_ddp"] = netem_steps.paired_ratio(cpu[c], cpu["ddp"]) if "ddp" in cpu else None
        row["cpu_vs_floor"] = (netem_steps.paired_ratio(cpu[c], cpu["floor"])
                               if "floor" in cpu else None)
    return rows


def table(results: Sequence[tuple[str, list[dict[str, Any]]]]) -> str:
    """One markdown row per (source tree, configuration)."""
    def fmt(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)
    head = ["src", "config", "wall ms/step", "vs ddp", "vs floor", "CPU ms/step", "CPU vs ddp",
            "CPU vs floor"]
    cells = [dict(enumerate([src, r["config"], f"{r['ms_per_step']:.1f}", fmt(r["vs_ddp"], ".3f"),
                             fmt(r["vs_floor"], ".3f"), f"{r['cpu_ms_per_step']:.1f}",
                             fmt(r["cpu_vs_ddp"], ".3f"), fmt(r["cpu_vs_floor"], ".3f")]))
             for src, rows in results for r in rows]
    return format_table(cells, list(enumerate(head)))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--src", nargs="+", default=[str(ROOT / "src")],
                   help="src folders to compare (each first on PYTHONPATH in its run)")
    p.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS),
                   choices=netem_steps.worker.CONFIGS)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1, help="runs per src, alternating")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--bucket-cap-mb", type=float, default=1.0)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", help="write every run's rows as JSON here")
    args = p.parse_args(argv)
    for name in ("rounds", "steps", "repeats", "width", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"`--{name.replace('_', '-')}` must be >= 1, got {getattr(args, name)}")
    if "ddp" not in args.configs:
        p.error("`--configs` must include ddp (the reference of the ratios)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    results: list[tuple[str, list[dict[str, Any]]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for j, src in enumerate(args.src):
                record = run_once(src, args, Path(tmp) / f"run-{i}-{j}.json")
                results.append((src, rows_of(record)))
    print(table(results))
    if args.out:
        Path(args.out).write_text(json.dumps([{"src": s, "rows": r} for s, r in results],
                                             indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
