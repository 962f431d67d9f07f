"""Benchmark over an emulated slow network: real gloo workers in network namespaces.

Builds one network namespace per worker and a hub namespace holding a bridge, joins each
worker to the bridge with a veth pair, caps every link in both directions with ``tc`` (``tbf``
for bandwidth; ``netem`` on each worker's egress for delay when ``--delay-ms`` > 0), then
trains with ``benchmarks/netem_worker.py`` in each namespace (gloo over TCP, DDP with the
gradzip comm hook) once per (bandwidth, method), and writes a JSON record and a CSV summary.

What it touches, and nothing else:

* namespaces named ``gzn<pid>-hub`` and ``gzn<pid>-w<i>``, created here (refused if the names
  exist already); links and addresses only inside them, from ``--subnet`` (10.77.0.0/24 by
  default). No namespace gets a default route, so no packet can leave them; the root
  namespace's interfaces, routes and qdiscs are never changed.
* every namespace it created is deleted on exit (normal end, error, timeout, SIGINT, SIGTERM,
  SIGHUP), which removes the veths and qdiscs inside. Worker processes are killed first.
  ``--cleanup-stale`` deletes namespaces of this naming scheme whose creating process is gone
  (after ``kill -9``).

Seconds per step of DDP hooks side by side over the same kind of link (native DDP, PyTorch's
hooks, gradzip's, the no-DDP floor) are ``benchmarks/netem_steps.py``, which reuses :class:`Lab`.

It needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and refuses with a message otherwise.
``--dry-run`` prints the commands it would run, as any user.

Example (the run behind BENCHMARKS.md section 3, about 18 minutes on 2 cores):
    sudo python benchmarks/netem.py --bandwidth-mbit 1000 150 40 \
        --methods none powersgd-r1 powersgd-r4 accordion accordion:eta=0.3 topk threshold \
        --out benchmarks/results/netem.json --plot benchmarks/results/netem.png

Step times side by side (a 4.2M-parameter model in 3 buckets; the no-DDP floor is each row's
``compute_seconds``, the dense communication time ``dense_comm_seconds_model``):
    sudo env PYTHONPATH=$PWD/src python benchmarks/netem.py --workers 2 --bandwidth-mbit 1000 \
        --width 176 --bucket-cap-mb 4 --epochs 5 --methods native none none:sync torch-fp16 \
        fp16 fp16:sync powersgd-r4 powersgd-r4:sync --out benchmarks/results/netem_steps.json
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import ipaddress
import json
import logging
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("netem")

HERE = Path(__file__).resolve().parent
WORKER = HERE / "netem_worker.py"
#: Names this script gives its namespaces; ``--cleanup-stale`` matches nothing else.
NAME_RE = re.compile(r"^gzn(\d+)-(hub|w\d+)$")
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
RFC1918 = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")
UNPRIVILEGED_ENV = "GRADZIP_NETEM_ASSUME_UNPRIVILEGED"
WORKER_IFNAME = "eth0"


class LabError(RuntimeError):
    """A command that builds or shapes the emulated network failed."""


class RightsError(LabError):
    """The script lacks the rights to create network namespaces."""


class Interrupted(Exception):
    """A termination signal arrived; unwinding runs the cleanup."""


# --------------------------------------------------------------------------- commands


Runner = Callable[[Sequence[str]], str]


def run_command(argv: Sequence[str]) -> str:
    """Run one command; return its stdout. Raises :class:`LabError` with stderr on failure."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LabError(f"`{' '.join(argv)}` failed: {exc}") from None
    if done.returncode != 0:
        raise LabError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def namespace_names(pid: int, workers: int) -> tuple[str, list[str]]:
    """``(hub, [worker namespaces])`` for the process ``pid``."""
    return f"gzn{pid}-hub", [f"gzn{pid}-w{i}" for i in range(workers)]


def worker_addresses(subnet: str, workers: int) -> list[str]:
    """The first ``workers`` host addresses of ``subnet`` (inside an RFC 1918 private range)."""
    try:
        net = ipaddress.ip_network(subnet, strict=True)
    except ValueError:
        raise ValueError(f"`subnet` must be a private IPv4 network such as 10.77.0.0/24, got {subnet!r}") from None
    if not any(net.version == 4 and net.subnet_of(ipaddress.IPv4Network(r)) for r in RFC1918):
        raise ValueError(f"`subnet` must be a private IPv4 network (RFC 1918), got {subnet!r}")
    hosts = list(net.hosts())
    if len(hosts) < workers:
        raise ValueError(f"`subnet` must hold {workers} hosts, got {subnet!r} ({len(hosts)})")
    return [str(h) for h in hosts[:workers]]


def tbf_burst_bytes(rate_mbit: float) -> int:
    """A token-bucket depth of 2 ms at ``rate_mbit`` (at least 32 KiB, so a TSO segment fits)."""
    return max(32 * 1024, int(rate_mbit * 1e6 / 8 * 0.002))


def shaping_commands(ns: str, dev: str, rate_mbit: float, delay_ms: float) -> list[list[str]]:
    """``tc`` commands capping egress of ``dev`` in ``ns``: tbf, under a netem delay if any."""
    tbf = ["tbf", "rate", f"{rate_mbit:g}mbit", "burst", str(tbf_burst_bytes(rate_mbit)),
           "latency", "100ms"]
    base = ["tc", "-n", ns, "qdisc"]
    cmds = [[*base, "del", "dev", dev, "root"]]  # may fail (nothing there): run unchecked
    if delay_ms > 0:
        cmds += [[*base, "add", "dev", dev, "root", "handle", "1:", "netem", "delay",
                  f"{delay_ms:g}ms"],
                 [*base, "add", "dev", dev, "parent", "1:", "handle", "2:", *tbf]]
    else:
        cmds += [[*base, "add", "dev", dev, "root", "handle", "1:", *tbf]]
    return cmds


def topology_commands(hub: str, workers: Sequence[str], addresses: Sequence[str],
                      prefixlen: int) -> list[list[str]]:
    """Everything after ``ip netns add``: bridge in the hub, one veth per worker, addresses."""
    cmds = [["ip", "-n", hub, "link", "add", "br0", "type", "bridge"],
            ["ip", "-n", hub, "link", "set", "br0", "up"]]
    for i, (ns, addr) in enumerate(zip(workers, addresses, strict=True)):
        port = f"h{i}"
        cmds += [
            ["ip", "-n", hub, "link", "add", port, "type", "veth", "peer", "name",
             WORKER_IFNAME, "netns", ns],
            ["ip", "-n", hub, "link", "set", port, "master", "br0"],
            ["ip", "-n", hub, "link", "set", port, "up"],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            ["ip", "-n", ns, "addr", "add", f"{addr}/{prefixlen}", "dev", WORKER_IFNAME],
            ["ip", "-n", ns, "link", "set", WORKER_IFNAME, "up"],
        ]
    return cmds


def check_rights(euid: int | None = None, env: dict[str, str] | None = None) -> None:
    """Refuse early without root, or without ``ip``/``tc``.

    Raises:
        RightsError: with what is missing and how to run the benchmark instead.
    """
    env = dict(os.environ) if env is None else env
    euid = os.geteuid() if euid is None else euid
    if env.get(UNPRIVILEGED_ENV):
        euid = max(euid, 1)
    if euid != 0:
        raise RightsError(
            "netem.py needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) to create network "
            "namespaces and shape links; nothing was created. Run it with sudo, or in a "
            "container started with --cap-add NET_ADMIN --cap-add SYS_ADMIN; "
            "--dry-run prints the commands without running them."
        )
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise RightsError(f"netem.py needs iproute2 ({', '.join(missing)} not found); nothing was created")


# --------------------------------------------------------------------------- the lab


@dataclass
class Lab:
    """The emulated network: namespaces, links, shaping; :meth:`destroy` undoes everything.

    Args:
        workers: number of worker namespaces.
        subnet: private IPv4 network for the worker addresses.
        runner: runs one command; ``None`` is :func:`run_command` (tests pass a recorder).
        pid: names the namespaces (this process's id by default).
    """

    workers: int
    subnet: str = "10.77.0.0/24"
    runner: Runner | None = None
    pid: int = field(default_factory=os.getpid)
    created: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.runner = self.runner or run_command
        self.hub, self.names = namespace_names(self.pid, self.workers)
        self.addresses = worker_addresses(self.subnet, self.workers)
        self.prefixlen = ipaddress.ip_network(self.subnet).prefixlen

    def existing(self) -> set[str]:
        """Names of every network namespace now on the machine."""
        out = self.runner(["ip", "netns", "list"])
        return {line.split()[0] for line in out.splitlines() if line.strip()}

    def create(self) -> None:
        """Build the namespaces and links (unshaped).

        Raises:
            RightsError: the first ``ip netns add`` failed (no rights).
            LabError: a name is taken, or another command failed (cleanup is the caller's
                :meth:`destroy`).
        """
        taken = sorted({self.hub, *self.names} & self.existing())
        if taken:
            raise LabError(f"namespaces {taken} exist already; run --cleanup-stale if they are left over")
        for i, ns in enumerate([self.hub, *self.names]):
            # Recorded before the command: a signal arriving just after it succeeds must not
            # leave it behind. The names were checked free, so deleting never hits another's.
            self.created.append(ns)
            try:
                self.runner(["ip", "netns", "add", ns])
            except LabError as exc:
                self.created.pop()
                if i == 0:
                    raise RightsError(f"cannot create network namespaces ({exc}); nothing was created") from None
                raise
        for cmd in topology_commands(self.hub, self.names, self.addresses, self.prefixlen):
            self.runner(cmd)

    def shape(self, rate_mbit: float, delay_ms: float) -> None:
        """Cap both directions of every worker's link: its egress, and the hub's port to it.

        Raises:
            LabError: a ``tc`` command failed (e.g. a kernel without ``sch_netem``).
        """
        # The delay sits on the worker's egress only, so worker-to-worker one-way latency
        # grows by delay_ms (a packet crosses its sender's egress and the receiver's port).
        links = [(ns, WORKER_IFNAME, delay_ms) for ns in self.names]
        links += [(self.hub, f"h{i}", 0.0) for i in range(self.workers)]
        for ns, dev, delay in links:
            delete, *rest = shaping_commands(ns, dev, rate_mbit, delay)
            with contextlib.suppress(LabError):
                self.runner(delete)
            for cmd in rest:
                try:
                    self.runner(cmd)
                except LabError as exc:
                    hint = (" (this kernel lacks the qdisc; for netem use --delay-ms 0)"
                            if "unknown" in str(exc).lower() else "")
                    raise LabError(f"{exc}{hint}") from None

    def destroy(self) -> list[str]:
        """Delete every namespace this lab created (veths and qdiscs go with them).

        Returns:
            Error messages of deletions that failed (also logged); empty on success.
        """
        errors = []
        while self.created:
            ns = self.created.pop()
            try:
                self.runner(["ip", "netns", "del", ns])
            except LabError as exc:
                errors.append(str(exc))
                log.error("cleanup: %s", exc)
        return errors


def stale_namespaces(names: Sequence[str], alive: Callable[[int], bool]) -> list[str]:
    """Namespaces of this naming scheme whose creating process no longer runs."""
    out = []
    for name in names:
        match = NAME_RE.match(name)
        if match and not alive(int(match.group(1))):
            out.append(name)
    return out


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """Turn SIGINT/SIGTERM/SIGHUP into :class:`Interrupted` so ``finally`` blocks run."""
    def handler(signum: int, frame: Any) -> None:
        raise Interrupted(signal.Signals(signum).name)

    wanted = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {s: signal.signal(s, handler) for s in wanted}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def signals_blocked() -> Iterator[None]:
    """Hold termination signals while cleaning up, so a second Ctrl-C cannot cut it short."""
    wanted = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, wanted)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


# --------------------------------------------------------------------------- processes


def kill_group(proc: subprocess.Popen[Any], grace: float = 3.0) -> None:
    """Terminate a process started with ``start_new_session=True`` and its children."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, grace)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def netns_exec(ns: str, argv: Sequence[str]) -> list[str]:
    """The command line running ``argv`` inside namespace ``ns``."""
    return ["ip", "netns", "exec", ns, *argv]


def wait_all(procs: Sequence[subprocess.Popen[Any]], timeout: float) -> str | None:
    """Wait for every process; on the first failure or at the deadline kill the rest.

    Returns:
        ``None`` when all exited 0, else a description of what went wrong.
    """
    deadline = time.monotonic() + timeout
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                return f"worker {bad[0][0]} exited with code {bad[0][1]}"
            if all(c == 0 for c in codes):
                return None
            if time.monotonic() > deadline:
                return f"timed out after {timeout:g} s"
            time.sleep(0.05)
    finally:
        for p in procs:
            kill_group(p)


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
    argv = [sys.executable, str(WORKER), "train", "--spec", spec, "--result", result,
            "--epochs", str(args.epochs), "--drop-epoch", f"{args.drop_epoch:g}",
            "--lr", f"{args.lr:g}", "--batch-size", str(args.batch_size),
            "--width", str(args.width), "--seed", str(args.seed), "--target", f"{args.target:g}",
            "--window", str(args.window), "--collective-timeout", f"{args.run_timeout:g}",
            "--bucket-cap-mb", f"{args.bucket_cap_mb:g}"]
    if overrides.get("sync"):
        argv.append("--sync")
    if spec == "accordion":
        argv += ["--steady", args.steady, "--critical", args.critical,
                 "--eta", f"{overrides.get('eta', args.eta):g}",
                 "--interval", str(int(overrides.get("interval", args.interval)))]
    if args.stop_at_target:
        argv.append("--stop-at-target")
    return argv


def worker_env(master: str, port: int, rank: int, world: int) -> dict[str, str]:
    """Environment of one worker: the process-group rendezvous on worker 0's address."""
    env = dict(os.environ)
    env.update({"MASTER_ADDR": master, "MASTER_PORT": str(port), "RANK": str(rank),
                "WORLD_SIZE": str(world), "GLOO_SOCKET_IFNAME": WORKER_IFNAME,
                "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    return env


LIVE: list[subprocess.Popen[Any]] = []  # killed by the cleanup whatever happens


def _spawn(argv: list[str], env: dict[str, str] | None, log_path: Path) -> subprocess.Popen[Any]:
    with open(log_path, "w") as fh:
        proc = subprocess.Popen(argv, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
    LIVE.append(proc)
    return proc


def measure_goodput(lab: Lab, rate_mbit: float, tmp: Path) -> dict[str, Any]:
    """Send about a second's worth of bytes from worker 1 to worker 0 over the shaped path."""
    count = max(1 << 20, int(rate_mbit * 1e6 / 8))
    port = 29400
    recv = _spawn(netns_exec(lab.names[0], [sys.executable, str(WORKER), "goodput-recv", "--bind",
                                           f"{lab.addresses[0]}:{port}", "--bytes", str(count)]),
                  None, tmp / "goodput-recv.log")
    send = _spawn(netns_exec(lab.names[1], [sys.executable, str(WORKER), "goodput-send", "--to",
                                           f"{lab.addresses[0]}:{port}", "--bytes", str(count)]),
                  None, tmp / "goodput-send.log")
    problem = wait_all([recv, send], timeout=60)
    if problem:
        raise LabError(f"goodput check {problem}: {(tmp / 'goodput-recv.log').read_text()[-500:]}")
    lines = (tmp / "goodput-recv.log").read_text().splitlines()
    return json.loads(lines[-1])


def run_one(lab: Lab, args: argparse.Namespace, method: str, port: int, tmp: Path) -> dict[str, Any]:
    """Train one method over the current shaping; the rank-0 record plus kernel byte counts."""
    tag = re.sub(r"[^A-Za-z0-9_.-]", "_", method)
    result = tmp / f"{tag}.json"
    result.unlink(missing_ok=True)
    started = time.perf_counter()
    procs = [
        _spawn(netns_exec(ns, worker_argv(args, method, str(result))),
               worker_env(lab.addresses[0], port, rank, lab.workers),
               tmp / f"{tag}-rank{rank}.log")
        for rank, ns in enumerate(lab.names)
    ]
    problem = wait_all(procs, args.run_timeout)
    wall = time.perf_counter() - started
    if problem is not None or not result.exists():
        tails = [(tmp / f"{tag}-rank{r}.log").read_text()[-1500:] for r in range(lab.workers)]
        log.error("%s: %s\n%s", method, problem or "no result",
                  "\n".join(f"--- rank {r} ---\n{t}" for r, t in enumerate(tails)))
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
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    return "\n".join(lines)


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
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--bandwidth-mbit", type=float, nargs="+", default=[1000.0, 150.0, 40.0],
                   help="per-link rate cap in Mbit/s, each direction; one set of runs each")
    p.add_argument("--delay-ms", type=float, default=0.0,
                   help="one-way delay added between any two workers (netem on each worker's "
                        "egress; needs a kernel with sch_netem)")
    p.add_argument("--methods", nargs="+", default=list(METHODS),
                   help=f"among {', '.join(METHODS)}; also accordion:eta=X,interval=N")
    p.add_argument("--subnet", default="10.77.0.0/24")
    p.add_argument("--epochs", type=int, default=16)
    p.add_argument("--drop-epoch", type=float, default=10.0)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0,
                   help="DDP's bucket size; below the model's size the hook can overlap buckets")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", type=float, default=0.98)
    p.add_argument("--window", type=int, default=5,
                   help="the target counts as reached when the mean of this many "
                        "consecutive evaluations (one per step) reaches it")
    p.add_argument("--stop-at-target", action="store_true")
    p.add_argument("--steady", default="powersgd:rank=1")
    p.add_argument("--critical", default="powersgd:rank=4")
    p.add_argument("--eta", type=float, default=0.5)
    p.add_argument("--interval", type=int, default=22)
    p.add_argument("--run-timeout", type=float, default=300.0, help="seconds per run")
    p.add_argument("--out", type=Path, default=HERE / "results" / "netem.json")
    p.add_argument("--plot", type=Path, default=None, help="PNG of accuracy vs time")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--cleanup-stale", action="store_true",
                   help="delete namespaces left by a killed run of this script, then exit")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    problems = validate(args)
    if problems:
        p.error("; ".join(problems))
    return args


def validate(args: argparse.Namespace) -> list[str]:
    """Problems with the arguments, as ``"`name` must ..., got ..."`` messages."""
    out = []
    if not 2 <= args.workers <= 64:
        out.append(f"`--workers` must be in [2, 64], got {args.workers}")
    if any(not 0 < b <= 100_000 for b in args.bandwidth_mbit):
        out.append(f"`--bandwidth-mbit` values must be in (0, 100000], got {args.bandwidth_mbit}")
    if not 0 <= args.delay_ms <= 1000:
        out.append(f"`--delay-ms` must be in [0, 1000], got {args.delay_ms:g}")
    if not 0 < args.target <= 1:
        out.append(f"`--target` must be in (0, 1], got {args.target:g}")
    if not args.run_timeout > 0:
        out.append(f"`--run-timeout` must be > 0, got {args.run_timeout:g}")
    for name in ("epochs", "batch_size", "width", "interval", "window"):
        if getattr(args, name) < 1:
            out.append(f"`--{name.replace('_', '-')}` must be >= 1, got {getattr(args, name)}")
    if not args.lr > 0 or not args.eta > 0:
        out.append(f"`--lr` and `--eta` must be > 0, got {args.lr:g} and {args.eta:g}")
    try:
        worker_addresses(args.subnet, max(args.workers, 1))
    except ValueError as exc:
        out.append(str(exc))
    if len(set(args.methods)) != len(args.methods):
        out.append(f"`--methods` must not repeat, got {args.methods}")
    for method in args.methods:
        try:
            parse_method(method)
        except ValueError as exc:
            out.append(str(exc))
    return out


def _recorder(log_to: list[list[str]]) -> Runner:
    def run(argv: Sequence[str]) -> str:
        log_to.append(list(argv))
        if argv[:3] == ["ip", "netns", "list"]:
            return ""
        return ""
    return run


def dry_run(args: argparse.Namespace) -> list[list[str]]:
    """Every command a real run would issue, in order (workers shown for rank 0 only)."""
    cmds: list[list[str]] = []
    lab = Lab(args.workers, args.subnet, runner=_recorder(cmds))
    lab.create()
    for rate in args.bandwidth_mbit:
        lab.shape(rate, args.delay_ms)
        for method in args.methods:
            cmds.append(netns_exec(lab.names[0], worker_argv(args, method, "RESULT")))
    lab.destroy()
    return cmds


def machine_info() -> dict[str, Any]:
    import platform

    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                .splitlines() if line.startswith("model name")), platform.processor())
    try:
        commit = subprocess.run(["git", "-C", str(HERE), "rev-parse", "HEAD"],
                                capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    return {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(),
            "python": platform.python_version(), "torch": torch.__version__, "commit": commit}


def benchmark(args: argparse.Namespace, lab: Lab, tmp: Path) -> dict[str, Any]:
    """Every (bandwidth, method) run; returns the JSON document."""
    meta: dict[str, Any] = {"args": {k: (str(v) if isinstance(v, Path) else v)
                                     for k, v in vars(args).items()},
                            "machine": machine_info(), "goodput": {},
                            "loadavg_start": os.getloadavg()}
    runs, port = [], 29500
    for rate in args.bandwidth_mbit:
        lab.shape(rate, args.delay_ms)
        meta["goodput"][f"{rate:g}"] = measure_goodput(lab, rate, tmp)
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
    rows = [summarize(r, r["bandwidth_mbit"], args.window) for r in runs]
    add_speedups(rows)
    return {"meta": meta, "runs": runs, "rows": rows}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.dry_run:
        for cmd in dry_run(args):
            print(" ".join(cmd))
        return 0
    try:
        check_rights()
    except RightsError as exc:
        print(f"netem.py: {exc}", file=sys.stderr)
        return 2
    if args.cleanup_stale:
        lab = Lab(args.workers, args.subnet)
        for ns in stale_namespaces(sorted(lab.existing()), _pid_alive):
            run_command(["ip", "netns", "del", ns])
            print(f"deleted {ns}")
        return 0
    lab = Lab(args.workers, args.subnet)
    status = 1
    with tempfile.TemporaryDirectory(prefix="gz-netem-") as tmp, signals_raise():
        try:
            lab.create()
            doc = benchmark(args, lab, Path(tmp))
            write_outputs(args.out, doc["meta"], doc["runs"], doc["rows"])
            if args.plot is not None:
                plot(doc["runs"], min(args.bandwidth_mbit), args.target, args.plot)
            print(markdown_table(doc["rows"]))
            failed = [f"{r['bandwidth_mbit']:g} Mbit/s {r['method']}" for r in doc["rows"]
                      if "error" in r]
            if failed:
                print(f"netem.py: {len(failed)} run(s) failed: {', '.join(failed)}", file=sys.stderr)
            status = 1 if failed else 0
        except RightsError as exc:
            print(f"netem.py: {exc}", file=sys.stderr)
            status = 2
        except (LabError, Interrupted) as exc:
            print(f"netem.py: stopped: {exc}", file=sys.stderr)
            status = 130 if isinstance(exc, Interrupted) else 1
        finally:
            with signals_blocked():
                for proc in LIVE:
                    kill_group(proc, grace=1.0)
                errors = lab.destroy()
            if errors:
                print("netem.py: cleanup failed for: " + "; ".join(errors), file=sys.stderr)
                status = status or 1
    return status


if __name__ == "__main__":
    sys.exit(main())
