"""What the netem launchers and their workers share around the lab of ``_netlab.py``.

The launchers (``benchmarks/netem.py``, ``benchmarks/netem_steps.py``) take the same lab
options, validate them the same way, print the same dry run, and wrap their benchmark in
:func:`main_with_lab` (rights, stale cleanup, teardown on every exit); both start one worker
per namespace and show the ranks' log tails on failure. The workers (``netem_worker.py``,
``netem_steps_worker.py``) declare the options they take from their launcher, read the link's
byte counter and exit without the interpreter's teardown.

Lab functions are called through the module (``netlab.check_rights``), not imported by name,
so that the one definition in ``_netlab.py`` is the one that runs (tests replace it there).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from . import _netlab as netlab
from . import netem_delay as delay
from ._common import module_command, package_env

#: The largest round trip ``--rtt-ms`` takes, ms.
MAX_RTT_MS = 2000.0

# --------------------------------------------------------------------------- starting workers


def worker_env(master: str, port: int, rank: int, world: int) -> dict[str, str]:
    """Environment of one worker: the process-group rendezvous on worker 0's address."""
    env = package_env()  # the worker runs as ``python -m benchmarks.<worker>``
    env.update({"MASTER_ADDR": master, "MASTER_PORT": str(port), "RANK": str(rank),
                "WORLD_SIZE": str(world), "GLOO_SOCKET_IFNAME": netlab.WORKER_IFNAME,
                "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    return env


def run_workers(lab: netlab.Lab, argv: Sequence[str], port: int, tmp: Path, tag: str,
                timeout: float) -> str | None:
    """Run ``argv`` once in every worker namespace (rank ``i`` in the ``i``-th) and wait.

    Each rank's output goes to ``tmp/<tag>-rank<i>.log`` (see :func:`rank_log_tails`).

    Returns:
        ``None`` when every rank exited 0, else what went wrong (:func:`_netlab.wait_all`).
    """
    procs = [netlab.spawn(netlab.netns_exec(ns, argv),
                          worker_env(lab.addresses[0], port, rank, lab.workers),
                          tmp / f"{tag}-rank{rank}.log")
             for rank, ns in enumerate(lab.names)]
    return netlab.wait_all(procs, timeout)


def rank_log_tails(tmp: Path, tag: str, workers: int) -> list[str]:
    """The last 1500 characters of each rank's log of the run ``tag``."""
    return [(tmp / f"{tag}-rank{r}.log").read_text()[-1500:] for r in range(workers)]


def format_tails(tails: Sequence[str]) -> str:
    """Rank logs one after the other, each under a ``--- rank <i> ---`` line."""
    return "\n".join(f"--- rank {r} ---\n{t}" for r, t in enumerate(tails))


# --------------------------------------------------------------------------- in the workers


def tx_bytes() -> int:
    """Bytes this namespace's link has sent so far (kernel counter, TCP/IP headers included);
    -1 where the interface is not there (outside the lab's namespaces)."""
    path = Path("/sys/class/net") / os.environ.get("GLOO_SOCKET_IFNAME", "eth0") / "statistics"
    try:
        return int((path / "tx_bytes").read_text())
    except OSError:
        return -1


def exit_skipping_teardown() -> NoReturn:
    """End a worker whose results are written and whose ranks all passed a final barrier."""
    # Exiting through the interpreter's teardown (or destroy_process_group) lets gloo's I/O
    # threads race with destructors, which now and then aborts a rank with "terminate called
    # without an active exception"; skip that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --------------------------------------------------------------------------- the launchers

#: An option a launcher takes and passes on to its worker as it is: (flag, type, default, help).
#: The worker declares it; both parsers and the launcher's command line come from it.
Option = tuple[str, type, Any, str | None]


def add_options(p: argparse.ArgumentParser, options: Sequence[Option]) -> None:
    """Declare ``options`` on ``p`` (the launcher's parser or this worker's)."""
    for flag, kind, default, help_text in options:
        p.add_argument(flag, type=kind, default=default, help=help_text)


def option_argv(args: argparse.Namespace, options: Sequence[Option],
                overrides: Mapping[str, float] | None = None) -> list[str]:
    """The words passing ``options`` on with the values in ``args`` (floats as ``%g``).

    Args:
        args: the launcher's parsed options.
        options: which to pass, in order.
        overrides: values taking the place of ``args``' (keyed by the attribute name).

    Returns:
        e.g. ``["--eta", "0.3", "--interval", "22"]``.
    """
    words = []
    for flag, kind, _, _ in options:
        name = flag[2:].replace("-", "_")
        value = kind((overrides or {}).get(name, getattr(args, name)))
        words += [flag, f"{value:g}" if kind is float else str(value)]
    return words


def add_lab_arguments(p: argparse.ArgumentParser, *, workers: int, run_timeout: float,
                      out: Path) -> None:
    """The options every launcher takes: workers, subnet, delay, the time a worker run may
    take, the output file, dry run, cleanup, verbosity."""
    p.add_argument("--workers", type=int, default=workers)
    p.add_argument("--subnet", default="10.77.0.0/24")
    p.add_argument("--rtt-ms", type=float, default=0.0,
                   help="round trip added between any two workers, ms (half each way, in a "
                        "user-space delay line the hub routes every packet through; "
                        "benchmarks/netem_delay.py)")
    p.add_argument("--run-timeout", type=float, default=run_timeout,
                   help="seconds per worker run")
    p.add_argument("--out", type=Path, default=out)
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--cleanup-stale", action="store_true",
                   help="delete namespaces left by a killed run of this script, then exit")
    p.add_argument("-v", "--verbose", action="store_true")


def parse_checked(p: argparse.ArgumentParser, argv: Sequence[str] | None,
                  validate: Callable[[argparse.Namespace], list[str]]) -> argparse.Namespace:
    """Parse ``argv``; exit with status 2 and every problem ``validate`` finds, if any."""
    args = p.parse_args(argv)
    problems = validate(args)
    if problems:
        p.error("; ".join(problems))
    return args


def bound_problems(args: argparse.Namespace, *, positive: Sequence[str] = (),
                   at_least_one: Sequence[str] = ()) -> list[str]:
    """``"`--name` must be > 0, got ..."`` for each of ``positive`` that is not, and ``">= 1"``
    likewise for the counts in ``at_least_one`` (attribute names of ``args``)."""
    out = []
    for name in positive:
        if not getattr(args, name) > 0:
            out.append(f"`--{name.replace('_', '-')}` must be > 0, got {getattr(args, name):g}")
    for name in at_least_one:
        if getattr(args, name) < 1:
            out.append(f"`--{name.replace('_', '-')}` must be >= 1, got {getattr(args, name)}")
    return out


def validate_lab(args: argparse.Namespace) -> list[str]:
    """Problems with the options of :func:`add_lab_arguments`, as ``"`name` must ..., got ..."``
    messages."""
    out = []
    if not 2 <= args.workers <= 64:
        out.append(f"`--workers` must be in [2, 64], got {args.workers}")
    if not 0 <= args.rtt_ms <= MAX_RTT_MS:
        out.append(f"`--rtt-ms` must be in [0, {MAX_RTT_MS:g}], got {args.rtt_ms:g}")
    out += bound_problems(args, positive=("run_timeout",))
    try:
        netlab.worker_addresses(args.subnet, max(args.workers, 1))
        if args.rtt_ms > 0:
            delay.hub_address(args.subnet, max(args.workers, 1))
    except ValueError as exc:
        out.append(str(exc))
    return out


@contextlib.contextmanager
def recorded_lab(workers: int, subnet: str,
                 rtt_ms: float = 0.0) -> Iterator[tuple[netlab.Lab, list[list[str]]]]:
    """A lab that records its commands instead of running them (``--dry-run``): yields it,
    created (and its delay line started, with ``rtt_ms`` > 0), with the list of commands so
    far; destroys it on leaving."""
    cmds: list[list[str]] = []

    def record(argv: Sequence[str]) -> str:
        cmds.append(list(argv))
        return ""

    lab = netlab.Lab(workers, subnet, runner=record, rtt_ms=rtt_ms)
    lab.create()
    if rtt_ms > 0:
        cmds.append(lab.delay_command(Path("READY"), Path("STATS")))
    yield lab, cmds
    lab.destroy()


# --------------------------------------------------------------------------- the delay line


def start_delay(lab: netlab.Lab, tmp: Path, timeout: float = 30.0) -> None:
    """Start the lab's delay line in the hub (it runs until the cleanup kills it) and wait
    until it holds its TUN device; nothing to do when ``lab.rtt_ms`` is 0.

    Raises:
        netlab.LabError: it exited or did not attach within ``timeout`` seconds.
    """
    if not lab.rtt_ms:
        return
    ready, log_path = tmp / "delay.ready", tmp / "delay.log"
    proc = netlab.spawn(lab.delay_command(ready, tmp / "delay.json"), package_env(), log_path)
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise netlab.LabError(f"the delay line did not start: {log_path.read_text()[-800:]}")
        time.sleep(0.05)


def delay_stats(tmp: Path) -> dict[str, Any] | None:
    """The delay line's latest record (packets, backlog, lateness), if it wrote one."""
    path = tmp / "delay.json"
    return json.loads(path.read_text()) if path.exists() else None


def measure_goodput(lab: netlab.Lab, rate_mbit: float, tmp: Path) -> dict[str, Any]:
    """Send about a second's worth of bytes from worker 1 to worker 0 over the shaped path."""
    count = max(1 << 20, int(rate_mbit * 1e6 / 8))
    where = f"{lab.addresses[0]}:29400"
    # netem_worker's goodput-recv / goodput-send modes check what a shaped link delivers.
    worker = module_command("netem_worker")
    recv = netlab.spawn(netlab.netns_exec(lab.names[0], [*worker, "goodput-recv", "--bind", where,
                                                         "--bytes", str(count)]),
                        package_env(), tmp / "goodput-recv.log")
    send = netlab.spawn(netlab.netns_exec(lab.names[1], [*worker, "goodput-send", "--to", where,
                                                         "--bytes", str(count)]),
                        package_env(), tmp / "goodput-send.log")
    problem = netlab.wait_all([recv, send], timeout=60)
    if problem:
        raise netlab.LabError(f"goodput check {problem}: {(tmp / 'goodput-recv.log').read_text()[-500:]}")
    lines = (tmp / "goodput-recv.log").read_text().splitlines()
    return json.loads(lines[-1])


def measure_rtt(lab: netlab.Lab, tmp: Path, count: int = 20) -> dict[str, Any]:
    """Time ``count`` small TCP request/reply round trips from worker 1 to worker 0."""
    where = f"{lab.addresses[0]}:29399"
    echo = netlab.spawn(netlab.netns_exec(lab.names[0], [*module_command("netem_delay"),
                                                         "rtt-echo", "--bind", where,
                                                         "--count", str(count)]),
                        package_env(), tmp / "rtt-echo.log")
    ping = netlab.spawn(netlab.netns_exec(lab.names[1], [*module_command("netem_delay"),
                                                         "rtt-ping", "--to", where,
                                                         "--count", str(count)]),
                        package_env(), tmp / "rtt-ping.log")
    problem = netlab.wait_all([echo, ping], timeout=60)
    if problem:
        raise netlab.LabError(f"round-trip check {problem}: {(tmp / 'rtt-ping.log').read_text()[-500:]}")
    return json.loads((tmp / "rtt-ping.log").read_text().splitlines()[-1])


def main_with_lab(args: argparse.Namespace, *, prog: str, tmp_prefix: str,
                  dry_run: Callable[[argparse.Namespace], list[list[str]]],
                  body: Callable[[argparse.Namespace, netlab.Lab, Path], int]) -> int:
    """What a launcher's ``main`` does around its benchmark.

    Prints the dry run; or refuses without rights; or deletes stale namespaces; or creates
    the lab, runs ``body(args, lab, tmp)`` with a temporary folder and destroys the lab
    whatever happens (signals become :class:`_netlab.Interrupted`; the workers are killed first).

    Args:
        args: the parsed options (those of :func:`add_lab_arguments` among them).
        prog: the script's name, prefixed to its messages.
        tmp_prefix: prefix of the temporary folder.
        dry_run: every command a real run would issue.
        body: the benchmark on the created lab; returns the exit status.

    Returns:
        The exit status: ``body``'s, 2 without rights, 130 after a signal, 1 on a lab error
        or a failed cleanup.
    """
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.dry_run:
        for cmd in dry_run(args):
            print(" ".join(cmd))
        return 0
    try:
        netlab.check_rights()
    except netlab.RightsError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    if args.cleanup_stale:
        lab = netlab.Lab(args.workers, args.subnet)
        for ns in netlab.stale_namespaces(sorted(lab.existing()), netlab.pid_alive):
            netlab.run_command(["ip", "netns", "del", ns])
            print(f"deleted {ns}")
        return 0
    lab = netlab.Lab(args.workers, args.subnet, rtt_ms=args.rtt_ms)
    status = 1
    with tempfile.TemporaryDirectory(prefix=tmp_prefix) as tmp, netlab.signals_raise():
        try:
            lab.create()
            start_delay(lab, Path(tmp))
            status = body(args, lab, Path(tmp))
        except netlab.RightsError as exc:
            print(f"{prog}: {exc}", file=sys.stderr)
            status = 2
        except (netlab.LabError, netlab.Interrupted) as exc:
            print(f"{prog}: stopped: {exc}", file=sys.stderr)
            status = 130 if isinstance(exc, netlab.Interrupted) else 1
        finally:
            with netlab.signals_blocked():
                for proc in netlab.LIVE:
                    netlab.kill_group(proc, grace=1.0)
                errors = lab.destroy()
            if errors:
                print(f"{prog}: cleanup failed for: " + "; ".join(errors), file=sys.stderr)
                status = status or 1
    return status
