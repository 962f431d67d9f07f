"""``auto`` against every static configuration over emulated links: time to a target perplexity.

The lab and the runs are ``benchmarks/outer_netem.py``'s (one network namespace per worker,
links capped with ``tc`` tbf, ``gradzip train --launcher procs`` in each namespace as a
torchrun-style worker, the small transformer LM of ``benchmarks/outer.py``); this launcher
adds what the comparison needs:

* links that change during a run: ``--links 150,20@15,150@45`` starts every run at 150 Mbit/s,
  changes the cap to 20 Mbit/s 15 s after the workers start and back to 150 at 45 s
  (``tc qdisc change``, :meth:`~benchmarks._netlab.Lab.change_rate`); a plain number is a fixed
  link;
* several seeds, each a pass over every (link, method), so that load that drifts over the
  measurement is spread over all methods alike;
* the verdicts of :mod:`benchmarks._auto_netem_report`: per link, ``auto``'s time to the target
  against the best static method's and ``none``'s, and its perplexity against the static runs'.

Needs root; ``--dry-run`` prints the commands as any user. Example (BENCHMARKS.md, section 7)::

    python -m benchmarks.auto_netem --source /tmp/wt2/wikitext-2-partial \\
        --corpus /tmp/autonetem/corpus --runs /tmp/autonetem/runs --workers 2 \\
        --links 1000 150 40 10 150,20@15,150@45 --seeds 0 1 \\
        --methods none powersgd4 topk1 diloco30-default auto auto10 \\
        --target 800 --stop-at-target --out benchmarks/results/auto_netem.json
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import _netlab as netlab
from . import _netlab_launch as launch
from . import outer_netem
from ._auto_netem_report import markdown, write_outputs

HERE = Path(__file__).resolve().parent
log = logging.getLogger("auto_netem")

DEFAULT_METHODS = ["none", "powersgd4", "topk1", "diloco30-default", "auto", "auto10"]


def parse_link(text: str) -> tuple[float, list[tuple[float, float]]]:
    """``"150"`` -> ``(150.0, [])``; ``"150,20@15,150@45"`` -> ``(150.0, [(15.0, 20.0),
    (45.0, 150.0)])``: the first rate, then (seconds after the start, new rate) in order.

    Raises:
        ValueError: a malformed link, a rate outside (0, 100000] Mbit/s, or change times that
            are not > 0 and increasing.
    """
    first, *rest = text.split(",")
    try:
        rate = float(first)
        changes = [(float(t), float(r)) for r, _, t in (c.partition("@") for c in rest)]
    except ValueError:
        raise ValueError(f"`--links` entries must look like 150 or 150,20@15,150@45, "
                         f"got {text!r}") from None
    rates = [rate, *(r for _, r in changes)]
    times = [t for t, _ in changes]
    if any(not 0 < r <= 100_000 for r in rates):
        raise ValueError(f"`--links` rates must be in (0, 100000] Mbit/s, got {text!r}")
    if any(t <= 0 for t in times) or times != sorted(set(times)):
        raise ValueError(f"`--links` change times must be > 0 and increasing, got {text!r}")
    return rate, changes


def link_label(text: str) -> str:
    """A link's name in file names and tables: ``"150"``, ``"150-20@15-150@45"``."""
    return text.replace(",", "-")


def benchmark(args: argparse.Namespace, lab: netlab.Lab, tmp: Path) -> int:
    """Every (seed, link, method) run, in that nesting; writes the JSON and the Markdown."""
    meta = outer_netem.start(args)
    runs: list[dict[str, Any]] = []
    port = 29700
    for seed in args.seeds:
        for text in args.links:
            rate, changes = parse_link(text)
            label = link_label(text)
            lab.shape(rate)
            if label not in meta["goodput"]:  # the link's first rate, once per link
                meta["goodput"][label] = launch.measure_goodput(lab, rate, tmp)
                meta["rtt"][label] = launch.measure_rtt(lab, tmp)
            for method in args.methods:
                port += 1
                run_args = copy.copy(args)
                run_args.seed = seed
                tag = f"s{seed}-{method}-{label}"
                record = outer_netem.run_one(lab, run_args, rate, method, port, tmp,
                                             changes=changes, tag=tag)
                if changes:  # the next run starts from the first rate again
                    lab.change_rate(rate)
                record.update(seed=seed, link=label)
                runs.append(record)
                doc = write_outputs(args.out, meta, runs, args.target)  # partial results
                row = doc["rows"][-1]
                log.info("seed %d %s %-16s %s", seed, label, method, row.get("error") or (
                    f"target at {row['seconds_to_target']} s (step {row['steps_to_target']}), "
                    f"{record['wall_seconds']:.0f} s wall, "
                    f"load {record['loadavg_after'][0]:.1f}"))
    meta["loadavg_end"] = os.getloadavg()
    meta["delay_line"] = launch.delay_stats(tmp)
    doc = write_outputs(args.out, meta, runs, args.target)
    print(markdown(doc))
    return 1 if any("error" in r for r in runs) else 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The launcher's options: the lab's, the links, methods and seeds, the task, the target."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    launch.add_lab_arguments(p, workers=2, run_timeout=1200.0,
                             out=HERE / "results" / "auto_netem.json")
    p.add_argument("--links", nargs="+", default=["1000", "150", "40", "10", "150,20@15,150@45"],
                   help="fixed rates (Mbit/s) or changing links such as 150,20@15,150@45")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    outer_netem.add_task_arguments(p, methods=DEFAULT_METHODS, scratch=Path("/tmp/autonetem"),
                                   target=800.0)
    return launch.parse_checked(p, argv, validate)


def validate(args: argparse.Namespace) -> list[str]:
    """Problems with the arguments, as ``"`name` must ..., got ..."`` messages."""
    out = launch.validate_lab(args)
    for text in args.links:
        try:
            parse_link(text)
        except ValueError as exc:
            out.append(str(exc))
    if len(set(args.links)) != len(args.links):
        out.append(f"`--links` must not repeat, got {args.links}")
    out += outer_netem.task_problems(args)
    if any(s < 0 for s in args.seeds) or len(set(args.seeds)) != len(args.seeds):
        out.append(f"`--seeds` must be distinct and >= 0, got {args.seeds}")
    return out


def dry_run(args: argparse.Namespace) -> list[list[str]]:
    """Every command a real run would issue, in order (workers shown for rank 0 only)."""
    with launch.recorded_lab(args.workers, args.subnet, args.rtt_ms) as (lab, cmds):
        for seed in args.seeds:
            for text in args.links:
                rate, changes = parse_link(text)
                lab.shape(rate)
                for method in args.methods:
                    run_args = copy.copy(args)
                    run_args.seed = seed
                    out = args.runs / f"s{seed}-{method}-{link_label(text)}"
                    cmds.append(netlab.netns_exec(
                        lab.names[0], outer_netem.train_argv(run_args, method, out)))
                    for _, new_rate in changes:
                        lab.change_rate(new_rate)
                    if changes:
                        lab.change_rate(rate)
    return cmds


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (or its dry run) on a lab that is deleted whatever happens."""
    return launch.main_with_lab(parse_args(argv), prog="auto_netem.py",
                                tmp_prefix="gz-auto-netem-", dry_run=dry_run, body=benchmark)


if __name__ == "__main__":
    sys.exit(main())
