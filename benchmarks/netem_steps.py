"""Seconds per training step over an emulated link: DDP hooks side by side, against the floor.

Builds the lab of ``benchmarks/_netlab.py``, like ``benchmarks/netem.py`` (one namespace per
worker, a bridge in a hub namespace, every link capped with ``tc tbf`` in both directions; that
module says what it touches and how it cleans up), then runs
``benchmarks/netem_steps_worker.py`` once in every worker namespace. The workers time every
configuration in interleaved rounds (native DDP, PyTorch's ``fp16_compress_hook`` and
``powerSGD_hook``, gradzip ``none``/``fp16``/``powersgd:rank=4`` in each hook mode ``register``
offers, and the same model with no DDP at all), and this script prints ms per step, ratios to
native DDP and to the no-DDP floor, and the verdicts of the step-time targets.

The link rate: ``--bandwidth-mbit auto`` (the default) first times the model's compute alone
in the namespaces (the ``floor`` configuration, every rank at once), then caps the link so
that a dense step's ring all-reduce takes ``--comm-compute`` times that compute at line rate.
The run then measures the ratio it got: ``gradzip none`` in synchronous mode (communication
in series with compute) minus the floor, over the floor; and a dense all-reduce alone.

The table, the ratios, the verdicts and the report are made by ``_netem_steps_report.py``
beside this file.

``--rtt-ms R`` adds a round trip of R ms between the workers (the lab's delay line,
``benchmarks/netem_delay.py``). It needs root, like ``netem.py``; ``--dry-run`` prints the
commands as any user.

Example (2 workers, 40 rounds of 3 steps; about 5 minutes on 2 quiet cores, 7 with the
synchronous variants of the gradzip hook):
    sudo python -m benchmarks.netem_steps --out benchmarks/results/netem_steps.json
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gradzip.comm.base import allreduce_wire_bytes

from . import _netlab as netlab
from . import _netlab_launch as launch
from . import netem_steps_worker as worker
from ._common import module_command

# The summary, verdicts and report sit beside this file. The helpers unused here are imported
# too: loopback_steps.py and the tests read them as netem_steps.paired_ratio etc.
from ._netem_steps_report import (  # noqa: F401
    TARGETS,
    comm_compute_ratio,
    dense_serial_config,
    markdown_table,
    paired_ratio,
    rank_mean,
    report,
    slowest_rank,
    summarise,
    verdict_line,
    verdicts,
)

HERE = Path(__file__).resolve().parent
#: The command that starts one rank (its arguments follow).
WORKER = module_command("netem_steps_worker")

log = logging.getLogger("netem_steps")
#: Bytes a shaped link carries per byte of TCP payload at MTU 1500 (1448 payload bytes with
#: timestamps in a 1514-byte frame): ``tbf`` counts whole frames.
WIRE_OVERHEAD = 1514 / 1448


# --------------------------------------------------------------------------- arithmetic


def ring_wire_bytes(grad_bytes: float, world: int) -> float:
    """Bytes each worker sends in a ring all-reduce of ``grad_bytes``: ``2 (W-1)/W`` of it,
    as the library counts them (:func:`gradzip.comm.base.allreduce_wire_bytes`)."""
    return float(allreduce_wire_bytes(round(grad_bytes), world))


def round_significant(x: float, digits: int = 2) -> float:
    """``x`` rounded to ``digits`` significant figures (a rate that reads well in a table)."""
    if x <= 0 or not math.isfinite(x):
        raise ValueError(f"`x` must be a positive finite number, got {x!r}")
    return round(x, digits - 1 - math.floor(math.log10(x)))


def choose_bandwidth(grad_bytes: float, world: int, compute_seconds: float,
                     comm_compute: float = 1.0) -> float:
    """The link rate (Mbit/s) at which a dense step's communication takes ``comm_compute``
    times ``compute_seconds`` at line rate (frame overhead included), to 2 significant figures.

    Raises:
        ValueError: a non-positive argument, or a rate outside (0, 100000] Mbit/s.
    """
    for name, value in (("grad_bytes", grad_bytes), ("compute_seconds", compute_seconds),
                        ("comm_compute", comm_compute)):
        if not value > 0:
            raise ValueError(f"`{name}` must be > 0, got {value!r}")
    if world < 2:
        raise ValueError(f"`world` must be >= 2, got {world!r}")
    bits = ring_wire_bytes(grad_bytes, world) * WIRE_OVERHEAD * 8
    rate = round_significant(bits / (compute_seconds * comm_compute) / 1e6)
    if not 0 < rate <= 100_000:
        raise ValueError(f"the chosen rate must be in (0, 100000] Mbit/s, got {rate:g}")
    return rate


# --------------------------------------------------------------------------- runs


def worker_argv(args: argparse.Namespace, configs: Sequence[str], rounds: int,
                result: str) -> list[str]:
    """``netem_steps_worker.py`` arguments (every rank gets the same)."""
    return [*WORKER, "--result", result, "--configs", *configs,
            "--gradzip-modes", *args.gradzip_modes,
            *launch.option_argv(args, worker.STEP_OPTIONS, {"rounds": rounds}), "--progress"]


def run_workers(lab: netlab.Lab, args: argparse.Namespace, configs: Sequence[str], rounds: int,
                port: int, tmp: Path, tag: str) -> dict[str, Any]:
    """One worker per namespace; returns rank 0's record.

    Raises:
        netlab.LabError: a worker failed or the run timed out (with the ranks' log tails).
    """
    result = tmp / f"{tag}.json"
    problem = launch.run_workers(lab, worker_argv(args, configs, rounds, str(result)), port, tmp,
                                 tag, args.run_timeout)
    if problem is not None or not result.exists():
        tails = launch.format_tails(launch.rank_log_tails(tmp, tag, lab.workers))
        raise netlab.LabError(f"{tag} run: {problem or 'no result'}\n{tails}")
    return json.loads(result.read_text())


def benchmark(args: argparse.Namespace, lab: netlab.Lab, tmp: Path) -> dict[str, Any]:
    """Probe (when the rate is ``auto``), shape, check goodput, time; returns the JSON document."""
    meta: dict[str, Any] = {"args": {k: (str(v) if isinstance(v, Path) else v)
                                     for k, v in vars(args).items()},
                            "machine": netlab.machine_info(), "loadavg_start": os.getloadavg()}
    if args.bandwidth_mbit == "auto":
        log.info("probing compute alone (%d rounds of the floor, link unshaped)", args.probe_rounds)
        probe = run_workers(lab, args, ["floor"], args.probe_rounds, 29501, tmp, "probe")
        compute = statistics.median(slowest_rank(probe["ranks"])["floor"])
        rate = choose_bandwidth(probe["grad_bytes"], lab.workers, compute, args.comm_compute)
        meta["bandwidth_choice"] = {
            "compute_seconds": compute, "grad_bytes": probe["grad_bytes"],
            "ring_wire_bytes": ring_wire_bytes(probe["grad_bytes"], lab.workers),
            "wire_overhead": WIRE_OVERHEAD, "comm_compute": args.comm_compute}
        log.info("compute %.1f ms/step, %.2f MB of gradient: link at %g Mbit/s",
                 1e3 * compute, probe["grad_bytes"] / 1e6, rate)
    else:
        rate = float(args.bandwidth_mbit)
    meta["bandwidth_mbit"] = rate
    lab.shape(rate)
    meta["goodput"] = launch.measure_goodput(lab, rate, tmp)
    meta["rtt"] = launch.measure_rtt(lab, tmp)
    log.info("%g Mbit/s: measured goodput %.1f Mbit/s", rate, meta["goodput"]["mbit_per_s"])
    started = time.perf_counter()
    record = run_workers(lab, args, args.configs, args.rounds, 29502, tmp, "steps")
    meta["wall_seconds"] = time.perf_counter() - started
    meta["loadavg_end"] = os.getloadavg()
    meta["delay_line"] = launch.delay_stats(tmp)
    rows, times = summarise(record)
    ranks = record["ranks"]
    dense = dense_serial_config(record["configs"], record["sync_keyword"])
    line_rate = ring_wire_bytes(record["grad_bytes"], record["world"]) * WIRE_OVERHEAD * 8 / (rate * 1e6)
    floor = statistics.median(times["floor"]) if "floor" in times else None
    allreduce = statistics.median(max(r["allreduce_seconds"][i] for r in ranks)
                                  for i in range(len(ranks[0]["allreduce_seconds"])))
    meta["comm_compute"] = {
        **comm_compute_ratio(times, dense),
        "compute_seconds": floor,
        "allreduce_alone_seconds": allreduce,
        "allreduce_alone_ratio": allreduce / floor if floor else None,
        "line_rate_seconds": line_rate,
        "line_rate_ratio": line_rate / floor if floor else None,
    }
    meta.update(params=record["params"], grad_bytes=record["grad_bytes"],
                rounds=record["rounds"], steps=record["steps"],
                sync_keyword=record["sync_keyword"], world=record["world"])
    return {"meta": meta, "rows": rows, "verdicts": verdicts(times), "record": record}


# --------------------------------------------------------------------------- CLI


def _bandwidth(text: str) -> str | float:
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be 'auto' or a number, got {text!r}") from None
    if not 0 < value <= 100_000:
        raise argparse.ArgumentTypeError(f"must be in (0, 100000], got {text!r}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    launch.add_lab_arguments(p, workers=2, run_timeout=3600.0,
                             out=HERE / "results" / "netem_steps.json")
    p.add_argument("--bandwidth-mbit", type=_bandwidth, default="auto",
                   help="link cap in Mbit/s each way, or 'auto': chosen from a compute probe "
                        "so that a dense step's communication takes --comm-compute x compute")
    p.add_argument("--comm-compute", type=float, default=1.0)
    p.add_argument("--configs", nargs="+", choices=worker.CONFIGS,
                   default=[c for c in worker.CONFIGS if not c.endswith(("-allgather", "-sharded"))])
    p.add_argument("--gradzip-modes", nargs="+", default=["default", "sync"],
                   choices=["default", "sync"],
                   help="gradzip hook modes to time; 'sync' only where register() has a "
                        "keyword for it")
    launch.add_options(p, worker.STEP_OPTIONS)
    p.add_argument("--probe-rounds", type=int, default=5)
    return launch.parse_checked(p, argv, validate)


def validate(args: argparse.Namespace) -> list[str]:
    """Problems with the arguments, as ``"`name` must ..., got ..."`` messages."""
    out = launch.validate_lab(args)
    out += launch.bound_problems(
        args, positive=("comm_compute", "bucket_cap_mb", "torch_powersgd_bucket_cap_mb",
                        "collective_timeout"),
        at_least_one=("rounds", "steps", "probe_rounds", "comm_probes", "width", "batch_size"))
    if args.warmup < 3:
        out.append(f"`--warmup` must be >= 3 (DDP rebuilds its buckets after the first step, "
                   f"the built-in PowerSGD compresses from the third), got {args.warmup}")
    if len(set(args.configs)) != len(args.configs):
        out.append(f"`--configs` must not repeat, got {args.configs}")
    return out


def dry_run(args: argparse.Namespace) -> list[list[str]]:
    """Every command a real run would issue, in order (workers shown for rank 0 only; with
    ``auto``, the shaping shows 1000 Mbit/s in place of the rate the probe will choose)."""
    with launch.recorded_lab(args.workers, args.subnet, args.rtt_ms) as (lab, cmds):
        if args.bandwidth_mbit == "auto":
            cmds.append(netlab.netns_exec(lab.names[0], worker_argv(args, ["floor"],
                                                                    args.probe_rounds, "PROBE")))
        lab.shape(1000.0 if args.bandwidth_mbit == "auto" else args.bandwidth_mbit)
        cmds.append(netlab.netns_exec(lab.names[0], worker_argv(args, args.configs, args.rounds,
                                                                "RESULT")))
    return cmds


def run_and_report(args: argparse.Namespace, lab: netlab.Lab, tmp: Path) -> int:
    """Benchmark on the created lab; write the JSON and the report beside it, print the report."""
    doc = benchmark(args, lab, tmp)
    text = report(doc)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    args.out.with_suffix(".md").write_text(text + "\n")
    print(text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return launch.main_with_lab(parse_args(argv), prog="netem_steps.py",
                                tmp_prefix="gz-netem-steps-", dry_run=dry_run,
                                body=run_and_report)


if __name__ == "__main__":
    sys.exit(main())
