"""Benchmark over an emulated slow network: real gloo workers in network namespaces.

Builds the lab of ``benchmarks/_netlab.py`` (one network namespace per worker, a bridge in a
hub namespace, every link capped in both directions with ``tc``; that module says what it
touches and how it cleans up), then trains with ``benchmarks/netem_worker.py`` in each
namespace (gloo over TCP, DDP with the gradzip comm hook) once per (bandwidth, method), and
writes a JSON record and a CSV summary.

Seconds per step of DDP hooks side by side over the same kind of link (native DDP, PyTorch's
hooks, gradzip's, the no-DDP floor) are ``benchmarks/netem_steps.py``, on the same lab.

``--rtt-ms R`` adds a round trip of R ms between the workers (the lab's delay line,
``benchmarks/netem_delay.py``). It needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and refuses
with a message otherwise.
``--dry-run`` prints the commands it would run, as any user.

Example (the run behind BENCHMARKS.md section 3, about 18 minutes on 2 cores):
    sudo python -m benchmarks.netem --bandwidth-mbit 1000 150 40 \
        --methods none powersgd-r1 powersgd-r4 accordion accordion:eta=0.3 topk threshold \
        --out benchmarks/results/netem.json --plot benchmarks/results/netem.png

Step times side by side (a 4.2M-parameter model in 3 buckets; the no-DDP floor is each row's
``compute_seconds``, the dense communication time ``dense_comm_seconds_model``):
    sudo env PYTHONPATH=$PWD/src python -m benchmarks.netem --workers 2 --bandwidth-mbit 1000 \
        --width 176 --bucket-cap-mb 4 --epochs 5 --methods native none none:sync torch-fp16 \
        fp16 fp16:sync powersgd-r4 powersgd-r4:sync --out benchmarks/results/netem_steps.json
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import re
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gradzip.bench.table import format_table

from . import _netlab as netlab
from . import _netlab_launch as launch
from . import netem_worker as worker
from ._common import module_command

HERE = Path(__file__).resolve().parent
#: The command that starts one worker (its arguments follow).
WORKER = module_command("netem_worker")

log = logging.getLogger("netem")
#: Benchmark methods: name -> compressor spec ("accordion" is built from --steady/--critical;
#: a variant such as "accordion:eta=0.3,interval=11" overrides --eta/--interval for one run;
#: ":sync" runs a gradzip method through the synchronous hook, e.g. "powersgd-r4:sync").
#: "native" is plain DDP and "torch-fp16" DDP with PyTorch's fp16_compress_hook.
METHODS = {
    "native": "native",
    "torch-fp16": "torch-fp16",
    "none": "none",
    "fp16": "fp16",
    "powersgd-r1": "powersgd:rank=1",
    "powersgd-r4": "powersgd:rank=4",
    "accordion": "accordion",
    "topk": "topk:ratio=0.01",
    "threshold": "threshold:budget=0.01",
}


# --------------------------------------------------------------------------- one run


# --------------------------------------------------------------------------- one run


def parse_method(method: str) -> tuple[str, dict[str, float]]:
    """``"accordion:eta=0.3,interval=11"`` -> ``("accordion", {"eta": 0.3, "interval": 11})``;
    ``"powersgd-r4:sync"`` -> ``("powersgd-r4", {"sync": 1})`` (the synchronous hook).

    Raises:
        ValueError: an unknown method, or an override that is not ``sync`` (gradzip methods),
            ``eta`` (> 0) or ``interval`` (>= 1) of an Accordion.
    """
    base, _, rest = method.partition(":")
    if base not in METHODS:
        raise ValueError(f"`--methods` entries must be among {', '.join(METHODS)}, got {method!r}")
    overrides: dict[str, float] = {}
    for item in filter(None, rest.split(",")):
        if item == "sync" and METHODS[base] not in ("native", "torch-fp16") and "sync" not in overrides:
            overrides["sync"] = 1
            continue
        key, _, value = item.partition("=")
        try:
            number = float(value) if key == "eta" else int(value)
        except ValueError:
            number = -1
        if base != "accordion" or key not in ("eta", "interval") or key in overrides or number <= 0:
            raise ValueError(
                "`--methods` variants must look like accordion:eta=0.3,interval=11 or "
                f"powersgd-r4:sync, got {method!r}")
        overrides[key] = number
    return base, overrides


def worker_argv(args: argparse.Namespace, method: str, result: str) -> list[str]:
    """``netem_worker.py train`` arguments of one run (every rank gets the same)."""
    base, overrides = parse_method(method)
    spec = METHODS[base]
    argv = [*WORKER, "train", "--spec", spec, "--result", result,
            *launch.option_argv(args, worker.TRAINING_OPTIONS),
            "--collective-timeout", f"{args.run_timeout:g}",
            *launch.option_argv(args, worker.BUCKET_OPTIONS)]
    if overrides.get("sync"):
        argv.append("--sync")
    if spec == "accordion":
        argv += launch.option_argv(args, worker.ACCORDION_OPTIONS, overrides)
    if args.stop_at_target:
        argv.append("--stop-at-target")
    return argv


def run_one(lab: netlab.Lab, args: argparse.Namespace, method: str, port: int, tmp: Path) -> dict[str, Any]:
    """Train one method over the current shaping; the rank-0 record plus kernel byte counts."""
    tag = re.sub(r"[^A-Za-z0-9_.-]", "_", method)
    result = tmp / f"{tag}.json"
    result.unlink(missing_ok=True)
    started = time.perf_counter()
    problem = launch.run_workers(lab, worker_argv(args, method, str(result)), port, tmp, tag,
                                 args.run_timeout)
    wall = time.perf_counter() - started
    if problem is not None or not result.exists():
        tails = launch.rank_log_tails(tmp, tag, lab.workers)
        log.error("%s: %s\n%s", method, problem or "no result", launch.format_tails(tails))
        return {"method": method, "error": problem or "no result", "wall_seconds": wall,
                "log_tails": tails}
    record = json.loads(result.read_text())
    record.update(method=method, wall_seconds=wall)
    return record


# --------------------------------------------------------------------------- summary


def steps_to_target(accuracy: Sequence[float], target: float, window: int) -> int | None:
    """First step at which the mean accuracy of the last ``window`` evaluations (one per
    step) reaches ``target``; ``None`` if never. One evaluation on a 359-image test set
    moves by 0.28 points per image, so a single lucky evaluation is not counted."""
    for i in range(window - 1, len(accuracy)):
        if sum(accuracy[i - window + 1:i + 1]) / window >= target:
            return i + 1
    return None


def summarize(record: dict[str, Any], rate_mbit: float, window: int = 5) -> dict[str, Any]:
    """One table row: seconds per step, steps and seconds to the target, bytes per worker."""
    if "error" in record:
        return {"method": record["method"], "bandwidth_mbit": rate_mbit, "error": record["error"]}
    steps = record["step_seconds"]
    reached = steps_to_target(record["accuracy"], record["target"], window)
    stats = record["hook_stats"]
    n = len(steps)
    wire = statistics.mean(s["wire_bytes"] for s in stats) / n
    dense = statistics.mean(s["dense_wire_bytes"] for s in stats) / n
    compute = statistics.median(record["compute_seconds"])
    row = {
        "method": record["method"],
        "bandwidth_mbit": rate_mbit,
        "seconds_per_step": sum(steps) / n,
        "median_step_seconds": statistics.median(steps),
        "steps_to_target": reached,
        "seconds_to_target": sum(steps[:reached]) if reached else None,
        "first_step_at_target": record["steps_to_target"],
        "final_accuracy": record["accuracy"][-1],
        "best_accuracy": max(record["accuracy"]),
        "steps_run": n,
        "wire_bytes_per_step": wire,
        "kernel_tx_bytes_per_step": statistics.mean(s["kernel_tx_bytes"] for s in stats) / n,
        "compression_rate": dense / wire if wire else None,
        "compute_seconds": compute,
        "allreduce_latency_seconds": record["allreduce_latency_seconds"],
        "dense_comm_seconds_model": dense * 8 / (rate_mbit * 1e6),
    }
    if record.get("critical_fraction"):
        row["critical_fraction"] = statistics.mean(record["critical_fraction"])
    return row


def add_speedups(rows: list[dict[str, Any]]) -> None:
    """``speedup``: time to target of ``none`` over this row's, per bandwidth."""
    base = {r["bandwidth_mbit"]: r.get("seconds_to_target") for r in rows if r["method"] == "none"}
    for r in rows:
        ref, mine = base.get(r["bandwidth_mbit"]), r.get("seconds_to_target")
        r["speedup_vs_none"] = ref / mine if ref and mine else None


def _cells(r: dict[str, Any]) -> list[str]:
    head = [f"{r['bandwidth_mbit']:g} Mbit/s", r["method"]]
    if "error" in r:
        return [*head, f"failed: {r['error']}", *[""] * 6]
    reached = r["steps_to_target"]
    speed = r.get("speedup_vs_none")
    return [
        *head,
        f"{r['seconds_per_step']:.3f}",
        str(reached) if reached else f"not reached (best {r['best_accuracy']:.3f})",
        f"{r['seconds_to_target']:.1f}" if reached else "-",
        f"{speed:.2f}x" if speed else "-",
        f"{r['wire_bytes_per_step'] / 1e3:,.0f} kB",
        f"{r['compression_rate']:.0f}x" if r["compression_rate"] else "-",
        f"{r['final_accuracy']:.3f}",
    ]


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The results table of the BENCHMARKS.md section."""
    header = ["bandwidth", "method", "s/step", "steps to target", "time to target (s)",
              "speedup vs none", "wire bytes/worker/step", "compression", "final acc"]
    return format_table([dict(enumerate(_cells(r))) for r in rows], list(enumerate(header)))


def write_outputs(out: Path, meta: dict[str, Any], runs: list[dict[str, Any]],
                  rows: list[dict[str, Any]]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "summary": rows, "runs": runs}, indent=1))
    keys = sorted({k for r in rows for k in r})
    with open(out.with_suffix(".csv"), "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)


def plot(runs: list[dict[str, Any]], rate_mbit: float, target: float, path: Path) -> None:
    """Test accuracy against training seconds at one bandwidth (a small PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=90)
    for r in runs:
        if r.get("bandwidth_mbit") != rate_mbit or "error" in r:
            continue
        t, acc = 0.0, []
        for s, a in zip(r["step_seconds"], r["accuracy"], strict=True):
            t += s
            acc.append((t, a))
        ax.plot(*zip(*acc, strict=True), label=r["method"], lw=1.2)
    ax.axhline(target, color="grey", ls=":", lw=1)
    ax.set(xscale="log", ylim=(0.5, 1.0), xlabel="training seconds (log)",
           ylabel="test accuracy", title=f"{rate_mbit:g} Mbit/s per worker link")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# --------------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Compressed DDP training over an emulated slow network (needs root).")
    launch.add_lab_arguments(p, workers=4, run_timeout=300.0, out=HERE / "results" / "netem.json")
    p.add_argument("--bandwidth-mbit", type=float, nargs="+", default=[1000.0, 150.0, 40.0],
                   help="per-link rate cap in Mbit/s, each direction; one set of runs each")
    p.add_argument("--methods", nargs="+", default=list(METHODS),
                   help=f"among {', '.join(METHODS)}; also accordion:eta=X,interval=N")
    for options in (worker.TRAINING_OPTIONS, worker.BUCKET_OPTIONS, worker.ACCORDION_OPTIONS):
        launch.add_options(p, options)
    p.add_argument("--stop-at-target", action="store_true")
    p.add_argument("--plot", type=Path, default=None, help="PNG of accuracy vs time")
    return launch.parse_checked(p, argv, validate)


def validate(args: argparse.Namespace) -> list[str]:
    """Problems with the arguments, as ``"`name` must ..., got ..."`` messages."""
    out = launch.validate_lab(args)
    if any(not 0 < b <= 100_000 for b in args.bandwidth_mbit):
        out.append(f"`--bandwidth-mbit` values must be in (0, 100000], got {args.bandwidth_mbit}")
    if not 0 < args.target <= 1:
        out.append(f"`--target` must be in (0, 1], got {args.target:g}")
    out += launch.bound_problems(args, at_least_one=("epochs", "batch_size", "width", "interval",
                                                     "window"))
    if not args.lr > 0 or not args.eta > 0:
        out.append(f"`--lr` and `--eta` must be > 0, got {args.lr:g} and {args.eta:g}")
    if len(set(args.methods)) != len(args.methods):
        out.append(f"`--methods` must not repeat, got {args.methods}")
    for method in args.methods:
        try:
            parse_method(method)
        except ValueError as exc:
            out.append(str(exc))
    return out


def dry_run(args: argparse.Namespace) -> list[list[str]]:
    """Every command a real run would issue, in order (workers shown for rank 0 only)."""
    with launch.recorded_lab(args.workers, args.subnet, args.rtt_ms) as (lab, cmds):
        for rate in args.bandwidth_mbit:
            lab.shape(rate)
            for method in args.methods:
                cmds.append(netlab.netns_exec(lab.names[0], worker_argv(args, method, "RESULT")))
    return cmds


def benchmark(args: argparse.Namespace, lab: netlab.Lab, tmp: Path) -> dict[str, Any]:
    """Every (bandwidth, method) run; returns the JSON document."""
    meta: dict[str, Any] = {"args": {k: (str(v) if isinstance(v, Path) else v)
                                     for k, v in vars(args).items()},
                            "machine": netlab.machine_info(), "goodput": {}, "rtt": {},
                            "loadavg_start": os.getloadavg()}
    runs, port = [], 29500
    for rate in args.bandwidth_mbit:
        lab.shape(rate)
        meta["goodput"][f"{rate:g}"] = launch.measure_goodput(lab, rate, tmp)
        meta["rtt"][f"{rate:g}"] = launch.measure_rtt(lab, tmp)
        log.info("%g Mbit/s: measured goodput %.1f Mbit/s", rate,
                 meta["goodput"][f"{rate:g}"]["mbit_per_s"])
        for method in args.methods:
            port += 1
            record = run_one(lab, args, method, port, tmp)
            record["bandwidth_mbit"] = rate
            runs.append(record)
            row = summarize(record, rate, args.window)
            log.info("%g Mbit/s %-12s %s", rate, method,
                     row.get("error") or f"{row['seconds_per_step']:.3f} s/step, target at "
                     f"step {row['steps_to_target']}, {record['wall_seconds']:.0f} s wall")
    meta["loadavg_end"] = os.getloadavg()
    meta["delay_line"] = launch.delay_stats(tmp)
    rows = [summarize(r, r["bandwidth_mbit"], args.window) for r in runs]
    add_speedups(rows)
    return {"meta": meta, "runs": runs, "rows": rows}


def run_and_report(args: argparse.Namespace, lab: netlab.Lab, tmp: Path) -> int:
    """Benchmark on the created lab, write the JSON, CSV (and plot), print the table; the exit
    status is 1 when a run failed."""
    doc = benchmark(args, lab, tmp)
    write_outputs(args.out, doc["meta"], doc["runs"], doc["rows"])
    if args.plot is not None:
        plot(doc["runs"], min(args.bandwidth_mbit), args.target, args.plot)
    print(markdown_table(doc["rows"]))
    failed = [f"{r['bandwidth_mbit']:g} Mbit/s {r['method']}" for r in doc["rows"]
              if "error" in r]
    if failed:
        print(f"netem.py: {len(failed)} run(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    return launch.main_with_lab(parse_args(argv), prog="netem.py", tmp_prefix="gz-netem-",
                                dry_run=dry_run, body=run_and_report)


if __name__ == "__main__":
    sys.exit(main())
