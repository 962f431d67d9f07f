"""Smoke tests of the emulated-network benchmarks (benchmarks/netem.py, netem_steps.py), their
workers and the lab they share (benchmarks/_netlab.py, _netlab_launch.py) that need no rights.

Nothing here creates a namespace or runs ``ip``/``tc``: the lab runs on a recording runner,
rights are checked through the function and the ``GRADZIP_NETEM_ASSUME_UNPRIVILEGED``
switch, and process handling is exercised on plain ``sleep`` children.
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from gradzip.comm.header import rider_bytes

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


sys.path.insert(0, str(BENCH))  # the scripts import the lab and their workers beside them
import _netlab as netlab  # noqa: E402
import _netlab_launch as launch  # noqa: E402
import netem  # noqa: E402
import netem_steps as steps  # noqa: E402
import netem_steps_worker as steps_worker  # noqa: E402
import netem_worker as worker  # noqa: E402


class FakeRunner:
    """Records commands; fails (or raises ``exc``) on the first command containing ``fail_on``."""

    def __init__(self, fail_on: str | None = None, exc: BaseException | None = None,
                 existing: Sequence[str] = ()) -> None:
        self.calls: list[list[str]] = []
        self.fail_on, self.exc, self.existing = fail_on, exc, list(existing)

    def __call__(self, argv: Sequence[str]) -> str:
        argv = list(argv)
        self.calls.append(argv)
        if self.fail_on is not None and self.fail_on in " ".join(argv):
            self.fail_on = None
            raise self.exc or netlab.LabError(f"`{' '.join(argv)}` failed (2): boom")
        if argv[:3] == ["ip", "netns", "list"]:
            return "".join(f"{n} (id: 0)\n" for n in self.existing)
        return ""

    def added(self) -> list[str]:
        return [c[3] for c in self.calls if c[:3] == ["ip", "netns", "add"]]

    def deleted(self) -> list[str]:
        return [c[3] for c in self.calls if c[:3] == ["ip", "netns", "del"]]


# --------------------------------------------------------------------------- pure helpers


def test_addresses_come_from_the_private_subnet_only():
    assert netlab.worker_addresses("10.77.0.0/24", 3) == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
    with pytest.raises(ValueError, match="private IPv4"):
        netlab.worker_addresses("8.8.8.0/24", 2)
    with pytest.raises(ValueError, match="private IPv4"):
        netlab.worker_addresses("fd00::/64", 2)
    with pytest.raises(ValueError, match="private IPv4"):
        netlab.worker_addresses("10.77.0.1/24", 2)  # host bits set: not a network
    with pytest.raises(ValueError, match="must hold 4 hosts"):
        netlab.worker_addresses("10.77.0.0/30", 4)


def test_namespace_names_match_the_cleanup_pattern_and_nothing_else():
    hub, names = netlab.namespace_names(4242, 3)
    assert hub == "gzn4242-hub" and names == ["gzn4242-w0", "gzn4242-w1", "gzn4242-w2"]
    assert all(netlab.NAME_RE.match(n) for n in [hub, *names])
    alive = {4242}
    found = netlab.stale_namespaces(
        ["gzn4242-w0", "gzn17-hub", "gzn17-w1", "gzn17-foo", "default", "gzn17-w1x"],
        lambda pid: pid in alive)
    assert found == ["gzn17-hub", "gzn17-w1"]


def test_shaping_is_tbf_alone_without_delay_and_under_netem_with_delay():
    delete, add = netlab.shaping_commands("ns", "eth0", 100, 0)
    assert delete == ["tc", "-n", "ns", "qdisc", "del", "dev", "eth0", "root"]
    assert add[:9] == ["tc", "-n", "ns", "qdisc", "add", "dev", "eth0", "root", "handle"]
    assert add[10:13] == ["tbf", "rate", "100mbit"] and "netem" not in add
    _, netem_cmd, tbf_cmd = netlab.shaping_commands("ns", "h1", 50, 2.5)
    assert netem_cmd[-3:] == ["netem", "delay", "2.5ms"] and netem_cmd[7:10] == ["root", "handle", "1:"]
    assert tbf_cmd[7:10] == ["parent", "1:", "handle"] and "50mbit" in tbf_cmd
    assert netlab.tbf_burst_bytes(10) == 32 * 1024
    assert netlab.tbf_burst_bytes(1000) == 250_000


def test_topology_commands_stay_inside_the_created_namespaces():
    hub, names = netlab.namespace_names(1, 2)
    cmds = netlab.topology_commands(hub, names, ["10.77.0.1", "10.77.0.2"], 24)
    ours = {hub, *names}
    for cmd in cmds:
        assert cmd[:2] == ["ip", "-n"] and cmd[2] in ours, cmd
        if "netns" in cmd:  # the veth's peer is created straight into a worker namespace
            assert cmd[cmd.index("netns") + 1] in names
    assert ["ip", "-n", names[1], "addr", "add", "10.77.0.2/24", "dev", "eth0"] in cmds
    assert not any("route" in cmd for cmd in cmds)  # no default route: nothing leaves


# --------------------------------------------------------------------------- rights


def test_rights_check_refuses_without_root():
    with pytest.raises(netlab.RightsError, match="needs root.*nothing was created"):
        netlab.check_rights(euid=1000, env={})
    with pytest.raises(netlab.RightsError, match="needs root"):
        netlab.check_rights(euid=0, env={netlab.UNPRIVILEGED_ENV: "1"})


def test_rights_check_needs_iproute2(monkeypatch):
    monkeypatch.setattr(netlab.shutil, "which", lambda tool: None if tool == "tc" else "/x")
    with pytest.raises(netlab.RightsError, match=r"iproute2 \(tc not found\)"):
        netlab.check_rights(euid=0, env={})
    monkeypatch.setattr(netlab.shutil, "which", lambda tool: "/x")
    netlab.check_rights(euid=0, env={})  # root with both tools: allowed


def test_command_line_refuses_without_rights_and_creates_nothing():
    env = {**os.environ, netlab.UNPRIVILEGED_ENV: "1"}
    done = subprocess.run([sys.executable, str(BENCH / "netem.py"), "--workers", "2",
                           "--bandwidth-mbit", "10"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "needs root" in done.stderr and "--dry-run" in done.stderr
    assert "ip netns" not in done.stdout


def test_first_namespace_failing_reads_as_missing_rights():
    fake = FakeRunner(fail_on="netns add")
    lab = netlab.Lab(2, runner=fake, pid=7)
    with pytest.raises(netlab.RightsError, match="cannot create network namespaces"):
        lab.create()
    assert lab.created == [] and lab.destroy() == [] and fake.deleted() == []


# --------------------------------------------------------------------------- cleanup


def test_lab_creates_then_deletes_exactly_its_namespaces():
    fake = FakeRunner()
    lab = netlab.Lab(3, runner=fake, pid=11)
    lab.create()
    assert fake.added() == ["gzn11-hub", "gzn11-w0", "gzn11-w1", "gzn11-w2"]
    assert lab.destroy() == []
    assert fake.deleted() == ["gzn11-w2", "gzn11-w1", "gzn11-w0", "gzn11-hub"]
    assert lab.created == []


def test_failure_midway_deletes_what_was_created():
    fake = FakeRunner(fail_on="link add h1")
    lab = netlab.Lab(3, runner=fake, pid=12)
    with pytest.raises(netlab.LabError, match="boom"):
        lab.create()
    lab.destroy()
    assert sorted(fake.deleted()) == sorted(fake.added())
    assert len(fake.deleted()) == 4


def test_interrupt_during_namespace_creation_still_deletes_it():
    fake = FakeRunner(fail_on="netns add gzn13-w1", exc=netlab.Interrupted("SIGINT"))
    lab = netlab.Lab(3, runner=fake, pid=13)
    with pytest.raises(netlab.Interrupted):
        lab.create()
    lab.destroy()
    # The namespace whose creation was cut short is deleted too (the deletion fails
    # harmlessly if it never came to exist); w2 was never attempted.
    assert fake.deleted() == ["gzn13-w1", "gzn13-w0", "gzn13-hub"]


def test_taken_names_are_refused_before_anything_is_created():
    fake = FakeRunner(existing=["gzn14-w1"])
    lab = netlab.Lab(2, runner=fake, pid=14)
    with pytest.raises(netlab.LabError, match="exist already"):
        lab.create()
    assert fake.added() == [] and lab.destroy() == [] and fake.deleted() == []


def test_failed_deletion_is_reported_and_the_rest_still_deleted():
    fake = FakeRunner()
    lab = netlab.Lab(2, runner=fake, pid=15)
    lab.create()
    fake.fail_on = "netns del gzn15-w1"
    errors = lab.destroy()
    assert len(errors) == 1 and "gzn15-w1" in errors[0]
    assert fake.deleted() == ["gzn15-w1", "gzn15-w0", "gzn15-hub"]


def test_shaping_a_kernel_without_the_qdisc_says_so():
    fake = FakeRunner(fail_on="netem", exc=netlab.LabError("Specified qdisc kind is unknown."))
    lab = netlab.Lab(2, runner=fake, pid=16)
    with pytest.raises(netlab.LabError, match="use --delay-ms 0"):
        lab.shape(100, 1.0)
    fake = FakeRunner()
    netlab.Lab(2, runner=fake, pid=16).shape(100, 0)
    shaped = {(c[2], c[6]) for c in fake.calls if c[4] == "add"}
    assert shaped == {("gzn16-w0", "eth0"), ("gzn16-w1", "eth0"),
                      ("gzn16-hub", "h0"), ("gzn16-hub", "h1")}
    fake = FakeRunner()
    netlab.Lab(2, runner=fake, pid=16).shape(100, 3)
    delayed = {(c[2], c[6]) for c in fake.calls if "netem" in c}
    assert delayed == {("gzn16-w0", "eth0"), ("gzn16-w1", "eth0")}  # one delay per path
    assert sum("tbf" in c for c in fake.calls) == 4


@pytest.mark.parametrize("exc, status", [(netlab.Interrupted("SIGTERM"), 130),
                                         (netlab.LabError("worker died"), 1)])
def test_main_cleans_up_on_interrupt_and_error(monkeypatch, tmp_path, exc, status):
    fake = FakeRunner()
    monkeypatch.setattr(netlab, "run_command", fake)
    monkeypatch.setattr(netlab, "check_rights", lambda: None)

    def boom(*args, **kwargs):
        raise exc

    monkeypatch.setattr(netem, "benchmark", boom)
    code = netem.main(["--workers", "2", "--bandwidth-mbit", "10",
                       "--out", str(tmp_path / "x.json")])
    assert code == status
    assert len(fake.added()) == 3 and sorted(fake.deleted()) == sorted(fake.added())
    assert not (tmp_path / "x.json").exists()


def test_a_signal_becomes_an_exception_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(netlab.Interrupted, match="SIGTERM"), netlab.signals_raise():
        os.kill(os.getpid(), signal.SIGTERM)
        signal.sigtimedwait([], 5)  # give the handler a chance to run
    assert signal.getsignal(signal.SIGTERM) is before


def _sleeper(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def test_wait_all_kills_the_rest_on_failure_and_on_timeout():
    slow, bad = _sleeper("import time; time.sleep(60)"), _sleeper("raise SystemExit(3)")
    assert netlab.wait_all([slow, bad], timeout=60) == "worker 1 exited with code 3"
    assert slow.poll() is not None  # killed, not left running
    slow = _sleeper("import time; time.sleep(60)")
    assert netlab.wait_all([slow], timeout=0.2).startswith("timed out")
    assert slow.poll() is not None
    ok = _sleeper("pass")
    assert netlab.wait_all([ok], timeout=60) is None


# --------------------------------------------------------------------------- arguments


@pytest.mark.parametrize("argv, message", [
    (["--workers", "1"], "`--workers` must be in [2, 64]"),
    (["--bandwidth-mbit", "0"], "`--bandwidth-mbit` values must be in (0, 100000]"),
    (["--delay-ms", "-1"], "`--delay-ms` must be in [0, 1000]"),
    (["--target", "1.5"], "`--target` must be in (0, 1]"),
    (["--subnet", "192.0.2.0/24"], "private IPv4"),
    (["--methods", "none", "none"], "must not repeat"),
    (["--methods", "none", "accordion:eta=0"], "accordion:eta=0.3,interval=11"),
    (["--window", "0"], "`--window` must be >= 1"),
])
def test_bad_arguments_are_refused(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        netem.parse_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_dry_run_pairs_every_namespace_with_its_deletion():
    args = netem.parse_args(["--workers", "2", "--bandwidth-mbit", "100", "20",
                             "--methods", "none", "accordion"])
    cmds = netem.dry_run(args)
    added = [c[3] for c in cmds if c[:3] == ["ip", "netns", "add"]]
    deleted = [c[3] for c in cmds if c[:3] == ["ip", "netns", "del"]]
    assert len(added) == 3 and deleted == added[::-1]
    assert sum("tbf" in c for c in cmds) == 2 * 4  # two rates x (2 worker + 2 hub ports)
    runs = [c for c in cmds if c[:3] == ["ip", "netns", "exec"]]
    assert len(runs) == 4 and runs[1][runs[1].index("--spec") + 1] == "accordion"


def test_worker_accepts_what_the_launcher_passes():
    args = netem.parse_args(["--stop-at-target", "--interval", "33", "--eta", "0.4"])
    argv = netem.worker_argv(args, "accordion", "/tmp/r.json")
    assert argv[1] == str(netem.WORKER)
    parsed = worker.parse_args(argv[2:])
    assert (parsed.spec, parsed.interval, parsed.eta, parsed.stop_at_target) == (
        "accordion", 33, 0.4, True)
    env = launch.worker_env("10.77.0.1", 29501, 2, 4)
    assert (env["MASTER_ADDR"], env["RANK"], env["WORLD_SIZE"], env["GLOO_SOCKET_IFNAME"]) == (
        "10.77.0.1", "2", "4", "eth0")


# --------------------------------------------------------------------------- summary


def _record(method: str, step: float, reached: int | None, wire: int) -> dict:
    n = 10
    accuracy = [0.5] * n if reached is None else [0.5] * (reached - 3) + [0.99] * (n - reached + 3)
    return {"method": method, "step_seconds": [step] * n, "steps_to_target": 1, "target": 0.98,
            "accuracy": accuracy, "compute_seconds": [0.05, 0.07],
            "allreduce_latency_seconds": 0.001,
            "hook_stats": [{"wire_bytes": wire * n, "dense_wire_bytes": 1000 * n,
                            "kernel_tx_bytes": wire * n + 50 * n}] * 2}


def test_summary_rows_speedups_and_table():
    rows = [netem.summarize(_record("none", 1.0, 8, 1000), 50, window=3),
            netem.summarize(_record("powersgd-r4", 0.25, 8, 20), 50, window=3),
            netem.summarize(_record("powersgd-r1", 0.2, None, 10), 50, window=3),
            netem.summarize({"method": "topk", "error": "timed out after 5 s"}, 50)]
    netem.add_speedups(rows)
    assert rows[0]["seconds_to_target"] == 8.0 and rows[0]["speedup_vs_none"] == 1.0
    assert rows[1]["speedup_vs_none"] == 4.0 and rows[1]["compression_rate"] == 50
    assert rows[1]["kernel_tx_bytes_per_step"] == 70
    assert rows[1]["compute_seconds"] == pytest.approx(0.06)
    assert rows[2]["seconds_to_target"] is None and rows[2]["speedup_vs_none"] is None
    table = netem.markdown_table(rows).splitlines()
    assert len(table) == 6 and all(line.count("|") == 10 for line in table)
    assert "| 50 Mbit/s | powersgd-r4 | 0.250 | 8 | 2.0 | 4.00x | 0 kB | 50x | 0.990 |" in table
    assert "not reached (best 0.500)" in table[4] and "failed: timed out" in table[5]


def test_target_needs_a_window_of_evaluations():
    acc = [0.5, 0.99, 0.5, 0.98, 0.98, 0.99, 0.97]
    assert netem.steps_to_target(acc, 0.98, 1) == 2
    assert netem.steps_to_target(acc, 0.98, 3) == 6
    assert netem.steps_to_target(acc, 0.98, 8) is None
    assert netem.steps_to_target([], 0.5, 1) is None


def test_accordion_variants_override_eta_and_interval_only():
    assert netem.parse_method("topk") == ("topk", {})
    assert netem.parse_method("accordion:eta=0.3,interval=11") == (
        "accordion", {"eta": 0.3, "interval": 11})
    for bad in ("accordion:steady=x", "topk:eta=0.3", "accordion:eta=-1", "accordion:interval=x",
                "accordion:eta=0.3,eta=0.4", "sign"):
        with pytest.raises(ValueError, match="--methods"):
            netem.parse_method(bad)
    args = netem.parse_args(["--methods", "accordion:interval=44"])
    argv = netem.worker_argv(args, "accordion:interval=44", "r.json")
    parsed = worker.parse_args(argv[2:])
    assert (parsed.spec, parsed.interval, parsed.eta, parsed.sync) == ("accordion", 44, 0.5, False)


def test_baselines_the_synchronous_hook_and_bucket_size_reach_the_worker():
    assert netem.parse_method("powersgd-r4:sync") == ("powersgd-r4", {"sync": 1})
    assert netem.parse_method("accordion:sync,eta=0.3") == ("accordion", {"sync": 1, "eta": 0.3})
    for bad in ("native:sync", "torch-fp16:sync", "none:sync,sync"):
        with pytest.raises(ValueError, match="--methods"):
            netem.parse_method(bad)
    args = netem.parse_args(["--bucket-cap-mb", "2"])
    parsed = worker.parse_args(netem.worker_argv(args, "fp16:sync", "r.json")[2:])
    assert (parsed.spec, parsed.sync, parsed.bucket_cap_mb) == ("fp16", True, 2.0)
    parsed = worker.parse_args(netem.worker_argv(args, "torch-fp16", "r.json")[2:])
    assert (parsed.spec, parsed.sync) == ("torch-fp16", False)
    fp16 = worker.BaselineStats(1000, 2, half=True)
    fp16.steps = 3
    assert fp16.stats() == {"steps": 3, "wire_bytes": 3 * 2000, "dense_wire_bytes": 3 * 4000}


def test_goodput_probe_counts_every_byte():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result: dict = {}
    receiver = threading.Thread(
        target=lambda: result.update(worker.goodput_recv(f"127.0.0.1:{port}", 3 << 20, 30)))
    receiver.start()
    worker.goodput_send(f"127.0.0.1:{port}", 3 << 20, 30)
    receiver.join(30)
    assert result["bytes"] == 3 << 20 and result["mbit_per_s"] > 0


# --------------------------------------------------------------------------- step times


def test_bandwidth_is_chosen_so_dense_communication_matches_compute():
    # 2 workers: a ring all-reduce sends the whole gradient once; 4 workers: 1.5 times it.
    assert steps.ring_wire_bytes(1000, 2) == 1000 and steps.ring_wire_bytes(1000, 4) == 1500
    grad = 15_663_656  # the default model's fp32 gradient
    rate = steps.choose_bandwidth(grad, 2, 0.1678)
    assert rate == 780  # 15.66 MB x 1514/1448 frame overhead x 8 bits / 0.1678 s, 2 figures
    seconds = steps.ring_wire_bytes(grad, 2) * steps.WIRE_OVERHEAD * 8 / (rate * 1e6)
    assert seconds == pytest.approx(0.1678, rel=0.01)  # comm at line rate ~ compute
    assert steps.choose_bandwidth(grad, 2, 0.1678, comm_compute=2.0) == 390
    assert steps.choose_bandwidth(grad, 4, 0.1678) == 1200
    assert steps.round_significant(1234.5) == 1200 and steps.round_significant(0.04567) == 0.046
    for bad in ((0, 2, 0.1), (grad, 1, 0.1), (grad, 2, 0.0), (grad, 2, -1.0)):
        with pytest.raises(ValueError, match="must be"):
            steps.choose_bandwidth(*bad)
    with pytest.raises(ValueError, match=r"\(0, 100000\] Mbit/s"):
        steps.choose_bandwidth(grad, 2, 1e-6)  # 130 Tbit/s: no link to emulate


def _steps_record(times: dict[str, list[list[float]]], sync: dict | None = None) -> dict:
    """A worker record: ``times[config][rank]`` = seconds per step in each round."""
    configs = list(times)
    ranks = []
    for r in range(len(next(iter(times.values())))):
        ranks.append({
            "seconds": {c: times[c][r] for c in configs},
            "cpu_seconds": {c: [t / 2 for t in times[c][r]] for c in configs},
            "allreduce_seconds": [0.1, 0.1],
            "kernel_tx_bytes_per_step": {c: 0.0 if c == "floor" else 2e6 for c in configs},
            "hook_bytes_per_step": {c: {"wire_bytes": 1e6} for c in configs
                                    if c.startswith("gradzip")},
            "buckets": {c: 4 for c in configs if c != "floor"},
        })
    return {"configs": configs, "world": len(ranks), "params": 100, "grad_bytes": 400,
            "sync_keyword": sync, "steps": 2, "rounds": len(ranks[0]["seconds"][configs[0]]),
            "ranks": ranks}


def test_ratios_are_medians_of_per_round_ratios_of_the_slowest_rank():
    # Round 2 is slow for everyone (another job): the per-round ratio stays 1.5.
    rec = _steps_record({"ddp": [[0.2, 0.4, 0.2], [0.1, 0.5, 0.2]],
                         "gradzip-none": [[0.3, 0.75, 0.3], [0.3, 0.6, 0.2]],
                         "floor": [[0.1, 0.2, 0.1], [0.1, 0.2, 0.1]]})
    times = steps.slowest_rank(rec["ranks"])
    assert times["ddp"] == [0.2, 0.5, 0.2] and times["gradzip-none"] == [0.3, 0.75, 0.3]
    assert steps.rank_mean(rec["ranks"], "cpu_seconds")["ddp"] == pytest.approx([0.075, 0.225, 0.1])
    assert steps.paired_ratio(times["gradzip-none"], times["ddp"]) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="equally long"):
        steps.paired_ratio([1.0], [1.0, 2.0])
    rows, _ = steps.summarise(rec)
    by = {r["config"]: r for r in rows}
    assert by["gradzip-none"]["ms_per_step"] == pytest.approx(300)
    assert by["gradzip-none"]["vs_ddp"] == pytest.approx(1.5)
    assert by["ddp"]["vs_floor"] == pytest.approx(2.0) and by["floor"]["vs_floor"] == 1
    assert by["floor"]["buckets"] is None and by["ddp"]["buckets"] == 4
    table = steps.markdown_table(rows).splitlines()
    assert len(table) == 5 and all(line.count("|") == 8 for line in table)
    assert "| gradzip-none | 4 | 300.0 | 1.500 | 3.000 | 150.0 | 2,000 |" in table
    assert "| floor | - | 100.0 | 0.500 | 1.000 | 50.0 | 0 |" in table


def test_comm_compute_ratio_uses_the_synchronous_dense_step():
    times = {"floor": [0.1, 0.2, 0.1], "gradzip-none": [0.2, 0.5, 0.25],
             "gradzip-none-sync": [0.3, 0.4, 0.2]}
    assert steps.dense_serial_config(list(times), {"synchronous": True}) == "gradzip-none-sync"
    # Before the hook has modes, gradzip none is itself synchronous; after, without its
    # synchronous variant, no configuration serialises compute and communication.
    assert steps.dense_serial_config(["floor", "gradzip-none"], None) == "gradzip-none"
    assert steps.dense_serial_config(["floor", "gradzip-none"], {"synchronous": True}) is None
    got = steps.comm_compute_ratio(times, "gradzip-none-sync")
    assert got["comm_seconds"] == pytest.approx(0.2) and got["ratio"] == pytest.approx(1.0)
    assert steps.comm_compute_ratio(times, None)["ratio"] is None


def test_verdicts_cover_every_target_and_hook_mode():
    t = {"floor": [1.0, 1.0], "ddp": [2.0, 2.0], "torch-fp16": [1.5, 1.5],
         "gradzip-none": [2.04, 2.06], "gradzip-fp16": [1.8, 1.8],
         "gradzip-powersgd-r4": [1.2, 1.2], "gradzip-none-sync": [3.0, 3.0]}
    got = steps.verdicts(t)
    assert [(v["config"], v["reference"]) for v in got] == [
        ("gradzip-none", "ddp"), ("gradzip-none-sync", "ddp"), ("gradzip-fp16", "torch-fp16"),
        ("gradzip-powersgd-r4", "ddp"), ("gradzip-powersgd-r4", "floor")]
    none, none_sync, fp16, speed, floor = got
    assert none["ratio"] == pytest.approx(1.025) and none["met"] is True
    assert none_sync["ratio"] == pytest.approx(1.5) and none_sync["met"] is False
    assert fp16["ratio"] == pytest.approx(1.2) and fp16["met"] is False
    assert speed["ratio"] == pytest.approx(2 / 1.2) and speed["met"] is True
    assert floor["ratio"] == pytest.approx(1.2) and floor["met"] is True
    assert len(steps.verdicts(t)) == 5  # only gradzip none has a synchronous variant here
    lines = [steps.verdict_line(v) for v in steps.verdicts(t)]
    assert lines[0] == ("met: gradzip none within 5% of native DDP "
                        "(gradzip-none / ddp = 1.025x, bound 1.05)")
    assert "ddp / gradzip-powersgd-r4 = 1.667x" in lines[3]
    assert lines[2].startswith("MISSED: gradzip fp16")
    partial = steps.verdicts({"floor": [1.0], "gradzip-powersgd-r4": [1.1]})
    assert [v["met"] for v in partial] == [None, None, None, True]
    assert steps.verdict_line(partial[0]).startswith("not measured")


def _register_sync(model, compressor, *, optimizer=None, synchronous=False): ...
def _register_async(model, compressor, *, optimizer=None, asynchronous=True): ...
def _register_mode(model, compressor, *, optimizer=None, mode="async"): ...
def _register_plain(model, compressor, *, optimizer=None, nonfinite="skip"): ...


def test_sync_mode_is_found_from_the_register_signature():
    assert steps_worker.sync_keyword(_register_sync) == {"synchronous": True}
    assert steps_worker.sync_keyword(_register_async) == {"asynchronous": False}
    assert steps_worker.sync_keyword(_register_mode) == {"mode": "sync"}
    assert steps_worker.sync_keyword(_register_plain) is None
    import gradzip.ddp

    found = steps_worker.sync_keyword(gradzip.ddp.register)  # the real one, before or after
    assert found is None or set(found) <= set(inspect.signature(gradzip.ddp.register).parameters)
    names = ["floor", "ddp", "gradzip-none", "gradzip-fp16"]
    assert steps_worker.expand_configs(names, None, ["default", "sync"]) == names
    assert steps_worker.expand_configs(names, {"synchronous": True}, ["default", "sync"]) == [
        "floor", "ddp", "gradzip-none", "gradzip-none-sync", "gradzip-fp16", "gradzip-fp16-sync"]
    assert steps_worker.expand_configs(names, {"synchronous": True}, ["sync"]) == [
        "floor", "ddp", "gradzip-none-sync", "gradzip-fp16-sync"]
    assert steps_worker.rotated(["a", "b", "c"], 4) == ["b", "c", "a"]


@pytest.mark.parametrize("launcher, work, tables", [
    (netem, worker, (worker.TRAINING_OPTIONS, worker.BUCKET_OPTIONS, worker.ACCORDION_OPTIONS)),
    (steps, steps_worker, (steps_worker.STEP_OPTIONS,)),
])
def test_every_passed_on_option_reaches_the_worker_unchanged(launcher, work, tables):
    options = [o for table in tables for o in table]
    values = {flag: {int: "7", float: "2.5", str: "topk:ratio=0.2"}[kind]
              for flag, kind, _, _ in options}
    values.update({"--target": "0.5"} if "--target" in values else {})
    argv = [word for item in values.items() for word in item]
    if launcher is netem:
        args = netem.parse_args([*argv, "--methods", "accordion"])
        sent = netem.worker_argv(args, "accordion", "r.json")[2:]
    else:
        args = steps.parse_args(argv)
        sent = steps.worker_argv(args, args.configs, args.rounds, "r.json")[2:]
    parsed = work.parse_args(sent)
    for flag, _, default, _ in options:
        name = flag[2:].replace("-", "_")
        assert getattr(parsed, name) == getattr(args, name) != default, flag


def test_step_worker_accepts_what_the_launcher_passes_and_dry_run_cleans_up():
    args = steps.parse_args(["--rounds", "7", "--bucket-cap-mb", "0.5", "--configs", "floor", "ddp"])
    parsed = steps_worker.parse_args(steps.worker_argv(args, args.configs, 7, "r.json")[2:])
    assert (parsed.rounds, parsed.bucket_cap_mb, parsed.configs, parsed.batch_size) == (
        7, 0.5, ["floor", "ddp"], 32)
    cmds = steps.dry_run(args)
    added = [c[3] for c in cmds if c[:3] == ["ip", "netns", "add"]]
    deleted = [c[3] for c in cmds if c[:3] == ["ip", "netns", "del"]]
    assert len(added) == 3 and deleted == added[::-1]
    runs = [c for c in cmds if c[:3] == ["ip", "netns", "exec"]]
    assert len(runs) == 2  # the compute probe (auto rate), then the timed run
    assert runs[0][runs[0].index("--configs") + 1:runs[0].index("--gradzip-modes")] == ["floor"]
    fixed = steps.dry_run(steps.parse_args(["--bandwidth-mbit", "300"]))
    assert sum(c[:3] == ["ip", "netns", "exec"] for c in fixed) == 1
    assert sum("300mbit" in c for c in fixed) == 4  # both directions of both links


@pytest.mark.parametrize("argv, message", [
    (["--bandwidth-mbit", "fast"], "must be 'auto' or a number"),
    (["--bandwidth-mbit", "0"], "must be in (0, 100000]"),
    (["--warmup", "2"], "`--warmup` must be >= 3"),
    (["--comm-compute", "0"], "`--comm-compute` must be > 0"),
    (["--configs", "ddp", "ddp"], "must not repeat"),
    (["--configs", "horovod"], "invalid choice"),
    (["--rounds", "0"], "`--rounds` must be >= 1"),
])
def test_step_benchmark_refuses_bad_arguments(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        steps.parse_args(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_step_benchmark_cleans_up_on_interrupt(monkeypatch, tmp_path):
    fake = FakeRunner()
    monkeypatch.setattr(netlab, "run_command", fake)
    monkeypatch.setattr(netlab, "check_rights", lambda: None)

    def boom(*args, **kwargs):
        raise netlab.Interrupted("SIGINT")

    monkeypatch.setattr(steps, "benchmark", boom)
    assert steps.main(["--out", str(tmp_path / "x.json")]) == 130
    assert len(fake.added()) == 3 and sorted(fake.deleted()) == sorted(fake.added())
    assert not (tmp_path / "x.json").exists()


def test_step_worker_times_every_configuration_over_real_gloo(tmp_path):
    """Two real gloo processes on 127.0.0.1 (no namespaces), a narrow model, one round."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = tmp_path / "r.json"
    argv = [sys.executable, str(BENCH / "netem_steps_worker.py"), "--result", str(result),
            "--rounds", "2", "--steps", "1", "--width", "4", "--batch-size", "2",
            "--bucket-cap-mb", "0.002", "--comm-probes", "1", "--collective-timeout", "60"]
    procs = [subprocess.Popen(argv, env={**os.environ, "MASTER_ADDR": "127.0.0.1",
                                         "MASTER_PORT": str(port), "RANK": str(r),
                                         "WORLD_SIZE": "2", "GLOO_SOCKET_IFNAME": "lo",
                                         "OMP_NUM_THREADS": "1"},
                              start_new_session=True) for r in range(2)]
    assert netlab.wait_all(procs, timeout=120) is None
    rec = json.loads(result.read_text())
    assert rec["configs"][:4] == ["floor", "ddp", "torch-fp16", "torch-powersgd-r4"]
    assert rec["grad_bytes"] == 4 * rec["params"] and len(rec["ranks"]) == 2
    buckets = rec["ranks"][0]["buckets"]
    assert buckets["ddp"] >= 4 and buckets["gradzip-powersgd-r4"] >= 4
    assert buckets["torch-powersgd-r4"] == 1  # its own cap: several buckets fail on gloo
    for r in rec["ranks"]:
        assert all(len(v) == 2 and min(v) > 0 for v in r["seconds"].values())
    hook = rec["ranks"][0]["hook_bytes_per_step"]
    # 2 workers: ring = 1x; plus each bucket's call header, riding in its all-reduce.
    header = rider_bytes(torch.float32, 2, summed=True)
    assert hook["gradzip-none"]["wire_bytes"] == rec["grad_bytes"] + buckets["gradzip-none"] * header
    assert 0 < hook["gradzip-powersgd-r4"]["wire_bytes"] < rec["grad_bytes"]
    rows, _ = steps.summarise(rec)
    assert {r["config"] for r in rows} == set(rec["configs"])


def test_report_states_link_ratio_load_and_verdicts():
    rec = _steps_record({"floor": [[0.1, 0.1]], "ddp": [[0.2, 0.2]],
                         "torch-powersgd-r4": [[0.15, 0.15]], "gradzip-none": [[0.21, 0.2]]})
    rec["ranks"][0]["buckets"]["torch-powersgd-r4"] = 1
    rows, times = steps.summarise(rec)
    cc = {**steps.comm_compute_ratio(times, "gradzip-none"), "allreduce_alone_ratio": 0.9,
          "line_rate_ratio": 0.95}
    meta = {"bandwidth_mbit": 780.0, "goodput": {"mbit_per_s": 747.7}, "world": 2,
            "params": 3_915_914, "grad_bytes": 15_663_656, "comm_compute": cc,
            "loadavg_start": (0.5, 0, 0), "loadavg_end": (1.25, 0, 0), "sync_keyword": None,
            "rounds": 2, "steps": 3}
    text = steps.report({"meta": meta, "rows": rows, "verdicts": steps.verdicts(times)})
    lines = text.splitlines()
    assert lines[0].startswith("link: 780 Mbit/s each way, measured goodput 748 Mbit/s; "
                               "2 workers; model 3.92 M parameters (15.7 MB")
    assert lines[1].startswith("comm : compute of a dense step: 1.05 : 1 measured "
                               "(gradzip-none minus the floor")
    assert "0.90 : 1 for a dense all-reduce alone; 0.95 : 1 at line rate" in lines[1]
    assert "load average: 0.50 at the start, 1.25 at the end" in lines[2]
    assert "torch-powersgd-r4 ran on 1 bucket(s) (others: 4)" in text
    assert "| gradzip-none | 4 | 205.0 | 1.025 | 2.050 |" in text
    assert "met: gradzip none within 5% of native DDP (gradzip-none / ddp = 1.025x" in text
    assert "not measured: gradzip fp16" in text
