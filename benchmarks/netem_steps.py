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

It needs root, like ``netem.py``; ``--dry-run`` prints the commands as any user.

Example (2 workers, 40 rounds of 3 steps; about 5 minutes on 2 quiet cores, 7 with the
synchronous variants of the gradzip hook):
    sudo python benchmarks/netem_steps.py --out benchmarks/results/netem_steps.json
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

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the lab and the worker sit beside this file
    sys.path.insert(0, str(HERE))

import _netlab as netlab  # noqa: E402
import _netlab_launch as launch  # noqa: E402
import netem_steps_worker as worker  # noqa: E402

log = logging.getLogger("netem_steps")
WORKER = HERE / "netem_steps_worker.py"
#: Bytes a shaped link carries per byte of TCP payload at MTU 1500 (1448 payload bytes with
#: timestamps in a 1514-byte frame): ``tbf`` counts whole frames.
WIRE_OVERHEAD = 1514 / 1448
#: The issue's targets: (label, configuration, reference, bound, kind). ``at_most``: the
#: median per-round ratio config/reference must be <= bound; ``speedup``: reference/config
#: must be >= bound.
TARGETS = (
    ("gradzip none within 5% of native DDP", "gradzip-none", "ddp", 1.05, "at_most"),
    ("gradzip fp16 within 5% of fp16_compress_hook", "gradzip-fp16", "torch-fp16", 1.05,
     "at_most"),
    ("gradzip PowerSGD rank 4 at least 1.5x faster than native DDP", "gradzip-powersgd-r4",
     "ddp", 1.5, "speedup"),
    ("gradzip PowerSGD rank 4 within 1.25x of the no-DDP floor", "gradzip-powersgd-r4",
     "floor", 1.25, "at_most"),
)


# --------------------------------------------------------------------------- arithmetic


def ring_wire_bytes(grad_bytes: float, world: int) -> float:
    """Bytes each worker sends in a ring all-reduce of ``grad_bytes``: ``2 (W-1)/W`` of it."""
    return 2 * (world - 1) / world * grad_bytes


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


def slowest_rank(ranks: Sequence[dict[str, Any]], key: str = "seconds") -> dict[str, list[float]]:
    """Per configuration, per round, the slowest rank's value (a step ends for everyone at
    its last collective)."""
    configs = ranks[0][key]
    return {c: [max(r[key][c][i] for r in ranks) for i in range(len(ranks[0][key][c]))]
            for c in configs}


def rank_mean(ranks: Sequence[dict[str, Any]], key: str) -> dict[str, list[float]]:
    """Per configuration, per round, the mean over ranks (CPU time)."""
    configs = ranks[0][key]
    return {c: [statistics.mean(r[key][c][i] for r in ranks)
                for i in range(len(ranks[0][key][c]))] for c in configs}


def paired_ratio(values: Sequence[float], base: Sequence[float]) -> float:
    """Median over rounds of ``values[r] / base[r]`` (both timed in round ``r``)."""
    if len(values) != len(base) or not values:
        raise ValueError(f"`values` and `base` must be equally long and non-empty, got "
                         f"{len(values)} and {len(base)}")
    return statistics.median(v / b for v, b in zip(values, base, strict=True))


def dense_serial_config(configs: Sequence[str], sync_keyword: dict[str, Any] | None) -> str | None:
    """The configuration whose step is compute + dense communication in series: gradzip
    ``none`` in synchronous mode (``gradzip-none`` itself while ``register`` has no mode
    keyword, i.e. before the asynchronous hook); ``None`` when it was not timed."""
    if "gradzip-none" + worker.SYNC_SUFFIX in configs:
        return "gradzip-none" + worker.SYNC_SUFFIX
    if sync_keyword is None and "gradzip-none" in configs:
        return "gradzip-none"
    return None


def comm_compute_ratio(times: dict[str, list[float]], dense: str | None) -> dict[str, Any]:
    """Measured communication : compute of a dense step: per round ``(dense - floor) / floor``,
    median over rounds; ``None`` entries when ``dense`` or ``floor`` was not timed."""
    if dense is None or dense not in times or "floor" not in times:
        return {"dense_config": dense, "comm_seconds": None, "ratio": None}
    comm = [d - f for d, f in zip(times[dense], times["floor"], strict=True)]
    return {"dense_config": dense, "comm_seconds": statistics.median(comm),
            "ratio": paired_ratio(comm, times["floor"])}


def summarise(record: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, list[float]]]:
    """Rows of the table (one per configuration) and the per-round slowest-rank seconds."""
    ranks = record["ranks"]
    times, cpu = slowest_rank(ranks), rank_mean(ranks, "cpu_seconds")
    rows = []
    for c in record["configs"]:
        hook = ranks[0]["hook_bytes_per_step"].get(c, {})
        rows.append({
            "config": c,
            "buckets": ranks[0]["buckets"].get(c),
            "ms_per_step": 1e3 * statistics.median(times[c]),
            "vs_ddp": paired_ratio(times[c], times["ddp"]) if "ddp" in times else None,
            "vs_floor": paired_ratio(times[c], times["floor"]) if "floor" in times else None,
            "cpu_ms_per_step": 1e3 * statistics.median(cpu[c]),
            "kernel_tx_bytes_per_step": statistics.mean(
                r["kernel_tx_bytes_per_step"][c] for r in ranks),
            "hook_wire_bytes_per_step": hook.get("wire_bytes"),
        })
    return rows, times


def verdicts(times: dict[str, list[float]]) -> list[dict[str, Any]]:
    """One entry per target and gradzip hook mode timed: the median per-round ratio and
    whether it meets the target (``met`` is ``None`` when a configuration is missing)."""
    out = []
    for label, config, ref, bound, kind in TARGETS:
        for suffix in ("", worker.SYNC_SUFFIX):
            name = config + suffix
            if suffix and name not in times:
                continue
            entry: dict[str, Any] = {"target": label, "config": name, "reference": ref,
                                     "kind": kind, "bound": bound, "ratio": None, "met": None}
            if name in times and ref in times:
                if kind == "speedup":
                    entry["ratio"] = paired_ratio(times[ref], times[name])
                    entry["met"] = entry["ratio"] >= bound
                else:
                    entry["ratio"] = paired_ratio(times[name], times[ref])
                    entry["met"] = entry["ratio"] <= bound
            out.append(entry)
    return out


def verdict_line(v: dict[str, Any]) -> str:
    """e.g. ``"met: gradzip none within 5% of native DDP (gradzip-none / ddp = 1.031x, bound
    1.05)"``; a speedup reads reference / configuration."""
    if v["met"] is None:
        return f"not measured: {v['target']} ({v['config']} or {v['reference']} not timed)"
    what = (f"{v['reference']} / {v['config']} = {v['ratio']:.3f}x" if v["kind"] == "speedup"
            else f"{v['config']} / {v['reference']} = {v['ratio']:.3f}x")
    return f"{'met' if v['met'] else 'MISSED'}: {v['target']} ({what}, bound {v['bound']:g})"


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """ms/step, ratios and bytes per configuration."""
    head = ["configuration", "buckets", "ms / step", "vs native DDP", "vs no-DDP floor",
            "CPU ms / step", "kB sent / worker / step"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]

    def ratio(x: float | None) -> str:
        return f"{x:.3f}" if x is not None else "-"

    for r in rows:
        lines.append("| " + " | ".join([
            r["config"], str(r["buckets"] if r["buckets"] is not None else "-"),
            f"{r['ms_per_step']:.1f}", ratio(r["vs_ddp"]), ratio(r["vs_floor"]),
            f"{r['cpu_ms_per_step']:.1f}", f"{r['kernel_tx_bytes_per_step'] / 1e3:,.0f}"]) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- runs


def worker_argv(args: argparse.Namespace, configs: Sequence[str], rounds: int,
                result: str) -> list[str]:
    """``netem_steps_worker.py`` arguments (every rank gets the same)."""
    return [sys.executable, str(WORKER), "--result", result, "--configs", *configs,
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
    lab.shape(rate, args.delay_ms)
    meta["goodput"] = netlab.measure_goodput(lab, rate, tmp)
    log.info("%g Mbit/s: measured goodput %.1f Mbit/s", rate, meta["goodput"]["mbit_per_s"])
    started = time.perf_counter()
    record = run_workers(lab, args, args.configs, args.rounds, 29502, tmp, "steps")
    meta["wall_seconds"] = time.perf_counter() - started
    meta["loadavg_end"] = os.getloadavg()
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


def builtin_powersgd_note(rows: Sequence[dict[str, Any]]) -> list[str]:
    """A line saying how many buckets the built-in ``powerSGD_hook`` ran with, when timed."""
    got = {r["config"]: r["buckets"] for r in rows}
    if "torch-powersgd-r4" not in got:
        return []
    return [f"torch-powersgd-r4 ran on {got['torch-powersgd-r4']} bucket(s) (others: "
            f"{got.get('ddp')}): PyTorch's powerSGD_hook chains its all-reduces in future "
            "callbacks and fails on gloo with several buckets"]


def report(doc: dict[str, Any]) -> str:
    """The text printed and written beside the JSON: setup lines, table, verdicts."""
    m, cc = doc["meta"], doc["meta"]["comm_compute"]

    def ratio(x: float | None) -> str:
        return f"{x:.2f} : 1" if x is not None else "-"

    load = f"{m['loadavg_start'][0]:.2f} at the start, {m['loadavg_end'][0]:.2f} at the end"
    sync = m["sync_keyword"] or "none (the hook has one mode)"
    lines = [
        f"link: {m['bandwidth_mbit']:g} Mbit/s each way, measured goodput "
        f"{m['goodput']['mbit_per_s']:.0f} Mbit/s; {m['world']} workers; model "
        f"{m['params'] / 1e6:.2f} M parameters ({m['grad_bytes'] / 1e6:.1f} MB of fp32 gradient)",
        f"comm : compute of a dense step: {ratio(cc['ratio'])} measured ({cc['dense_config']} "
        f"minus the floor, over the floor); {ratio(cc['allreduce_alone_ratio'])} for a dense "
        f"all-reduce alone; {ratio(cc['line_rate_ratio'])} at line rate",
        f"load average: {load}; gradzip synchronous-mode keyword: {sync}",
        f"{m['rounds']} rounds of {m['steps']} steps per configuration (order rotating); a "
        "step is the slowest rank's; ratios are medians of per-round ratios",
        *builtin_powersgd_note(doc["rows"]),
        "",
        markdown_table(doc["rows"]),
        "",
        *(verdict_line(v) for v in doc["verdicts"]),
    ]
    return "\n".join(lines)


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
    p.add_argument("--configs", nargs="+", default=list(worker.CONFIGS), choices=worker.CONFIGS)
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
    with launch.recorded_lab(args.workers, args.subnet) as (lab, cmds):
        if args.bandwidth_mbit == "auto":
            cmds.append(netlab.netns_exec(lab.names[0], worker_argv(args, ["floor"],
                                                                    args.probe_rounds, "PROBE")))
        lab.shape(1000.0 if args.bandwidth_mbit == "auto" else args.bandwidth_mbit,
                  args.delay_ms)
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
