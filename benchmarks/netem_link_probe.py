"""What ``auto``'s link probe reads over emulated links, against the link's measured goodput.

Builds the lab of ``benchmarks/_netlab.py`` and, for each ``--bandwidth-mbit``, shapes it,
measures the goodput of one TCP stream (about a second of bytes), and runs two gloo workers
that probe the link as :class:`gradzip.Auto` does at each decision
(:func:`gradzip.plan.measure.probe_link`, with ``--compute-ms`` of sleep before each probe so
the link is idle as in training, the tensors' dense size of the LM transformer of
``outer_netem.py`` as the probe's limit). From the maxima of each probe's times over the two
ranks (what a decision reads) it fits the link twice:

* ``grown``: the probe as it is, the bandwidth from the slope between its two largest messages;
* ``fixed``: from the one-float call and the first 64 KiB message alone, as the probe read
  the link before its message grew.

The gap between the two, against the goodput, is what the growing probe fixes: a 64 KiB
message fits inside a fast link's token-bucket burst (2 ms of the rate here, at least 32 KiB)
and costs no more than one float there::

    sudo python -m benchmarks.netem_link_probe --bandwidth-mbit 1000 150 40 10 \\
        --out benchmarks/results/netem_link_probe.json
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
#: The LM transformer's dense fp32 gradient, bytes (``netem_rtt_probe.LM_DENSE_BYTES``: the
#: exchange between 2 workers sends it once).
DENSE_BYTES = 4_086_556
PROBE_BYTES = 1 << 16


# --------------------------------------------------------------------------- the worker


def probe_rounds(rounds: int, compute_s: float) -> tuple[list[list[list[float]]], list[float]]:
    """``rounds`` probes, each after ``compute_s`` of sleep: per probe, its calls'
    ``[wire bytes, seconds]`` with the seconds the maxima over the ranks, and the seconds the
    whole probe took (the maximum over the ranks: the calls it returns leave out a repeated
    message and the maxima it takes)."""
    import torch

    from gradzip.comm.torch_dist import ProcessGroupCollective
    from gradzip.plan.measure import max_over_ranks, probe_link

    comm = ProcessGroupCollective()
    cpu = torch.device("cpu")
    out, spent = [], []
    for _ in range(rounds):
        time.sleep(compute_s)
        start = time.perf_counter()
        calls = probe_link(comm, PROBE_BYTES, time.perf_counter, cpu, limit_bytes=DENSE_BYTES)
        seconds = time.perf_counter() - start
        *most, whole = max_over_ranks(comm, [*(t for _, t in calls), seconds], cpu)
        out.append([[float(w), t] for (w, _), t in zip(calls, most, strict=True)])
        spent.append(whole)
    return out, spent


def worker_main(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    probes, spent = probe_rounds(args.rounds, args.compute_ms / 1e3)
    dist.barrier()
    if dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps({"world": dist.get_world_size(),
                                                 "probes": probes, "probe_seconds": spent}))
    launch.exit_skipping_teardown()


# --------------------------------------------------------------------------- the launcher


def fits(probe: Sequence[Sequence[float]], world: int) -> dict[str, float]:
    """Both fits of one probe (``[[wire, seconds], ...]``, the one-float call first):
    bandwidth (Mbit/s) and rtt (ms) as the grown probe reads them and as the first two calls
    alone read them, the largest message and the probe's time."""
    from gradzip.plan.measure import fit_link, fit_probe

    hops = 2 * (world - 1)
    calls = [(int(w), float(t)) for w, t in probe]
    grown = fit_probe(calls, hops)  # as a decision reads it
    fixed = fit_link(calls[0], calls[1], hops)
    return {"grown_mbit": grown[0], "grown_rtt_ms": grown[1], "fixed_mbit": fixed[0],
            "fixed_rtt_ms": fixed[1], "largest_bytes": calls[-1][0],
            "probe_ms": 1e3 * sum(t for _, t in calls)}


def summarise(rate_mbit: float, goodput_mbit: float, record: dict[str, Any]) -> dict[str, Any]:
    """One link's row: medians (and ranges) over the probes of both fits."""
    each = [fits(p, record["world"]) for p in record["probes"]]
    for e, seconds in zip(each, record.get("probe_seconds", []), strict=False):
        e["probe_ms"] = 1e3 * seconds  # the whole probe, where it was timed
    row: dict[str, Any] = {"cap_mbit": rate_mbit, "goodput_mbit": goodput_mbit,
                           "probes": len(each)}
    for key in ("grown_mbit", "fixed_mbit", "grown_rtt_ms", "probe_ms", "largest_bytes"):
        values = [e[key] for e in each]
        row[key] = statistics.median(values)
        row[key + "_range"] = [min(values), max(values)]
    for key in ("grown", "fixed"):
        row[key + "_over_goodput"] = row[key + "_mbit"] / goodput_mbit
    return row


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a Markdown table."""
    from gradzip.plan.measure import UNBOUNDED_MBIT

    out = ["| cap (Mbit/s) | goodput | grown probe: bandwidth (range) | / goodput | "
           "64 KiB probe: bandwidth (range) | / goodput | largest message | probe time |",
           "|---|---|---|---|---|---|---|---|"]

    def mbit(v: float) -> str:
        return "unbounded" if v >= UNBOUNDED_MBIT else f"{v:,.0f}"

    for r in rows:
        g, f = r["grown_mbit_range"], r["fixed_mbit_range"]
        out.append(f"| {r['cap_mbit']:g} | {r['goodput_mbit']:.0f} | {mbit(r['grown_mbit'])} "
                   f"({mbit(g[0])}-{mbit(g[1])}) | {r['grown_over_goodput']:.2f} | "
                   f"{mbit(r['fixed_mbit'])} ({mbit(f[0])}-{mbit(f[1])}) | "
                   f"{r['fixed_over_goodput']:.2f} | {r['largest_bytes'] / 1024:,.0f} KiB | "
                   f"{r['probe_ms']:.1f} ms |")
    return "\n".join(out)


def benchmark(args: argparse.Namespace, lab: netlab.Lab, tmp: Path) -> int:
    rows = []
    load = os.getloadavg()
    for i, rate in enumerate(args.bandwidth_mbit):
        lab.shape(rate)
        goodput = launch.measure_goodput(lab, rate, tmp)
        argv = [*module_command("netem_link_probe"), "worker", "--rounds", str(args.rounds),
                "--compute-ms", f"{args.compute_ms:g}", "--result", str(tmp / f"p{i}.json")]
        problem = launch.run_workers(lab, argv, 29710 + i, tmp, f"p{i}", args.run_timeout)
        if problem is not None:
            tails = launch.format_tails(launch.rank_log_tails(tmp, f"p{i}", lab.workers))
            raise netlab.LabError(f"probe run at {rate:g} Mbit/s: {problem}\n{tails}")
        record = json.loads((tmp / f"p{i}.json").read_text())
        row = summarise(rate, float(goodput["mbit_per_s"]), record)
        rows.append({**row, "record": record, "goodput": goodput})
        print(f"{rate:g} Mbit/s: goodput {row['goodput_mbit']:.0f}, grown probe "
              f"{row['grown_mbit']:.0f}, 64 KiB probe {row['fixed_mbit']:.0f} Mbit/s "
              f"(probe {row['probe_ms']:.1f} ms)", flush=True)
    doc = {"meta": {"args": {k: (str(v) if isinstance(v, Path) else v)
                             for k, v in vars(args).items()},
                    "machine": netlab.machine_info(), "loadavg_start": load,
                    "loadavg_end": os.getloadavg()},
           "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    args.out.with_suffix(".md").write_text(table(rows) + "\n")
    print(table(rows))
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    launch.add_lab_arguments(p, workers=2, run_timeout=300.0,
                             out=HERE / "results" / "netem_link_probe.json")
    p.add_argument("--bandwidth-mbit", type=float, nargs="+", default=[1000.0, 150.0, 40.0, 10.0])
    p.add_argument("--rounds", type=int, default=10, help="probes per link")
    p.add_argument("--compute-ms", type=float, default=300.0, help="the sleep before each probe")
    return launch.parse_checked(p, argv, validate)


def validate(args: argparse.Namespace) -> list[str]:
    out = launch.validate_lab(args)
    for rate in args.bandwidth_mbit:
        if not 0 < rate <= 100_000:
            out.append(f"`--bandwidth-mbit` must be in (0, 100000], got {rate:g}")
    if args.compute_ms < 0:
        out.append(f"`--compute-ms` must be >= 0, got {args.compute_ms:g}")
    out += launch.bound_problems(args, at_least_one=("rounds",))
    return out


def dry_run(args: argparse.Namespace) -> list[list[str]]:
    with launch.recorded_lab(args.workers, args.subnet, args.rtt_ms) as (lab, cmds):
        for rate in args.bandwidth_mbit:
            lab.shape(rate)
            cmds.append(netlab.netns_exec(lab.names[0], [*module_command("netem_link_probe"),
                                                         "worker", "..."]))
    return cmds


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        p = argparse.ArgumentParser()
        p.add_argument("--rounds", type=int, required=True)
        p.add_argument("--compute-ms", type=float, required=True)
        p.add_argument("--result", required=True)
        return worker_main(p.parse_args(argv[1:]))
    return launch.main_with_lab(parse_args(argv), prog="netem_link_probe.py",
                                tmp_prefix="gz-link-probe-", dry_run=dry_run, body=benchmark)


if __name__ == "__main__":
    sys.exit(main())
