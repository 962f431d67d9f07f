"""The exchanges of a training step over the emulated link, with compute replaced by a sleep.

Builds the lab of ``benchmarks/_netlab.py`` (with ``--rtt-ms``, its delay line) and runs two
gloo workers that replay, step after step, the collective calls one exchange of each method
makes (their kinds and sizes from :func:`gradzip.plan.measure_traffic` on the LM transformer's
shapes), separated by ``--compute-ms`` of sleep in place of the forward and backward pass: per
step for per-step methods, every H steps for outer ones. A sleep leaves the link idle for as
long as compute would, so TCP's restart after idle acts as in training, while the load other
processes put on the machine moves the times far less than real compute would.

For each method it writes the measured time of one exchange (median over the steps that
exchange) beside the cost model's link time for it (:func:`gradzip.plan.comm_seconds`: hops x
rtt / 2 + bytes at the link's measured goodput without a round trip, ``--line-mbit``, default
the cap). Run it once without a round trip and once with one::

    sudo python -m benchmarks.netem_rtt_probe --bandwidth-mbit 40 --rtt-ms 100 \\
        --out benchmarks/results/netem_rtt_probe_100.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from . import _netlab as netlab
from . import _netlab_launch as launch
from ._common import module_command

HERE = Path(__file__).resolve().parent
#: Method -> (spec, H) as in ``plan_validation.OUTER`` (H = 0: an exchange every step).
METHODS = {"none": ("none", 0), "powersgd4": ("powersgd:rank=4", 0), "diloco30": ("none", 30)}
#: The dense exchange of the LM transformer of ``outer_netem.py`` between 2 workers, in bytes
#: (measured there): its shapes are solved from it.
LM_DENSE_BYTES = 4_086_556


def calls_of(method: str, workers: int) -> list[tuple[str, int]]:
    """``(kind, bytes)`` of each collective call of one exchange of ``method``."""
    from gradzip.plan import measure_traffic

    from .plan_validation import _outer_shapes

    shapes = _outer_shapes(LM_DENSE_BYTES * workers / (2 * (workers - 1)), workers)
    return [(c.kind, c.nbytes) for c in measure_traffic(METHODS[method][0], workers,
                                                        shapes=shapes).calls]


# --------------------------------------------------------------------------- the worker


def replay(calls: Sequence[tuple[str, int]], h: int, steps: int, compute_s: float,
           warmup: int) -> dict[str, list[float]]:
    """Replay ``calls`` after every ``h``-th sleep of ``compute_s`` (every one when 0).

    Returns:
        ``{"exchange_seconds": [...], "step_seconds": [...]}`` over the timed steps.
    """
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    buffers = []
    for kind, nbytes in calls:
        n = max(1, nbytes // 4)
        if kind == "all_reduce":
            buffers.append((torch.ones(n), None))
        else:  # an all-gather of n entries from each worker (an all-to-all as its bytes)
            buffers.append((torch.ones(n), [torch.empty(n) for _ in range(world)]))

    def exchange() -> None:
        for buf, out in buffers:
            if out is None:
                dist.all_reduce(buf)
            else:
                dist.all_gather(out, buf)

    for _ in range(warmup):
        exchange()
    exchanges, steps_s = [], []
    dist.barrier()
    for step in range(steps):
        start = time.perf_counter()
        time.sleep(compute_s)
        if not h or (step + 1) % h == 0:
            t0 = time.perf_counter()
            exchange()
            exchanges.append(time.perf_counter() - t0)
        steps_s.append(time.perf_counter() - start)
    return {"exchange_seconds": exchanges, "step_seconds": steps_s}


def worker_main(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    plan = json.loads(args.calls)
    out: dict[str, Any] = {"world": dist.get_world_size(), "methods": {}}
    for method in args.methods:
        h = METHODS[method][1]
        steps = args.syncs * h if h else args.steps
        out["methods"][method] = {"calls": plan[method], "outer_steps": h, "steps": steps,
                                  **replay(plan[method], h, steps, args.compute_ms / 1e3,
                                           args.warmup)}
    dist.barrier()
    if dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps(out))
    launch.exit_skipping_teardown()


# --------------------------------------------------------------------------- the launcher


def summarise(record: dict[str, Any], bandwidth_mbit: float, rtt_ms: float,
              compute_ms: float) -> list[dict[str, Any]]:
    """Per method: the measured exchange and step against the cost model's."""
    from gradzip.comm.base import allgather_wire_bytes, allreduce_wire_bytes
    from gradzip.plan import comm_seconds

    w = record["world"]
    rows = []
    for method, m in record["methods"].items():
        wire = sum(allreduce_wire_bytes(n, w) if k == "all_reduce" else
                   allgather_wire_bytes(n, w) for k, n in m["calls"])
        hops = sum(2 * (w - 1) if k == "all_reduce" else w - 1 for k, _ in m["calls"])
        predicted = 1e3 * comm_seconds(wire, hops, bandwidth_mbit, rtt_ms)
        measured = 1e3 * statistics.median(m["exchange_seconds"])
        h = m["outer_steps"] or 1
        rows.append({"method": method, "outer_steps": m["outer_steps"], "calls": len(m["calls"]),
                     "wire_bytes": wire, "hops": hops, "rtt_ms": rtt_ms,
                     "exchanges": len(m["exchange_seconds"]),
                     "exchange_ms_measured": measured,
                     "exchange_ms_min": 1e3 * min(m["exchange_seconds"]),
                     "exchange_ms_max": 1e3 * max(m["exchange_seconds"]),
                     "exchange_ms_predicted": predicted,
                     "step_ms_measured": 1e3 * statistics.mean(m["step_seconds"]),
                     "step_ms_predicted": compute_ms + predicted / h})
    return rows


def benchmark(args: argparse.Namespace, lab: netlab.Lab, tmp: Path) -> int:
    lab.shape(args.bandwidth_mbit)
    goodput = launch.measure_goodput(lab, args.bandwidth_mbit, tmp)
    rtt = launch.measure_rtt(lab, tmp)
    calls = {m: calls_of(m, lab.workers) for m in args.methods}
    argv = [*module_command("netem_rtt_probe"), "worker", "--calls", json.dumps(calls),
            "--methods", *args.methods, "--steps", str(args.steps), "--syncs", str(args.syncs),
            "--compute-ms", f"{args.compute_ms:g}", "--warmup", str(args.warmup),
            "--result", str(tmp / "probe.json")]
    load = os.getloadavg()
    problem = launch.run_workers(lab, argv, 29700, tmp, "probe", args.run_timeout)
    if problem is not None:
        tails = launch.format_tails(launch.rank_log_tails(tmp, "probe", lab.workers))
        raise netlab.LabError(f"probe run: {problem}\n{tails}")
    record = json.loads((tmp / "probe.json").read_text())
    line = args.line_mbit or args.bandwidth_mbit
    doc = {"meta": {"args": {k: (str(v) if isinstance(v, Path) else v)
                             for k, v in vars(args).items()},
                    "machine": netlab.machine_info(), "goodput": goodput, "rtt": rtt,
                    "delay_line": launch.delay_stats(tmp), "loadavg_start": load,
                    "loadavg_end": os.getloadavg(), "line_mbit": line},
           "rows": summarise(record, line, args.rtt_ms, args.compute_ms), "record": record}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    for r in doc["rows"]:
        print(f"rtt {args.rtt_ms:g} ms {r['method']:10s} exchange {r['exchange_ms_measured']:8.1f} "
              f"ms measured ({r['exchanges']}), {r['exchange_ms_predicted']:8.1f} predicted; "
              f"step {r['step_ms_measured']:8.1f} / {r['step_ms_predicted']:8.1f}")
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    launch.add_lab_arguments(p, workers=2, run_timeout=900.0,
                             out=HERE / "results" / "netem_rtt_probe.json")
    p.add_argument("--bandwidth-mbit", type=float, default=40.0)
    p.add_argument("--line-mbit", type=float, default=0.0,
                   help="the line rate the prediction uses (default: the cap)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--steps", type=int, default=20, help="steps of a per-step method")
    p.add_argument("--syncs", type=int, default=3, help="exchanges of an outer method")
    p.add_argument("--compute-ms", type=float, default=300.0, help="the sleep per step")
    p.add_argument("--warmup", type=int, default=2)
    return launch.parse_checked(p, argv, validate)


def validate(args: argparse.Namespace) -> list[str]:
    out = launch.validate_lab(args)
    if not 0 < args.bandwidth_mbit <= 100_000:
        out.append(f"`--bandwidth-mbit` must be in (0, 100000], got {args.bandwidth_mbit:g}")
    if args.line_mbit < 0:
        out.append(f"`--line-mbit` must be >= 0, got {args.line_mbit:g}")
    if args.compute_ms < 0:
        out.append(f"`--compute-ms` must be >= 0, got {args.compute_ms:g}")
    out += launch.bound_problems(args, at_least_one=("steps", "syncs"))
    if args.warmup < 0:
        out.append(f"`--warmup` must be >= 0, got {args.warmup}")
    return out


def dry_run(args: argparse.Namespace) -> list[list[str]]:
    with launch.recorded_lab(args.workers, args.subnet, args.rtt_ms) as (lab, cmds):
        lab.shape(args.bandwidth_mbit)
        cmds.append(netlab.netns_exec(lab.names[0], [*module_command("netem_rtt_probe"),
                                                     "worker", "..."]))
    return cmds


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        p = argparse.ArgumentParser()
        p.add_argument("--calls", required=True)
        p.add_argument("--methods", nargs="+", required=True)
        for flag in ("--steps", "--syncs", "--warmup"):
            p.add_argument(flag, type=int, required=True)
        p.add_argument("--compute-ms", type=float, required=True)
        p.add_argument("--result", required=True)
        return worker_main(p.parse_args(argv[1:]))
    return launch.main_with_lab(parse_args(argv), prog="netem_rtt_probe.py",
                                tmp_prefix="gz-rtt-probe-", dry_run=dry_run, body=benchmark)


if __name__ == "__main__":
    sys.exit(main())
