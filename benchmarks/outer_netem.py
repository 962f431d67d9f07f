"""Outer-step training against per-step averaging over an emulated slow link: time to a target
validation perplexity.

Builds the lab of ``benchmarks/_netlab.py`` (one network namespace per worker, a bridge, every
link capped in both directions with ``tc`` tbf; that module says what it touches and how it
cleans up) and runs ``gradzip train --launcher procs`` in each namespace as a torchrun-style
worker (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``... : gloo over the shaped
links), once per (bandwidth, method). The task and options are ``benchmarks/outer.py``'s
(the small transformer on a WikiText-2 corpus, inner AdamW); the methods are per-step
``none`` and Top-k 1% with error feedback, DiLoCo fp32 and 8-bit at H = 30 and the
SparseLoCo mode.

The runner evaluates every ``--eval-every`` steps for per-step methods and every H steps
(at the synchronisations, where every worker holds the same parameters) for outer modes; its
records carry ``train_seconds``, the seconds of training so far with evaluations left out.
Time to target is the ``train_seconds`` of the first evaluation at or below ``--target``.
With ``--stop-at-target`` a run is stopped once rank 0 has written that evaluation.
``--rtt-ms R`` adds a round trip of R ms between the workers (the lab's delay line,
``benchmarks/netem_delay.py``); ``--limit-train N`` trains on the first N tokens only, for
short runs that time steps (``benchmarks/netem_rtt.py`` reads them).

Needs root; ``--dry-run`` prints the commands as any user. Example (BENCHMARKS.md, section 5)::

    python -m benchmarks.outer_netem --source /tmp/wt2/wikitext-2-partial \\
        --corpus /tmp/onetem/corpus --runs /tmp/onetem/runs --bandwidth-mbit 40 150 \\
        --target 650 --stop-at-target --out benchmarks/results/outer_netem.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import _netlab as netlab
from . import _netlab_launch as launch
from . import outer
from ._outer_netem_report import markdown, summarize, write_outputs

HERE = Path(__file__).resolve().parent
log = logging.getLogger("outer_netem")

#: Method key -> (label, ``gradzip train`` options, H: 0 for per-step methods).
METHODS: dict[str, tuple[str, dict[str, Any], int]] = {
    c.key: (c.label, c.options, int(c.options.get("outer-steps", 0)))
    for c in outer.CONFIGS if c.key != "diloco100"
}
METHODS["powersgd4"] = ("per-step PowerSGD r4", {"compressor": "powersgd:rank=4"}, 0)
# DiLoCo with the outer settings gradzip now takes from H (``gradzip.outer_defaults``).
METHODS["diloco30-default"] = ("DiLoCo fp32 H=30, default outer", {"outer-steps": 30}, 30)
# ... and with the 8-bit exchange (error feedback), the other exchange ``--auto-outer`` weighs.
METHODS["diloco30-8bit-default"] = ("DiLoCo 8-bit H=30, default outer",
                                    {"outer-steps": 30, "compressor": "scatterq:bits=8"}, 30)
# The candidate ``auto`` takes on a fast link (150 Mbit/s), run as a static configuration.
METHODS["diloco10-8bit-default"] = ("DiLoCo 8-bit H=10, default outer",
                                    {"outer-steps": 10, "compressor": "scatterq:bits=8"}, 10)
# gradzip choosing the per-step level itself (``gradzip.Auto``, its default levels and every);
# ``auto10`` decides every 10 steps instead of 50, to follow a link that changes within a run;
METHODS["auto"] = ("per-step auto", {"compressor": "auto"}, 0)
METHODS["auto10"] = ("per-step auto, every 10", {"compressor": "auto(every=10)"}, 0)
# ... and its first decision at step 1 (by the link alone: no step has been timed yet), so a
# slow link does not carry the first level's traffic for the warm-up steps.
METHODS["autof"] = ("per-step auto, from step 1, every 10",
                    {"compressor": "auto(warmup=1,every=10)"}, 0)
# auto deciding every 10 steps, and leaving per-step communication for DiLoCo once a steady
# decision predicts outer steps faster (``--auto-outer``; H among 10, 30, 100).
METHODS["auto-outer10"] = ("auto every 10, then outer steps",
                           {"compressor": "auto(every=10)", "auto-outer": True}, 0)
# ... with H = 10 or 30 only (H = 100 synchronises too rarely for an early target).
METHODS["auto-outer10-h30"] = ("auto every 10, then outer steps, H <= 30",
                               {"compressor": "auto(every=10)", "auto-outer": True,
                                "auto-outer-steps": "10,30"}, 0)
# ... and its first decision at step 1 (as ``autof``).
METHODS["autof-outer-h30"] = ("auto from step 1, every 10, then outer steps, H <= 30",
                              {"compressor": "auto(warmup=1,every=10)", "auto-outer": True,
                               "auto-outer-steps": "10,30"}, 0)
# ... and that first decision allowed to switch (``--auto-outer-early``): outer steps from
# step 1 where the probed link says they pay, as DiLoCo runs from the start.
METHODS["autoe-outer-h30"] = ("auto from step 1, outer steps allowed at once, H <= 30",
                              {"compressor": "auto(warmup=1,every=10)", "auto-outer": True,
                               "auto-outer-early": True, "auto-outer-steps": "10,30"}, 0)
METHODS["autoe-outer"] = ("auto from step 1, outer steps allowed at once",
                          {"compressor": "auto(warmup=1,every=10)", "auto-outer": True,
                           "auto-outer-early": True}, 0)
# ... deciding before the first step (``warmup=0``: from the probed link alone).
# With the default exchanges (dense and 8-bit at each H); ``-dense`` weighs the dense one only,
# as every revision before the 8-bit exchange was weighed.
METHODS["autoe0-outer-h30"] = ("auto before step 0, outer steps allowed at once, H <= 30, "
                               "dense or 8-bit exchange",
                               {"compressor": "auto(warmup=0,every=10)", "auto-outer": True,
                                "auto-outer-early": True, "auto-outer-steps": "10,30"}, 0)
METHODS["autoe0-outer-h30-dense"] = ("auto before step 0, outer steps allowed at once, H <= 30, "
                                     "dense exchange",
                                     {"compressor": "auto(warmup=0,every=10)",
                                      "auto-outer": True, "auto-outer-early": True,
                                      "auto-outer-steps": "10,30", "auto-outer-exchange": "none"},
                                     0)
METHODS["autoe0-outer-h30-follow"] = ("auto before step 0, outer steps allowed at once, H <= 30, "
                                      "dense or 8-bit exchange, following the link",
                                      {"compressor": "auto(warmup=0,every=10)",
                                       "auto-outer": True, "auto-outer-early": True,
                                       "auto-outer-steps": "10,30", "auto-outer-follow": True},
                                      0)
DEFAULT_METHODS = ["none", "topk1", "diloco30", "diloco30-8bit", "sparseloco30"]


def train_argv(args: argparse.Namespace, method: str, out: Path) -> list[str]:
    """The ``gradzip train`` command of one worker (every rank runs the same).

    Args:
        args: the launcher's options (``workers``, ``epochs``, ``eval_every``, ``corpus``,
            ``seed``).
        method: a key of :data:`METHODS`.
        out: the run directory (rank 0 writes ``metrics.jsonl`` there).

    Returns:
        The argument list, starting with the Python interpreter.
    """
    _, options, h = METHODS[method]
    # Checkpoints are off: in a process group saving one is a collective, and its traffic
    # and time would count as training. An outer mode is evaluated at its synchronisations.
    overrides = {"launcher": "procs", "workers": args.workers, "epochs": args.epochs,
                 "checkpoint-every": 0, "eval-every": h or args.eval_every}
    if args.limit_train:  # short step-time runs: the first N training tokens only
        overrides["limit-train"] = args.limit_train
    cfg = outer.Config(method, METHODS[method][0], options)
    argv = outer.command(cfg, args.seed, args.corpus, out, overrides)
    if "auto-outer" in options:  # its decision lines (logged at INFO) go to the rank's log
        at = argv.index("train")
        argv = [*argv[:at], "-v", *argv[at:]]
    return argv


def target_reached(metrics: Path, target: float) -> bool:
    """Whether ``metrics`` (a run's ``metrics.jsonl``) holds an evaluation at or below
    ``target`` perplexity (a partly written last line is ignored)."""
    try:
        lines = metrics.read_text(encoding="utf-8").splitlines()
    except OSError:
        return False
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("kind") in ("eval", "epoch") and rec.get("perplexity", float("inf")) <= target:
            return True
    return False


def kernel_tx(lab: netlab.Lab) -> list[int]:
    """Each worker link's kernel count of bytes sent so far."""
    return [int(netlab.run_command(netlab.netns_exec(
        ns, ["cat", f"/sys/class/net/{netlab.WORKER_IFNAME}/statistics/tx_bytes"])))
        for ns in lab.names]


def run_one(lab: netlab.Lab, args: argparse.Namespace, rate: float, method: str, port: int,
            tmp: Path, changes: Sequence[tuple[float, float]] = (),
            tag: str | None = None) -> dict[str, Any]:
    """Train one method over the current shaping; the run's evaluation records and counters.

    Args:
        lab, args, rate, method, port, tmp: the lab, the launcher's options, the link's rate
            (Mbit/s, already shaped), a key of :data:`METHODS`, the rendezvous port, and the
            directory of the ranks' logs.
        changes: ``(seconds, rate)`` pairs, in order: at ``seconds`` after the workers are
            started the links' rate becomes ``rate`` (:meth:`~benchmarks._netlab.Lab.change_rate`).
            The caller restores the first rate before the next run.
        tag: the run directory's name under ``args.runs`` (``<method>-<rate>mbit`` by default).
    """
    tag = tag or f"{method}-{rate:g}mbit"
    out = args.runs / tag
    if out.exists():
        raise netlab.LabError(f"`--runs` must not hold {tag} already, got {str(args.runs)!r}")
    argv = train_argv(args, method, out)
    before, load_before = kernel_tx(lab), os.getloadavg()
    started = time.perf_counter()
    procs = [netlab.spawn(netlab.netns_exec(ns, argv), _env(lab, port, rank),
                          tmp / f"{tag}-rank{rank}.log") for rank, ns in enumerate(lab.names)]
    pending, applied = list(changes), []

    def stop() -> bool:
        # The link changes on the wall clock of the run, whatever the method is doing: polled
        # here, every 0.2 s, so a change lands within 0.2 s of its time.
        while pending and time.perf_counter() - started >= pending[0][0]:
            at, new_rate = pending.pop(0)
            lab.change_rate(new_rate)
            applied.append({"seconds": round(time.perf_counter() - started, 3),
                            "planned_seconds": at, "rate_mbit": new_rate})
        return args.stop_at_target and target_reached(out / "metrics.jsonl", args.target)

    problem = netlab.wait_all(procs, args.run_timeout, stop=stop, poll=0.2, grace=1.0)
    wall = time.perf_counter() - started
    record: dict[str, Any] = {
        "method": method, "label": METHODS[method][0], "bandwidth_mbit": rate,
        "outer_steps": METHODS[method][2], "command": argv, "wall_seconds": wall,
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
        "kernel_tx_bytes": [a - b for a, b in zip(kernel_tx(lab), before, strict=True)],
        "stopped_at_target": problem == "stopped",
    }
    if changes:
        record["link_changes"] = applied
    if problem not in (None, "stopped"):
        tails = launch.rank_log_tails(tmp, tag, lab.workers)
        log.error("%s: %s\n%s", tag, problem, launch.format_tails(tails))
        return {**record, "error": problem, "log_tails": tails}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    keep = ("kind", "step", "epoch", "perplexity", "train_seconds", "seconds", "eval_seconds",
            "wire_bytes", "rounds", "train_loss", "level", "level_steps", "outer_steps",
            "switched_at", "outer_since")
    record["evaluations"] = [{k: r[k] for k in keep if k in r} for r in rows
                             if r.get("kind") in ("eval", "epoch")]
    lines = decision_lines(tmp / f"{tag}-rank0.log")
    if lines:
        record["decision_lines"] = lines
    return record


def decision_lines(log_file: Path) -> list[str]:
    """The lines of a rank's log that state a decision of ``auto`` or ``--auto-outer``
    (from their message on; none when the log is missing)."""
    try:
        text = log_file.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    marks = ("auto-outer: ", "auto: step ")
    found = []
    for line in text.splitlines():
        at = min((line.find(m) for m in marks if m in line), default=-1)
        if at >= 0:
            found.append(line[at:])
    return found


def _env(lab: netlab.Lab, port: int, rank: int) -> dict[str, str]:
    # One worker per namespace, as one process per host under torchrun.
    env = launch.worker_env(lab.addresses[0], port, rank, lab.workers)
    env.update({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    return env


def benchmark(args: argparse.Namespace, lab: netlab.Lab, tmp: Path) -> int:
    """Every (bandwidth, method) run; writes the JSON and the Markdown table."""
    meta = start(args)
    runs, port = [], 29600
    for rate in args.bandwidth_mbit:
        lab.shape(rate)
        meta["goodput"][f"{rate:g}"] = launch.measure_goodput(lab, rate, tmp)
        meta["rtt"][f"{rate:g}"] = launch.measure_rtt(lab, tmp)
        for method in args.methods:
            port += 1
            record = run_one(lab, args, rate, method, port, tmp)
            runs.append(record)
            row = summarize(record, args.target)
            log.info("%g Mbit/s %-14s %s", rate, method, row.get("error") or (
                f"{row['seconds_per_step']:.3f} s/step, target at {row['seconds_to_target']} s "
                f"(step {row['steps_to_target']}), {record['wall_seconds']:.0f} s wall, "
                f"load {record['loadavg_after'][0]:.1f}"))
    meta["loadavg_end"] = os.getloadavg()
    meta["delay_line"] = launch.delay_stats(tmp)
    doc = write_outputs(args.out, meta, runs, args.target)
    print(markdown(doc))
    return 1 if any("error" in r for r in runs) else 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The launcher's options (those of the lab, the runs and the target)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    launch.add_lab_arguments(p, workers=4, run_timeout=1800.0,
                             out=HERE / "results" / "outer_netem.json")
    p.add_argument("--bandwidth-mbit", type=float, nargs="+", default=[40.0, 150.0])
    add_task_arguments(p, methods=DEFAULT_METHODS, scratch=Path("/tmp/onetem"), target=650.0)
    p.add_argument("--seed", type=int, default=0)
    return launch.parse_checked(p, argv, validate)


def add_task_arguments(p: argparse.ArgumentParser, *, methods: list[str], scratch: Path,
                       target: float) -> None:
    """The options of the runs shared with ``auto_netem``: the methods, the task (corpus,
    epochs, evaluations) and the target."""
    p.add_argument("--methods", nargs="+", default=methods, help=f"among {', '.join(METHODS)}")
    p.add_argument("--corpus", type=Path, default=scratch / "corpus",
                   help="directory with a *train* and a *valid* text file")
    p.add_argument("--source", type=Path, default=None,
                   help="WikiText-2 directory to build --corpus from (benchmarks/outer.py)")
    p.add_argument("--valid-words", type=int, default=50_000)
    p.add_argument("--runs", type=Path, default=scratch / "runs",
                   help="parent of the run directories (each must not exist yet)")
    p.add_argument("--epochs", type=int, default=int(outer.BASE["epochs"]))
    p.add_argument("--limit-train", type=int, default=0,
                   help="train on the first N tokens only (0: all); for short step-time runs")
    p.add_argument("--eval-every", type=int, default=10,
                   help="steps between evaluations of per-step methods (outer modes: H)")
    p.add_argument("--target", type=float, default=target, help="validation perplexity")
    p.add_argument("--stop-at-target", action="store_true",
                   help="stop a run once it has reached the target")


def task_problems(args: argparse.Namespace) -> list[str]:
    """Problems with the options :func:`add_task_arguments` adds, as ``"`name` must ..., got
    ..."`` messages."""
    out = []
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        out.append(f"`--methods` entries must be among {', '.join(METHODS)}, got {unknown}")
    if len(set(args.methods)) != len(args.methods):
        out.append(f"`--methods` must not repeat, got {args.methods}")
    if not args.target > 1:
        out.append(f"`--target` must be > 1 (a perplexity), got {args.target:g}")
    out += launch.bound_problems(args, at_least_one=("epochs", "eval_every", "valid_words"))
    if args.limit_train < 0:
        out.append(f"`--limit-train` must be >= 0, got {args.limit_train}")
    return out


def start(args: argparse.Namespace) -> dict[str, Any]:
    """Build the corpus (with ``--source``), make the runs' parent, and return the
    benchmark's meta record as it starts (the arguments, the machine, the load)."""
    if args.source is not None:
        outer.build_corpus(args.source, args.corpus, args.valid_words)
    args.runs.mkdir(parents=True, exist_ok=True)
    return {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "base": outer.BASE, "machine": netlab.machine_info(), "goodput": {}, "rtt": {},
            "loadavg_start": os.getloadavg(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


def validate(args: argparse.Namespace) -> list[str]:
    """Problems with the arguments, as ``"`name` must ..., got ..."`` messages."""
    out = launch.validate_lab(args)
    if any(not 0 < b <= 100_000 for b in args.bandwidth_mbit):
        out.append(f"`--bandwidth-mbit` values must be in (0, 100000], got {args.bandwidth_mbit}")
    out += task_problems(args)
    if args.seed < 0:
        out.append(f"`--seed` must be >= 0, got {args.seed}")
    return out


def dry_run(args: argparse.Namespace) -> list[list[str]]:
    """Every command a real run would issue, in order (workers shown for rank 0 only)."""
    with launch.recorded_lab(args.workers, args.subnet, args.rtt_ms) as (lab, cmds):
        for rate in args.bandwidth_mbit:
            lab.shape(rate)
            for method in args.methods:
                out = args.runs / f"{method}-{rate:g}mbit"
                cmds.append(netlab.netns_exec(lab.names[0], train_argv(args, method, out)))
    return cmds


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (or its dry run) on a lab that is deleted whatever happens."""
    return launch.main_with_lab(parse_args(argv), prog="outer_netem.py",
                                tmp_prefix="gz-outer-netem-", dry_run=dry_run, body=benchmark)


if __name__ == "__main__":
    sys.exit(main())
