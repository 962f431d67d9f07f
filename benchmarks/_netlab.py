"""The emulated network shared by the netem benchmarks.

``benchmarks/netem.py`` (time to accuracy) and ``benchmarks/netem_steps.py`` (seconds per step)
build the same lab here: one network namespace per worker and a hub namespace holding a
bridge, each worker joined to the bridge with a veth pair, every link capped in both
directions with ``tc tbf``. With ``--rtt-ms`` > 0 the hub routes instead of bridging and holds
every packet in a user-space delay line for half the round trip (``benchmarks/netem_delay.py``:
no ``netem`` qdisc needed). This module also holds the rights check, the signal handling
around the cleanup, and the worker processes it starts and kills; what the launchers and
workers share around it (the goodput and round-trip checks among it) is in
``benchmarks/_netlab_launch.py``.

What it touches, and nothing else:

* namespaces named ``gzn<pid>-hub`` and ``gzn<pid>-w<i>``, created here (refused if the names
  exist already); links and addresses only inside them, from ``--subnet`` (10.77.0.0/24 by
  default). No namespace gets a default route, so no packet can leave them; the root
  namespace's interfaces, routes and qdiscs are never changed.
* every namespace it created is deleted on exit (normal end, error, timeout, SIGINT, SIGTERM,
  SIGHUP), which removes the veths and qdiscs inside. Worker processes are killed first.
  ``--cleanup-stale`` deletes namespaces of this naming scheme whose creating process is gone
  (after ``kill -9``).

Creating the lab needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN); :func:`check_rights` refuses
with a message otherwise, and ``--dry-run`` prints the commands as any user.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import netem_delay as delay
from ._common import module_command

log = logging.getLogger("netlab")

HERE = Path(__file__).resolve().parent
#: Names the lab gives its namespaces; ``--cleanup-stale`` matches nothing else.
NAME_RE = re.compile(r"^gzn(\d+)-(hub|w\d+)$")
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


def shaping_commands(ns: str, dev: str, rate_mbit: float) -> list[list[str]]:
    """``tc`` commands capping egress of ``dev`` in ``ns`` with tbf (the first deletes what
    was there, and may fail)."""
    tbf = ["tbf", "rate", f"{rate_mbit:g}mbit", "burst", str(tbf_burst_bytes(rate_mbit)),
           "latency", "100ms"]
    base = ["tc", "-n", ns, "qdisc"]
    return [[*base, "del", "dev", dev, "root"], [*base, "add", "dev", dev, "root", "handle", "1:", *tbf]]


def change_command(ns: str, dev: str, rate_mbit: float) -> list[str]:
    """The ``tc`` command changing the rate of the tbf cap of :func:`shaping_commands` in place."""
    return ["tc", "-n", ns, "qdisc", "change", "dev", dev, "root", "handle", "1:", "tbf", "rate",
            f"{rate_mbit:g}mbit", "burst", str(tbf_burst_bytes(rate_mbit)), "latency", "100ms"]


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
        rtt_ms: round trip added between any two workers (> 0: the hub routes through the
            delay line of ``netem_delay.py``, which :meth:`delay_command` starts).
    """

    workers: int
    subnet: str = "10.77.0.0/24"
    runner: Runner | None = None
    pid: int = field(default_factory=os.getpid)
    created: list[str] = field(default_factory=list)
    rtt_ms: float = 0.0

    def __post_init__(self) -> None:
        self.runner = self.runner or run_command
        self.hub, self.names = namespace_names(self.pid, self.workers)
        self.addresses = worker_addresses(self.subnet, self.workers)
        self.prefixlen = ipaddress.ip_network(self.subnet).prefixlen
        if not 0 <= self.rtt_ms <= 10_000:
            raise ValueError(f"`rtt_ms` must be in [0, 10000], got {self.rtt_ms!r}")
        self.gateway = delay.hub_address(self.subnet, self.workers) if self.rtt_ms else None

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
        if self.gateway is None:
            cmds = topology_commands(self.hub, self.names, self.addresses, self.prefixlen)
        else:
            cmds = delay.routed_topology_commands(self.hub, self.names, self.addresses,
                                                  self.prefixlen, self.gateway)
        for cmd in cmds:
            self.runner(cmd)

    def delay_command(self, ready: Path, stats: Path) -> list[str]:
        """The delay line's command, run in the hub: holds each packet ``rtt_ms / 2``."""
        return netns_exec(self.hub, [*module_command("netem_delay"), "serve", "--tun",
                                     delay.TUN_NAME, "--one-way-ms", f"{self.rtt_ms / 2:g}",
                                     "--ready", str(ready), "--stats", str(stats)])

    def shape(self, rate_mbit: float) -> None:
        """Cap both directions of every worker's link: its egress, and the hub's port to it.

        Raises:
            LabError: a ``tc`` command failed.
        """
        links = [(ns, WORKER_IFNAME) for ns in self.names]
        links += [(self.hub, f"h{i}") for i in range(self.workers)]
        for ns, dev in links:
            delete, *rest = shaping_commands(ns, dev, rate_mbit)
            with contextlib.suppress(LabError):
                self.runner(delete)
            for cmd in rest:
                self.runner(cmd)

    def change_rate(self, rate_mbit: float) -> None:
        """Change the cap of every link shaped by :meth:`shape` in place (``tc qdisc change``:
        the queue and the connections on it are kept, as when a real path's rate changes).

        Raises:
            LabError: a ``tc`` command failed (for example, :meth:`shape` was never called).
        """
        links = [(ns, WORKER_IFNAME) for ns in self.names]
        links += [(self.hub, f"h{i}") for i in range(self.workers)]
        for ns, dev in links:
            self.runner(change_command(ns, dev, rate_mbit))

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


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user counts)."""
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


def wait_all(procs: Sequence[subprocess.Popen[Any]], timeout: float, *,
             stop: Callable[[], bool] | None = None, poll: float = 0.05,
             grace: float = 3.0) -> str | None:
    """Wait for every process; kill the rest on the first failure, at the deadline, or (with
    ``stop``) once ``stop()`` is true, checked every ``poll`` seconds; ``grace``: seconds
    each is given to end after SIGTERM (see :func:`kill_group`).

    Returns:
        ``None`` when all exited 0, ``"stopped"`` when ``stop()`` ended them, else a
        description of what went wrong.
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
            if stop is not None and stop():
                return "stopped"
            if time.monotonic() > deadline:
                return f"timed out after {timeout:g} s"
            time.sleep(poll)
    finally:
        for p in procs:
            kill_group(p, grace=grace)


LIVE: list[subprocess.Popen[Any]] = []  # killed by the cleanup whatever happens


def spawn(argv: list[str], env: dict[str, str] | None, log_path: Path) -> subprocess.Popen[Any]:
    """Start ``argv`` in its own session, output to ``log_path``; registered in :data:`LIVE`."""
    with open(log_path, "w") as fh:
        proc = subprocess.Popen(argv, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
    LIVE.append(proc)
    return proc


def machine_info() -> dict[str, Any]:
    """CPU, cores, kernel, Python and torch versions, and the commit, for a record's meta."""
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
