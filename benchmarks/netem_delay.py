"""A round-trip delay for the emulated network, without the kernel's ``netem`` qdisc.

Kernels built without ``sch_netem`` cannot delay packets in ``tc``. With ``--rtt-ms`` > 0 the
lab of ``benchmarks/_netlab.py`` routes instead of bridging: the hub namespace forwards IPv4
between the workers' links, and every packet from one worker to another goes through a TUN
device (``gzdelay0``) in the hub, where this module's delay line holds it for half the round
trip before handing it back to the kernel, which forwards it on to its destination. A packet
crosses the hub once per direction, so a request and its reply are held ``rtt / 2`` each.

Why packets and not a TCP relay: a relay that accepts a connection and opens another ends
the sender's TCP connection at the relay, so the sender's congestion window grows at the
relay's round trip (near zero) and the delay is only a buffer. Here the two workers' TCP
stacks speak to each other directly and see the full round trip on every segment: slow start,
window growth and the restart after idle behave as over a long link. The bandwidth caps stay
where they were (``tc tbf`` on each worker's egress and on the hub's port to it).

The routing, all inside the lab's namespaces (``routed_topology_commands``):

* each worker keeps its address in the lab's subnet on ``eth0``; the hub's port to it answers
  ARP for every other worker (``proxy_arp``), so workers need no route of their own;
* the hub's main table sends the subnet into ``gzdelay0``; packets coming back out of it
  follow a rule to table 100, which holds one route per worker through its port;
* the hub owns one address (the subnet's last host) for the ARP requests it sends itself.

The delay line's own cost is Python per packet (MTU-sized: the kernel segments before the
TUN device), a few microseconds; it can only add to the delay, never remove from it. Use it
for links up to a few hundred Mbit/s; its record (``--stats``) says how late it released
packets. ``rtt-echo`` / ``rtt-ping`` time small request/reply round trips between two workers.

Run as ``python -m benchmarks.netem_delay serve --tun gzdelay0 --one-way-ms 50 --ready F``
inside the hub (the lab starts it); it runs until SIGTERM. Needs CAP_NET_ADMIN for the TUN.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import fcntl
import ipaddress
import json
import os
import select
import signal
import socket
import statistics
import struct
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

TUN_NAME = "gzdelay0"
#: The routing table and rule priority of packets leaving the delay line.
TABLE, RULE_PREF = "100", "100"
_TUNSETIFF, _IFF_TUN, _IFF_NO_PI = 0x400454CA, 0x0001, 0x1000
PROBE_BYTES = 64


# --------------------------------------------------------------------------- the routing


def hub_address(subnet: str, workers: int) -> str:
    """The hub's own address: the subnet's last host, which no worker may hold.

    Raises:
        ValueError: the subnet has no host left over after ``workers`` workers.
    """
    hosts = list(ipaddress.ip_network(subnet, strict=True).hosts())
    if len(hosts) <= workers:
        raise ValueError(f"`subnet` must hold {workers + 1} hosts with `--rtt-ms` > 0 (the hub "
                         f"takes one), got {subnet!r} ({len(hosts)})")
    return str(hosts[-1])


def routed_topology_commands(hub: str, workers: Sequence[str], addresses: Sequence[str],
                             prefixlen: int, gateway: str) -> list[list[str]]:
    """The routed lab: one veth per worker, the hub forwarding every packet through the TUN.

    Args:
        hub: the hub namespace; workers: the worker namespaces (created already).
        addresses: each worker's address; prefixlen: the subnet's prefix length.
        gateway: the hub's own address (:func:`hub_address`).

    Returns:
        ``ip`` and ``sysctl`` commands, each confined to one of the given namespaces.
    """
    def sysctl(*settings: str) -> list[str]:
        return ["ip", "netns", "exec", hub, "sysctl", "-q", "-w", *settings]

    # Reverse-path filtering would drop a packet arriving from the TUN whose source the main
    # table routes back into the TUN; it is off in the hub (and before any device exists).
    cmds = [sysctl("net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0",
                   "net.ipv4.conf.default.rp_filter=0"),
            ["ip", "-n", hub, "link", "set", "lo", "up"],
            ["ip", "-n", hub, "addr", "add", f"{gateway}/32", "dev", "lo"]]
    for i, (ns, addr) in enumerate(zip(workers, addresses, strict=True)):
        port = f"h{i}"
        cmds += [
            ["ip", "-n", hub, "link", "add", port, "type", "veth", "peer", "name", "eth0",
             "netns", ns],
            # The port answers a worker's ARP for any other worker (the hub routes there),
            # at once: proxy replies are otherwise held back up to 0.8 s.
            sysctl(f"net.ipv4.conf.{port}.proxy_arp=1", f"net.ipv4.neigh.{port}.proxy_delay=0"),
            ["ip", "-n", hub, "link", "set", port, "up"],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            ["ip", "-n", ns, "addr", "add", f"{addr}/{prefixlen}", "dev", "eth0"],
            ["ip", "-n", ns, "link", "set", "eth0", "up"],
            ["ip", "-n", hub, "route", "add", f"{addr}/32", "dev", port, "src", gateway,
             "table", TABLE],
        ]
    net = ipaddress.ip_network(f"{addresses[0]}/{prefixlen}", strict=False)
    cmds += [["ip", "-n", hub, "tuntap", "add", "dev", TUN_NAME, "mode", "tun"],
             ["ip", "-n", hub, "link", "set", TUN_NAME, "txqueuelen", "10000", "up"],
             ["ip", "-n", hub, "route", "add", str(net), "dev", TUN_NAME],
             ["ip", "-n", hub, "rule", "add", "pref", RULE_PREF, "iif", TUN_NAME,
              "lookup", TABLE]]
    return cmds


# --------------------------------------------------------------------------- the delay line


class DelayLine:
    """Packets in arrival order, each released ``one_way_s`` after it was read.

    The delay is the same for every packet, so release order is arrival order and a deque is
    the whole schedule. Pure: times come from the caller.

    Args:
        one_way_s: seconds each packet is held (>= 0).

    Raises:
        ValueError: a negative or non-finite delay.
    """

    def __init__(self, one_way_s: float) -> None:
        if not (isinstance(one_way_s, (int, float)) and 0 <= one_way_s < float("inf")):
            raise ValueError(f"`one_way_s` must be a finite number >= 0, got {one_way_s!r}")
        self.one_way_s = float(one_way_s)
        self._queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.packets = self.bytes = self.max_backlog = 0
        self.late_max_s = self.late_sum_s = 0.0
        self.late_over_1ms = self.late_over_10ms = 0

    def __len__(self) -> int:
        return len(self._queue)

    def push(self, packet: bytes, now: float) -> None:
        """Hold ``packet``, read at ``now``, until ``now + one_way_s``."""
        self._queue.append((now + self.one_way_s, packet))
        self.max_backlog = max(self.max_backlog, len(self._queue))

    def wait_seconds(self, now: float) -> float | None:
        """Seconds until the next packet is due (0 when one is due); ``None`` when empty."""
        return max(0.0, self._queue[0][0] - now) if self._queue else None

    def pop_due(self, now: float) -> list[bytes]:
        """Every packet due at ``now``, in arrival order; records how late each one is."""
        out = []
        while self._queue and self._queue[0][0] <= now:
            due, packet = self._queue.popleft()
            late = now - due
            self.late_max_s, self.late_sum_s = max(self.late_max_s, late), self.late_sum_s + late
            self.late_over_1ms += late > 1e-3
            self.late_over_10ms += late > 1e-2
            self.packets, self.bytes = self.packets + 1, self.bytes + len(packet)
            out.append(packet)
        return out

    def stats(self) -> dict[str, float]:
        """Packets and bytes released, the largest backlog, and lateness (mean, max in ms, and
        how many packets left more than 1 and 10 ms late)."""
        mean = self.late_sum_s / self.packets if self.packets else 0.0
        return {"one_way_ms": self.one_way_s * 1e3, "packets": self.packets,
                "bytes": self.bytes, "max_backlog": self.max_backlog,
                "late_mean_ms": mean * 1e3, "late_max_ms": self.late_max_s * 1e3,
                "late_over_1ms": self.late_over_1ms, "late_over_10ms": self.late_over_10ms}


def serve(fd: int, line: DelayLine, *, stop: Callable[[], bool] = lambda: False,
          clock: Callable[[], float] = time.monotonic, batch: int = 256) -> None:
    """Read packets from ``fd`` and write each back to it once ``line`` releases it.

    ``fd`` is a TUN device (or any descriptor that keeps packet boundaries: a datagram
    socket). Returns when ``stop()`` is true (checked at least every 0.2 s); a signal handler
    that raises ends it at once.
    """
    os.set_blocking(fd, False)
    while not stop():
        wait = line.wait_seconds(clock())
        ready, _, _ = select.select([fd], [], [], 0.2 if wait is None else min(wait, 0.2))
        if ready:
            for _ in range(batch):  # bounded, so due packets are not starved by arrivals
                try:
                    packet = os.read(fd, 65536)
                except BlockingIOError:
                    break
                line.push(packet, clock())
        for packet in line.pop_due(clock()):
            with contextlib.suppress(BlockingIOError):  # a full queue drops, as a link does
                os.write(fd, packet)


def raise_priority() -> str:
    """Schedule this process ahead of ordinary ones, so that a loaded machine delays its
    packets less: real-time FIFO where allowed, else nice -10, else nothing.

    Returns:
        ``"fifo"``, ``"nice"`` or ``"normal"``: what was obtained.
    """
    # The loop sleeps in select() between packets, so a real-time priority cannot spin.
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
        return "fifo"
    except (OSError, AttributeError):
        pass
    try:
        os.nice(-10)
        return "nice"
    except OSError:
        return "normal"


def open_tun(name: str) -> int:
    """Attach to the TUN device ``name`` (raw IP packets, no header); returns its descriptor."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
    return fd


# --------------------------------------------------------------------------- round-trip probe


def rtt_echo(bind: str, count: int, timeout: float) -> None:
    """Accept one connection and send back ``count`` messages of :data:`PROBE_BYTES`."""
    host, port = bind.rsplit(":", 1)
    with socket.create_server((host, int(port))) as server:
        server.settimeout(timeout)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(timeout)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(count):
                conn.sendall(_recv_exactly(conn, PROBE_BYTES))


def connect_retrying(to: str, timeout: float) -> tuple[socket.socket, float]:
    """Connect to ``host:port``, retrying every 50 ms while the peer starts, for ``timeout`` s.

    Returns:
        The connected socket and the seconds its successful attempt took.

    Raises:
        OSError: no attempt connected within ``timeout``.
    """
    host, port = to.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while True:
        started = time.perf_counter()
        try:
            sock = socket.create_connection((host, int(port)), timeout=timeout)
            return sock, time.perf_counter() - started
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def rtt_ping(to: str, count: int, timeout: float) -> dict[str, Any]:
    """Connect (retrying while the echo starts) and time ``count`` request/reply round trips.

    Returns:
        ``{"samples_ms", "min_ms", "median_ms", "connect_ms"}``.
    """
    sock, connect_s = connect_retrying(to, timeout)
    connect_ms = connect_s * 1e3
    samples = []
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(count):
            message = i.to_bytes(PROBE_BYTES, "big")
            t0 = time.perf_counter()
            sock.sendall(message)
            if _recv_exactly(sock, PROBE_BYTES) != message:
                raise RuntimeError("the echo returned another message")
            samples.append((time.perf_counter() - t0) * 1e3)
    return {"samples_ms": samples, "min_ms": min(samples),
            "median_ms": statistics.median(samples), "connect_ms": connect_ms}


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        data += chunk
    return data


# --------------------------------------------------------------------------- CLI


class _Stop(Exception):
    pass


def _raise_stop(signum: int, frame: Any) -> None:
    raise _Stop(signal.Signals(signum).name)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("serve", help="run the delay line on a TUN device until SIGTERM")
    s.add_argument("--tun", default=TUN_NAME)
    s.add_argument("--one-way-ms", type=float, required=True)
    s.add_argument("--ready", type=Path, required=True, help="file written once attached")
    s.add_argument("--stats", type=Path, default=None, help="JSON record written at the end")
    e = sub.add_parser("rtt-echo")
    e.add_argument("--bind", required=True)
    g = sub.add_parser("rtt-ping")
    g.add_argument("--to", required=True)
    for q in (e, g):
        q.add_argument("--count", type=int, default=20)
        q.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args(argv)
    if args.mode == "rtt-echo":
        rtt_echo(args.bind, args.count, args.timeout)
        return 0
    if args.mode == "rtt-ping":
        print(json.dumps(rtt_ping(args.to, args.count, args.timeout)), flush=True)
        return 0
    line = DelayLine(args.one_way_ms / 1e3)
    fd = open_tun(args.tun)
    priority = raise_priority()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _raise_stop)
    args.ready.write_text(json.dumps({"pid": os.getpid(), "tun": args.tun}))
    written = [time.monotonic()]

    def tick() -> bool:  # the record is rewritten every 2 s: the lab reads it while running
        if args.stats is not None and time.monotonic() - written[0] > 2.0:
            args.stats.write_text(json.dumps({**line.stats(), "priority": priority}))
            written[0] = time.monotonic()
        return False

    try:
        serve(fd, line, stop=tick)
    except _Stop:
        pass
    finally:
        if args.stats is not None:
            args.stats.write_text(json.dumps({**line.stats(), "priority": priority}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
