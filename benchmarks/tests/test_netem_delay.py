"""The round trip of the emulated network: the delay line, its routing and the ``--rtt-ms`` option.

The delay line is timed for real over a datagram socket pair (no rights needed): a packet can
only come back later than it was sent plus the delay, however loaded the machine, so only that
lower bound is asserted. The full lab (namespaces, TUN device) runs only as root, and is
skipped elsewhere.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from benchmarks import _netlab as netlab
from benchmarks import _netlab_launch as launch
from benchmarks import netem, netem_delay, netem_rtt, netem_rtt_probe, outer_netem
from benchmarks import netem_steps as steps
from benchmarks.plan_validation import _outer_shapes
from gradzip.plan import TimingCache
from gradzip.plan.timing import timing_key


class FakeRunner:
    """Records the lab's commands instead of running them (``ip netns list``: none exist)."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, argv: Sequence[str]) -> str:
        self.calls.append(list(argv))
        return ""

    def added(self) -> list[str]:
        return [c[3] for c in self.calls if c[:3] == ["ip", "netns", "add"]]

    def deleted(self) -> list[str]:
        return [c[3] for c in self.calls if c[:3] == ["ip", "netns", "del"]]

# --------------------------------------------------------------------------- the delay line


def test_delay_line_releases_each_packet_exactly_its_delay_after_it_was_read_in_order():
    line = netem_delay.DelayLine(0.05)
    assert line.wait_seconds(0.0) is None
    line.push(b"a", 1.0)
    line.push(b"b", 1.01)
    line.push(b"c", 1.01)
    assert line.wait_seconds(1.02) == pytest.approx(0.03)
    assert line.pop_due(1.0499) == []
    assert line.pop_due(1.05) == [b"a"]
    assert line.pop_due(1.08) == [b"b", b"c"]
    assert len(line) == 0 and line.wait_seconds(2.0) is None
    stats = line.stats()
    assert stats["packets"] == 3 and stats["bytes"] == 3 and stats["max_backlog"] == 3
    assert stats["late_max_ms"] == pytest.approx(20.0)
    assert stats["late_mean_ms"] == pytest.approx(40.0 / 3)
    assert stats["late_over_1ms"] == 2 and stats["late_over_10ms"] == 2


@pytest.mark.parametrize("bad", [-0.001, float("inf"), float("nan"), "0.05"])
def test_delay_line_refuses_a_bad_delay(bad):
    with pytest.raises(ValueError, match="`one_way_s` must be a finite number >= 0"):
        netem_delay.DelayLine(bad)


def test_packets_through_the_delay_line_arrive_intact_in_order_and_no_sooner_than_the_delay():
    delay = 0.05
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    done = threading.Event()
    thread = threading.Thread(target=netem_delay.serve,
                              args=(theirs.fileno(), netem_delay.DelayLine(delay)),
                              kwargs={"stop": done.is_set}, daemon=True)
    thread.start()
    try:
        ours.settimeout(30)
        for i in range(5):
            message = bytes([i]) * (100 + i)
            sent = time.monotonic()
            ours.send(message)
            assert ours.recv(4096) == message
            # A lower bound: a slow machine can make the packet later, never earlier.
            assert time.monotonic() - sent >= delay
        burst = [bytes([i]) * 10 for i in range(20)]
        for message in burst:
            ours.send(message)
        assert [ours.recv(4096) for _ in burst] == burst
    finally:
        done.set()
        thread.join(timeout=5)
        ours.close()
        theirs.close()
    assert not thread.is_alive()


# --------------------------------------------------------------------------- the routing


def test_routed_topology_stays_inside_the_lab_and_sends_every_packet_through_the_tun():
    hub, names = netlab.namespace_names(7, 3)
    addresses = netlab.worker_addresses("10.77.0.0/24", 3)
    gateway = netem_delay.hub_address("10.77.0.0/24", 3)
    assert gateway == "10.77.0.254" and gateway not in addresses
    cmds = netem_delay.routed_topology_commands(hub, names, addresses, 24, gateway)
    ours = {hub, *names}
    for cmd in cmds:
        where = cmd[3] if cmd[:3] == ["ip", "netns", "exec"] else cmd[2]
        assert cmd[0] == "ip" and where in ours, cmd
        if "netns" in cmd[3:]:
            assert cmd[cmd.index("netns", 3) + 1] in names
        assert "default" not in cmd  # no default route: nothing leaves the lab
    routes = [c for c in cmds if "route" in c]
    assert ["ip", "-n", hub, "route", "add", "10.77.0.0/24", "dev", netem_delay.TUN_NAME] in routes
    for i, addr in enumerate(addresses):
        assert ["ip", "-n", hub, "route", "add", f"{addr}/32", "dev", f"h{i}", "src", gateway,
                "table", netem_delay.TABLE] in routes
        assert any(f"net.ipv4.conf.h{i}.proxy_arp=1" in c for c in cmds)
    for cmd in routes:  # every route is in the hub, for an address of the subnet
        assert cmd[2] == hub
        assert ipaddress.ip_network(cmd[5]).subnet_of(ipaddress.ip_network("10.77.0.0/24"))
    assert ["ip", "-n", hub, "rule", "add", "pref", netem_delay.RULE_PREF, "iif",
            netem_delay.TUN_NAME, "lookup", netem_delay.TABLE] in cmds
    assert not any("bridge" in c for c in cmds)


def test_the_hub_needs_a_spare_address():
    assert netem_delay.hub_address("10.1.0.0/29", 5) == "10.1.0.6"
    with pytest.raises(ValueError, match="must hold 7 hosts with `--rtt-ms` > 0"):
        netem_delay.hub_address("10.1.0.0/29", 6)


def test_a_lab_with_a_round_trip_routes_and_one_without_bridges():
    fake = FakeRunner()
    lab = netlab.Lab(2, runner=fake, pid=21, rtt_ms=100)
    lab.create()
    assert any(netem_delay.TUN_NAME in c for c in fake.calls)
    assert not any("bridge" in c for c in fake.calls)
    cmd = lab.delay_command(Path("r"), Path("s"))
    assert cmd[:4] == ["ip", "netns", "exec", "gzn21-hub"]
    assert cmd[cmd.index("--one-way-ms") + 1] == "50"  # half the round trip each way
    assert sorted(lab.destroy()) == [] and sorted(fake.deleted()) == sorted(fake.added())
    fake = FakeRunner()
    netlab.Lab(2, runner=fake, pid=22).create()
    assert any("bridge" in c for c in fake.calls)
    assert not any(netem_delay.TUN_NAME in c for c in fake.calls)
    with pytest.raises(ValueError, match="`rtt_ms` must be in"):
        netlab.Lab(2, runner=FakeRunner(), pid=23, rtt_ms=-1)


# --------------------------------------------------------------------------- the option


@pytest.mark.parametrize("parse, dry_run, argv", [
    (netem.parse_args, netem.dry_run, ["--bandwidth-mbit", "40", "--methods", "none"]),
    (steps.parse_args, steps.dry_run, ["--bandwidth-mbit", "40"]),
    (outer_netem.parse_args, outer_netem.dry_run, ["--bandwidth-mbit", "40",
                                                   "--methods", "none", "diloco30"]),
])
def test_every_launcher_takes_rtt_ms_and_starts_the_delay_line_before_shaping(parse, dry_run,
                                                                              argv):
    with_rtt = dry_run(parse(["--workers", "2", "--rtt-ms", "100", *argv]))
    words = [" ".join(c) for c in with_rtt]
    start = next(i for i, w in enumerate(words) if "netem_delay serve" in w)
    assert "--one-way-ms 50 " in words[start]
    first_tc = next(i for i, w in enumerate(words) if w.startswith("tc "))
    assert start < first_tc and not any("netem delay" in w for w in words)
    without = [" ".join(c) for c in dry_run(parse(["--workers", "2", *argv]))]
    assert not any("netem_delay" in w or netem_delay.TUN_NAME in w for w in without)
    for bad in ("-1", "2001"):
        with pytest.raises(SystemExit):
            parse(["--workers", "2", "--rtt-ms", bad, *argv])


@pytest.mark.skipif(shutil.which("ip") is None, reason="needs iproute2")
def test_a_delay_line_that_cannot_start_stops_the_run_and_deletes_the_namespaces(monkeypatch,
                                                                                 tmp_path,
                                                                                 capsys):
    # The namespaces are recorded, not created, so the real delay line fails to enter its hub.
    fake = FakeRunner()
    monkeypatch.setattr(netlab, "run_command", fake)
    monkeypatch.setattr(netlab, "check_rights", lambda: None)
    code = steps.main(["--rtt-ms", "100", "--bandwidth-mbit", "40",
                       "--out", str(tmp_path / "x.json")])
    assert code == 1 and "the delay line did not start" in capsys.readouterr().err
    assert len(fake.added()) == 3 and sorted(fake.deleted()) == sorted(fake.added())
    assert not (tmp_path / "x.json").exists()


# --------------------------------------------------------------------------- the real lab


def _can_build_labs() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None or not Path("/dev/net/tun").exists():
        return False
    probe = f"gzn{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    if made:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return made


@pytest.mark.skipif(not _can_build_labs(),
                    reason="needs root, iproute2 and /dev/net/tun to build network namespaces")
def test_a_real_lab_adds_at_least_the_round_trip_between_workers():
    rtt = 40.0
    lab = netlab.Lab(2, "10.77.0.0/24", rtt_ms=rtt)
    before = len(netlab.LIVE)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            lab.create()
            launch.start_delay(lab, Path(tmp))
            lab.shape(100)
            measured = launch.measure_rtt(lab, Path(tmp), count=5)
            goodput = launch.measure_goodput(lab, 100, Path(tmp))
        finally:
            for proc in netlab.LIVE[before:]:
                netlab.kill_group(proc, grace=1.0)
            del netlab.LIVE[before:]
            assert lab.destroy() == []
    # A lower bound only: each request and reply waited rtt / 2 in the delay line.
    assert measured["min_ms"] >= rtt and len(measured["samples_ms"]) == 5
    assert goodput["bytes"] == int(100 * 1e6 / 8)  # every byte crossed the delay line
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert lab.hub not in names and not any(n in names for n in lab.names)


# --------------------------------------------------------------------------- the comparison


def _outer_doc(rtt: float, rows: dict[str, float], goodput: float = 38.0) -> dict:
    labels = {"none": "per-step none", "diloco30": "DiLoCo fp32 H=30"}
    return {"meta": {"args": {"bandwidth_mbit": [40.0], "workers": 2, "rtt_ms": rtt},
                     "goodput": {"40": {"mbit_per_s": goodput}}, "rtt": {"40": {"min_ms": rtt}},
                     "loadavg_start": [1.0], "loadavg_end": [1.0], "machine": {"cores": 2}},
            "rows": [{"method": m, "label": labels[m], "seconds_per_step": s, "steps_run": 60,
                      "bytes_per_worker_per_sync": 4_000_000, "loadavg_after": 1.0}
                     for m, s in rows.items()]}


def test_the_comparison_predicts_what_the_round_trip_adds_from_the_cost_model(tmp_path):

    cache = TimingCache(tmp_path / "timings.json")
    shapes = _outer_shapes(4_000_000, 2)
    for spec in ("none", "powersgd:rank=4"):
        cache.put(timing_key(spec, shapes), 0.0)
    # DiLoCo's row with the round trip is slower by its one exchange's round trip over H = 30
    # steps (a ring all-reduce between 2 workers: 2 hops of a round trip each), so compute is
    # the same.
    paths = []
    for rtt, diloco in ((0.0, 0.3), (100.0, 0.3 + 0.2 / 30)):
        paths.append(tmp_path / f"rtt{rtt:g}.json")
        paths[-1].write_text(json.dumps(_outer_doc(rtt, {"none": 1.2, "diloco30": diloco})))
    doc = netem_rtt.compare(paths, cache)
    calib = [r for r in doc["rows"] if r["method"] == "diloco30"]
    assert all(not r["scored"] and r["predicted_ms"] == pytest.approx(r["measured_ms"])
               for r in calib)
    assert calib[0]["compute_ms"] == pytest.approx(calib[1]["compute_ms"])
    added = {a["method"]: a for a in doc["added"]}
    assert added["none"]["predicted_added_ms"] == pytest.approx(200.0)
    assert added["none"]["measured_added_ms"] == pytest.approx(0.0)
    assert added["diloco30"]["predicted_added_ms"] == pytest.approx(200.0 / 30)
    text = netem_rtt.markdown(doc)
    assert "| 100 | per-step none |" in text and "calibration" in text
    paths[0].write_text(json.dumps(_outer_doc(50.0, {"none": 1.2, "diloco30": 0.3})))
    with pytest.raises(ValueError, match="one run with --rtt-ms 0"):
        netem_rtt.compare(paths, cache)


def test_the_probe_predicts_each_exchange_with_the_cost_models_link_time():
    record = {"world": 2, "methods": {
        "none": {"calls": [["all_reduce", 5_000_000]], "outer_steps": 0,
                 "exchange_seconds": [1.2, 1.1, 1.3], "step_seconds": [1.5, 1.4, 1.6]},
        "diloco30": {"calls": [["all_reduce", 5_000_000]], "outer_steps": 30,
                     "exchange_seconds": [1.0], "step_seconds": [0.3] * 30}}}
    rows = {r["method"]: r for r in netem_rtt_probe.summarise(record, 40.0, 100.0, 300.0)}
    # 2 workers: a ring all-reduce sends the message once and pays 2 hops of a round trip.
    assert rows["none"]["wire_bytes"] == 5_000_000 and rows["none"]["hops"] == 2
    assert rows["none"]["exchange_ms_predicted"] == pytest.approx(200.0 + 1000.0)
    assert rows["none"]["exchange_ms_measured"] == pytest.approx(1200.0)
    assert rows["none"]["step_ms_predicted"] == pytest.approx(1500.0)
    assert rows["diloco30"]["step_ms_predicted"] == pytest.approx(300.0 + 1200.0 / 30)
    with pytest.raises(SystemExit):
        netem_rtt_probe.parse_args(["--compute-ms", "-1"])
    words = [" ".join(c) for c in netem_rtt_probe.dry_run(netem_rtt_probe.parse_args(
        ["--rtt-ms", "100"]))]
    assert any("netem_delay serve" in w for w in words)
    assert words[-1].startswith("ip netns del")


def test_the_probe_comparison_counts_the_round_trips_an_exchange_paid(tmp_path):
    paths = []
    for rtt, seconds in ((0.0, 0.05), (100.0, 0.45)):
        record = {"world": 2, "methods": {"powersgd4": {
            "calls": [["all_reduce", 256_000], ["all_reduce", 16_000]], "outer_steps": 0,
            "exchange_seconds": [seconds] * 3, "step_seconds": [seconds + 0.3] * 3}}}
        doc = {"meta": {"args": {"rtt_ms": rtt, "compute_ms": 300.0},
                        "goodput": {"mbit_per_s": 40.0}, "rtt": {"min_ms": rtt}},
               "rows": netem_rtt_probe.summarise(record, 40.0, rtt, 300.0)}
        paths.append(tmp_path / f"p{rtt:g}.json")
        paths[-1].write_text(json.dumps(doc))
    rows = netem_rtt.compare_probes(paths[::-1])
    late = next(r for r in rows if r["rtt_ms"] == 100.0)
    assert late["measured_added_ms"] == pytest.approx(400.0)
    assert late["predicted_added_ms"] == pytest.approx(400.0)  # 2 all-reduces, 2 hops each
    text = netem_rtt.markdown({"meta": {"workers": 2, "link_mbit": 40.0, "bandwidth_mbit": 40.0,
                                        "runs": []}, "rows": [], "added": [], "probes": rows})
    assert "| 100 | powersgd4 | 2 (4) | 3 | 450 |" in text and "| 4.00 |" in text
    with pytest.raises(ValueError, match="one run with --rtt-ms 0"):
        netem_rtt.compare_probes(paths[1:])
